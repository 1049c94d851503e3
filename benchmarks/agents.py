"""Agent traffic (issue 23): ReAct-style braid programs arriving as a Poisson process, each
step a `gen` then a simulated tool call, on a KV pool small enough that programs compete for
it. Program completion time (arrival to end) p50/p99 and program throughput per scheduling
setup, all in one run:

- fcfs, lpm: SGLang's policies, no pins (SGLang keeps nothing for a program between calls);
- program: least attained service per program, with aging (`--schedule-policy program`);
- program-srpt: the program predicted to ask for the least work yet first, with aging
  (`--schedule-policy program-srpt`);
- program+pins, program-srpt+pins: the same, each program's KV pinned across its tool calls
  for a TTL that follows how long its tool calls take (program sessions), where the pin pays
  on this device and pool (`pin_cost.py`).

First the unloaded latency (the workload's first UNLOADED_SAMPLE programs, one at a time,
lpm; its p99 is the sample's longest); then lpm at each `--rates` until its p99 exceeds 4x
that; the setups are compared at that rate (the issue's load point), or at the last rate
(`load_point_reached` false). `--mix heavy` gives each program its own thought length from a
heavy-tailed (Pareto) distribution, where a few long programs hold much of the work: the mix
in which least attained service has short programs to protect (Autellix's workloads);
`uniform` (the default) thinks 12 tokens a step in every program.

    python benchmarks/programs.py --agent-traffic            # via programs.py
    python benchmarks/agents.py --programs 64 --rates 1,2,3   # directly
    python benchmarks/agents.py --gpu-config llama-3.1-8b --tokenizer DIR   # H200: 8B shapes,
                                                # random bf16 weights, SmolLM2's tokenizer

`--tool-scale 0.1` shortens every tool call tenfold (the tests' smoke runs; figures for the
docs keep 1.0, the issue's 50-500 ms).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import wait_for_graphs, write_result  # noqa: E402

import braid as sgl  # noqa: E402
from braid.lang.backends.engine import EngineBackend  # noqa: E402

SYSTEM = (
    "You are a research agent. You answer a question by thinking, then calling one tool, then "
    "reading what it returns, until you know the answer. Tools: search[query] looks up a "
    "short encyclopedia entry; lookup[term] finds a sentence in the last entry; finish[answer] "
    "ends the task. Keep each thought to one short sentence. Here is an example. Question: "
    "which river flows through the capital of Austria? Thought 1: I need the capital of "
    "Austria. Action 1: search[Austria]. Observation 1: Austria is a country in Central "
    "Europe; its capital is Vienna. Thought 2: Now the river of Vienna. Action 2: "
    "search[Vienna]. Observation 2: Vienna lies on the Danube. Action 3: finish[the Danube].\n"
)
TOPICS = ["glaciers", "volcanoes", "coral reefs", "deserts", "rainforests", "tundra", "estuaries"]
THOUGHT_TOKENS = 12  # `--mix uniform`: every thought
# `--mix heavy`: each program thinks at its own length, Pareto-distributed (shape 1.2: the
# longest few programs hold most of the decode work, Autellix's case), from 8 tokens a thought
# to at most 128.
HEAVY_MIN, HEAVY_SHAPE, HEAVY_MAX = 8, 1.2, 128
UNLOADED_SAMPLE = 8  # programs run one at a time for the unloaded latency


@sgl.function
def react(s, task, tools_ms, thought_tokens=THOUGHT_TOKENS):
    s += SYSTEM + f"Question: {task}\n"
    for k, ms in enumerate(tools_ms):
        s += f"Thought {k + 1}:"
        s += sgl.gen(f"thought{k}", max_tokens=thought_tokens, temperature=0, ignore_eos=True)
        s += f"\nAction {k + 1}: search["
        s[f"thought{k}"]  # the agent reads its thought to pick the tool call (waits for it)
        time.sleep(ms / 1000)  # the tool call
        s += f"{TOPICS[k % len(TOPICS)]}]\nObservation {k + 1}: "
        s += f"An entry about {TOPICS[(k + len(task)) % len(TOPICS)]} and how they form. " * 2
        s += "\n"


MIXES = ("uniform", "heavy")


def workload(
    n: int, rate: float, seed: int, mix: str = "uniform", tool_scale: float = 1.0
) -> list[tuple[float, dict]]:
    """(arrival time, program arguments) of `n` programs at `rate` per second (Poisson), 3-8
    steps each, tool calls of 50-500 ms (times `tool_scale`: a smoke run's shorter waits);
    thoughts of THOUGHT_TOKENS (`mix` uniform) or of a Pareto-distributed length per program
    (heavy). The same seed gives the same programs at every rate (and, uniform, the programs
    of earlier runs)."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}: one of {', '.join(MIXES)}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        steps = rng.randint(3, 8)
        task = f"what do {rng.choice(TOPICS)} have to do with {rng.choice(TOPICS)} (case {i})?"
        tools = [rng.randint(50, 500) for _ in range(steps)]
        args = {"task": task, "tools_ms": [round(ms * tool_scale) for ms in tools]}
        if mix == "heavy":
            think = HEAVY_MIN * rng.paretovariate(HEAVY_SHAPE)
            args["thought_tokens"] = min(HEAVY_MAX, int(think))
        out.append((t, args))
    return out


def run_traffic(backend, programs: list[tuple[float, dict]], pins: bool) -> dict:
    """Start each program at its arrival time (a thread each); completion times."""
    react.sessions = pins
    done: list[float] = [0.0] * len(programs)
    errors: list[str] = []
    t0 = time.perf_counter()

    def one(i: int, at: float, kwargs: dict) -> None:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        start = time.perf_counter()
        try:
            react.run(backend=backend, **kwargs)
        except Exception as e:  # report, never hide
            errors.append(f"{type(e).__name__}: {e}")
        done[i] = time.perf_counter() - start

    threads = [
        threading.Thread(target=one, args=(i, at, kw), daemon=True)
        for i, (at, kw) in enumerate(programs)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    react.sessions = True
    if errors:
        raise RuntimeError(f"{len(errors)} programs failed, first: {errors[0]}")
    ordered = sorted(done)
    return {
        "programs": len(programs),
        "p50_s": round(statistics.median(ordered), 3),
        "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "mean_s": round(statistics.fmean(ordered), 3),
        "wall_s": round(wall, 2),
        "programs_per_s": round(len(programs) / wall, 3),
        "completion_s": [round(t, 2) for t in done],  # each program's, in arrival order
    }


SETUPS = {  # name -> (schedule_policy, program pins)
    "fcfs": ("fcfs", False),
    "lpm": ("lpm", False),
    "program": ("program", False),
    "program+pins": ("program", True),
    "program-srpt": ("program-srpt", False),
    "program-srpt+pins": ("program-srpt", True),
}


def measure(
    model: str | None,
    kv_tokens: int,
    policy: str,
    programs,
    pins: bool,
    alone: bool = False,
    **engine: object,
) -> dict:
    """One engine under `policy` runs `programs` at their arrival times; `alone`: one at a
    time instead, each from an empty cache (the unloaded latency)."""
    with sgl.LLM(
        model, kv_tokens=kv_tokens, schedule_policy=policy, show_progress=False, **engine
    ) as llm:
        wait_for_graphs(llm)
        backend = EngineBackend(llm)
        react.run(backend=backend, task="warm up", tools_ms=[1])  # imports, first forwards
        llm.flush_cache()
        if alone:
            times = []
            for _, kwargs in programs:
                times.append(run_traffic(backend, [(0.0, kwargs)], pins)["p50_s"])
                llm.flush_cache()
            return {"programs": len(times), "times_s": times}
        before = llm.stats()
        samples: list[dict] = []
        done = threading.Event()

        def sample() -> None:  # the scheduler's counts, each second
            while not done.wait(1.0):
                samples.append(llm.stats())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            row = run_traffic(backend, programs, pins)
        finally:
            done.set()
            sampler.join()
        after = llm.stats()
        if samples:  # how many requests ran, and waited, on average
            for key in ("running_requests", "queued_requests"):
                row[f"{key}_mean"] = round(statistics.fmean(x[key] for x in samples), 2)
        row["prefill_tokens_computed"] = int(
            after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        )
        row["retractions"] = int(after["retractions"] - before["retractions"])
        for key in ("pins_expired", "pins_declined", "pins_released_for_room"):
            row[key] = int(after.get(key, 0) - before.get(key, 0))
        return row


def agent_traffic(
    model: str | None,
    n: int,
    rates: list[float],
    kv_tokens: int,
    seed: int = 0,
    mix: str = "uniform",
    setups: tuple[str, ...] = tuple(SETUPS),
    repeats: int = 1,
    tool_scale: float = 1.0,
    **engine: object,
) -> dict:
    """`setups`: which of SETUPS to compare (lpm always), each `repeats` times at the load
    point, in rounds of every setup (the figures: each one's median over its rounds).
    `engine`: further braid.LLM arguments (the GPU run's dummy weights and dtype). The
    unloaded latency: the workload's first UNLOADED_SAMPLE programs run one at a time under
    lpm; its p99 (the sample's longest) is what lpm's p99 under load is held against."""
    unknown = set(setups) - set(SETUPS)
    if unknown:  # before minutes of runs
        raise ValueError(f"unknown setups {sorted(unknown)}: choose from {', '.join(SETUPS)}")
    names = [n for n in SETUPS if n in setups or n == "lpm"]
    sample = workload(min(n, UNLOADED_SAMPLE), 1.0, seed, mix, tool_scale)
    alone = measure(model, kv_tokens, "lpm", sample, False, alone=True, **engine)["times_s"]
    unloaded, unloaded_p99 = statistics.median(alone), max(alone)
    print(f"agents: unloaded p50 {unloaded:.2f} s, p99 {unloaded_p99:.2f} s: {alone}", flush=True)
    sweep, chosen = [], rates[-1]
    for rate in rates:
        programs = workload(n, rate, seed, mix, tool_scale)
        row = measure(model, kv_tokens, "lpm", programs, False, **engine)
        row["rate"] = rate
        sweep.append(row)
        print(f"agents: lpm at {rate}/s: {_brief(row)}", flush=True)
        if row["p99_s"] > 4 * unloaded_p99:
            chosen = rate
            break
    programs = workload(n, chosen, seed, mix, tool_scale)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(repeats):  # rounds of every setup, one after the other
        for name in names:
            policy, pins = SETUPS[name]
            if name == "lpm" and round_ == 0 and sweep[-1]["rate"] == chosen:
                row = {k: v for k, v in sweep[-1].items() if k != "rate"}
            else:
                row = measure(model, kv_tokens, policy, programs, pins, **engine)
            runs[name].append(row)
            print(f"agents: {name} at {chosen}/s (round {round_ + 1}): {_brief(row)}", flush=True)
    rows = {name: _median_row(rs) for name, rs in runs.items()}
    lpm_p50 = rows["lpm"]["p50_s"]
    for name, row in rows.items():
        row["p50_vs_lpm"] = round(lpm_p50 / row["p50_s"], 2)
        if repeats > 1:  # each round's setup against that round's lpm
            row["p50_vs_lpm_rounds"] = [
                round(a["p50_s"] / b["p50_s"], 2) for a, b in zip(runs["lpm"], runs[name])
            ]
    return {
        "programs": n,
        "kv_tokens": kv_tokens,
        "mix": mix,
        "unloaded_s": round(unloaded, 3),
        "unloaded_p99_s": round(unloaded_p99, 3),
        "unloaded_times_s": alone,
        "load_point_reached": sweep[-1]["p99_s"] > 4 * unloaded_p99,
        "lpm_sweep": sweep,
        "rate": chosen,
        "setups": rows,
        "repeats": repeats,
        "tool_scale": tool_scale,
    }


def _brief(row: dict) -> dict:
    """A row for the log: without each program's completion time."""
    return {k: v for k, v in row.items() if k != "completion_s"}


def _median_row(rows: list[dict]) -> dict:
    """One setup's rounds: each figure's median, and each round's p50 (one round: itself). A
    figure some round lacks (the running and queued means of a round shorter than the
    sampler's second) is left out."""
    if len(rows) == 1:
        return dict(rows[0])
    keys = [k for k in rows[0] if k != "completion_s" and all(k in r for r in rows)]
    out = {k: statistics.median(r[k] for r in rows) for k in keys}
    out["completion_s_rounds"] = [r["completion_s"] for r in rows]
    out["p50_rounds_s"] = [r["p50_s"] for r in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--rates", default="0.5,1,2,4", help="programs per second, tried in order")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument(
        "--mix",
        choices=MIXES,
        default="uniform",
        help="thought lengths: 12 tokens each (uniform) or Pareto-distributed per program, "
        f"{HEAVY_MIN}-{HEAVY_MAX} tokens (heavy)",
    )
    ap.add_argument(
        "--setups", default=",".join(SETUPS), help="which setups to compare (default: all)"
    )
    ap.add_argument(
        "--gpu-config",
        default=None,
        help="a config under benchmarks/configs (e.g. llama-3.1-8b): its shapes with random "
        "bf16 weights on CUDA, instead of --model",
    )
    ap.add_argument(
        "--tokenizer", type=Path, default=None, help="with --gpu-config (default: SmolLM2's)"
    )
    ap.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="max_running_requests for every setup's engine (default: the engine's own)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every setup at the load point, in rounds (a CPU run varies by a third)",
    )
    ap.add_argument(
        "--tool-scale",
        type=float,
        default=1.0,
        help="times each simulated tool call's 50-500 ms (a smoke run's shorter waits)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.tool_scale <= 0:
        ap.error(f"--tool-scale must be positive, got {args.tool_scale}")
    engine = {} if args.max_running is None else {"max_running_requests": args.max_running}
    rates = [float(r) for r in args.rates.split(",")]
    names = tuple(args.setups.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model, device = args.model, "cpu"
        if args.gpu_config is not None:
            import torch
            from structured_gpu import embedded_tokenizer_dir, model_dir

            tokenizer = args.tokenizer or embedded_tokenizer_dir()
            model = str(model_dir(args.gpu_config, tokenizer, Path(tmp) / "m"))
            engine |= {"load_format": "dummy", "dtype": "bfloat16"}
            device = "cuda" if torch.cuda.is_available() else "cpu"
        res = agent_traffic(
            model,
            args.programs,
            rates,
            args.kv_tokens,
            mix=args.mix,
            setups=names,
            repeats=args.repeats,
            tool_scale=args.tool_scale,
            **engine,
        )
    if args.gpu_config is not None:
        res["config"] = args.gpu_config
    write_result("agents", device, args.out, res)
    for name, row in res["setups"].items():
        print(
            f"{name:>13}: p50 {row['p50_s']:.2f} s  p99 {row['p99_s']:.2f} s  "
            f"{row['programs_per_s']:.2f} programs/s  p50 vs lpm {row['p50_vs_lpm']}x"
        )


if __name__ == "__main__":
    main()
