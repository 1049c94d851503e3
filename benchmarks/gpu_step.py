"""Where a decode step's time goes, measured in process (no ZMQ, no front end).

    python benchmarks/gpu_step.py                  # Llama-3.1-8B shapes, batch 1, 128-token context
    python benchmarks/gpu_step.py --batch 32 --context 1024
    python benchmarks/gpu_step.py --extend 16x512      # one prefill step of 16 prompts of 512
    python benchmarks/gpu_step.py --method int4        # random weights quantized (quantization.py)

With dummy bf16 weights it reports, in one run:
- `graph_ms`: replaying the captured decode graph alone (CUDA events): the forward's GPU time;
  `graph_idle`: per replay, its kernels, their busy time and the gaps between them (what the
  launches cost beyond their work, inside the graph);
- `step_ms`: `Scheduler.step()` in a loop, with the overlapped schedule and without: what the
  sampler, the batch building and the host's per-step work add to the graph;
- `roofline_ms`: weight bytes / the copy rate measured in the same run;
- `kernels`: every kernel of one graph-replayed step under torch.profiler, grouped by name
  (GPU microseconds per step), and their sum: the step's time minus that sum is idle GPU.
With `--extend BxL` it times prefill steps instead: B fresh prompts of L tokens per step
(`extend_ms`, the model FLOP utilisation against the measured matmul rate, the kernels, and
`idle`: where the profiled step's GPU stood idle).
Writes benchmarks/results/gpu_step_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_bandwidth, matmul_rate, write_result  # noqa: E402
from benchmarks.gpu_cost import ModelCost  # noqa: E402
from braid import SamplingParams  # noqa: E402
from braid.runtime.config import EngineConfig  # noqa: E402
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402
from braid.runtime.scheduler.process import build_scheduler  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def _start(sched, batch: int, context: int, steps: int) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=steps * 4 + 64, ignore_eos=True)
    vocab = sched.vocab_size
    for b in range(batch):
        prompt = [(7 + 131 * b + 17 * i) % vocab for i in range(context)]
        sched.handle(GenerateReq(f"r{b}", prompt, sp, b))
    while len(sched.running) < batch:
        sched.step()


def _stop(sched, batch: int) -> None:
    for b in range(batch):
        sched.handle(AbortReq(f"r{b}"))
    while sched.has_work:
        sched.step()


def step_ms(sched, batch: int, context: int, steps: int, overlap: bool) -> float:
    sched.overlap = overlap
    _start(sched, batch, context, steps)
    for _ in range(10):
        sched.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps * 1e3
    _stop(sched, batch)
    return dt


def _decode_graph(sched, batch: int, context: int, steps: int):
    """`batch` requests of `context` tokens running (plain schedule, one step taken) and the
    captured decode graph their steps replay."""
    sched.overlap = False
    _start(sched, batch, context, steps)
    sched.step()
    graphs = sched.runner.graph_runner
    return graphs._graphs[graphs._bucket[batch]]


def graph_ms(sched, batch: int, context: int, steps: int) -> float:
    """The decode graph of this batch size replayed alone, over the inputs of a real step."""
    graph = _decode_graph(sched, batch, context, steps)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    _stop(sched, batch)
    return start.elapsed_time(end) / steps


def graph_gaps(sched, batch: int, context: int, replays: int = 5) -> dict:
    """Where the GPU idles inside one replay of the decode graph (`_idle`, each replay
    profiled on its own, averaged): its kernels, their busy time and the gaps between one
    kernel's end and the next one's start, which are what each launch costs beyond its work
    (under the profiler: compare with `graph_ms`)."""
    from torch.profiler import ProfilerActivity, profile

    graph = _decode_graph(sched, batch, context, 4)
    graph.replay()
    torch.cuda.synchronize()
    per = []
    for _ in range(replays):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
        kernels = [
            e for e in prof.events()
            if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))
        ]  # fmt: skip
        per.append((len(kernels), _idle(prof, wall_ms)))
    _stop(sched, batch)
    return {
        "kernels": statistics.median(n for n, _ in per),
        "busy_ms": statistics.median(i.get("busy_ms", 0.0) for _, i in per),
        "gaps_inside_ms": statistics.median(i.get("gaps_inside_ms", 0.0) for _, i in per),
        "widest_gaps": per[-1][1].get("widest_gaps", []),
    }


def kernel_table(sched, batch: int, context: int, steps: int) -> tuple[list[dict], float]:
    """GPU microseconds per step by kernel name over `steps` overlapped steps, and the total."""
    from torch.profiler import ProfilerActivity, profile

    sched.overlap = True
    _start(sched, batch, context, steps)
    for _ in range(5):
        sched.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
    _stop(sched, batch)
    return _kernel_rows(prof, steps)


def _kernel_rows(prof, steps: int) -> tuple[list[dict], float]:
    """The profiled kernels by name, slowest first, per step (GPU us and launches), and
    their total."""
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None)
        if us is None:
            us = evt.cuda_time_total
        if us > 0:
            rows.append(
                {"kernel": evt.key[:120], "calls_per_step": evt.count / steps, "us": us / steps}
            )
    rows.sort(key=lambda r: -r["us"])
    return rows, sum(r["us"] for r in rows)


def _idle(prof, wall_ms: float) -> dict:
    """Where one profiled step's GPU stood idle: the kernels' busy time (their union), the gaps
    between the first kernel's start and the last one's end, the rest of the step's wall time
    (host work before the first kernel and after the last), and the widest gaps with the
    kernels on either side."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    if not spans:
        return {}
    busy, gaps, reach, before = 0.0, [], spans[0][0], spans[0][2]
    for start, end, name in spans:
        if start > reach:
            gaps.append((start - reach, before, name))
        if end > reach:
            busy += end - max(start, reach)
            reach, before = end, name
    span_us = reach - spans[0][0]
    gaps.sort(reverse=True)
    return {
        "busy_ms": busy / 1e3,
        "gaps_inside_ms": (span_us - busy) / 1e3,
        "outside_kernels_ms": wall_ms - span_us / 1e3,
        "widest_gaps": [{"us": g, "after": a[:60], "before": b[:60]} for g, a, b in gaps[:6]],
    }


def extend_profile(sched, batch: int, length: int, repeats: int) -> tuple[float, list, float, dict]:
    """Best wall ms of a prefill step of `batch` fresh prompts of `length` tokens (each step
    admits exactly that batch; the requests are aborted after), one step's kernels and where
    that step's GPU stood idle (`_idle`)."""
    from torch.profiler import ProfilerActivity, profile

    sched.overlap = False
    vocab = sched.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, prof, idle = [], None, {}
    for rep in range(repeats + 2):
        for b in range(batch):
            # Fresh tokens each repeat: nothing comes from the prefix cache.
            prompt = [(rep * 7919 + b * 104729 + 31 * i) % vocab for i in range(length)]
            sched.handle(GenerateReq(f"e{rep}-{b}", prompt, sp, b))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rep == repeats + 1:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t1 = time.perf_counter()  # the step alone: not the profiler's start and stop
                sched.step()
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - t1) * 1e3
            idle = _idle(prof, wall_ms)
        else:
            sched.step()
            torch.cuda.synchronize()
        if rep >= 1:
            times.append((time.perf_counter() - t0) * 1e3)
        while sched.has_work:
            sched.step()
        sched.flush_cache()
    return (min(times), *_kernel_rows(prof, 1), idle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(CONFIGS / "llama-3.1-8b"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--extend", default=None, metavar="BxL", help="time prefill steps instead")
    ap.add_argument(
        "--method", default="float", help="float, int4, int8 or fp8 (as benchmarks/quantization.py)"
    )
    ap.add_argument("--group-size", type=int, default=128, help="int4's group")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_step.py: needs a CUDA device")
    model_dir = Path(args.model)
    if args.method != "float":
        from benchmarks.quantization import method_dir

        tmp = tempfile.TemporaryDirectory()
        model_dir = method_dir(Path(tmp.name), model_dir, args.method, args.group_size)
    cfg = ModelConfig.from_dir(model_dir)
    cost = ModelCost.of(cfg, torch.bfloat16)
    copy = copy_bandwidth("cuda")
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        kv_tokens=65536 + args.batch * (args.context + args.steps * 4 + 64),
        max_running_requests=max(8, args.batch),
        cuda_graph_max_bs=max(8, args.batch),
        show_progress=False,
    )
    if args.extend:
        b, _, length = args.extend.partition("x")
        b, length = int(b), int(length)
        config = EngineConfig(
            model=str(model_dir),
            load_format="dummy",
            dtype="bfloat16",
            kv_tokens=65536 + 2 * b * length,
            max_running_requests=max(8, b),
            max_prefill_tokens=b * length,
            chunked_prefill_size=b * length,
            disable_cuda_graph=True,
            show_progress=False,
        )
        sched = build_scheduler(config, model_dir, frozenset())
        mm = matmul_rate("cuda", 8192, torch.bfloat16)
        ms, kernels, total_us, idle = extend_profile(sched, b, length, 5)
        flops = b * cost.forward_flops(length)
        res = {
            "model": model_dir.name,
            "extend": {"batch": b, "length": length},
            "matmul": mm,
            "extend_ms": ms,
            "flops": flops,
            "mfu": flops / (ms / 1e3) / mm["flops_per_s"],
            "kernel_us_per_step": total_us,
            "kernels": kernels[:40],
            "idle": idle,
        }
        print(f"extend {b}x{length}: {ms:.2f} ms, MFU {res['mfu']:.3f}")
        print(f"profiled step's GPU: {json.dumps(idle)}")
        print(f"kernel ms per step | {total_us / 1e3:.3f}")
        for r in kernels[:25]:
            print(f"{r['us']:9.1f} us  x{r['calls_per_step']:6.1f}  {r['kernel'][:90]}")
        write_result("gpu_step", "cuda", args.out, res, script="benchmarks/gpu_step.py")
        return
    sched = build_scheduler(config, model_dir, frozenset())
    n, ctx, steps = args.batch, args.context, args.steps
    # What the model holds as loaded (a quantized model's packed weights and scales).
    weight_bytes = cost.weight_bytes
    if args.method != "float":
        model = sched.runner.model
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    res = {
        "model": Path(args.model).name,
        "method": args.method,
        "batch": n,
        "context": ctx,
        "steps": steps,
        "copy_bandwidth": copy,
        "weight_bytes": weight_bytes,
        "roofline_ms": weight_bytes / copy["bytes_per_s"] * 1e3,
        "graph_ms": graph_ms(sched, n, ctx, steps),
        "step_ms_overlap": step_ms(sched, n, ctx, steps, overlap=True),
        "step_ms_no_overlap": step_ms(sched, n, ctx, steps, overlap=False),
    }
    res["graph_idle"] = graph_gaps(sched, n, ctx)  # profiled: after the timings
    kernels, total_us = kernel_table(sched, n, ctx, min(steps, 50))
    res["kernel_us_per_step"] = total_us
    res["kernels"] = kernels[:40]
    for k in ("roofline_ms", "graph_ms", "step_ms_overlap", "step_ms_no_overlap"):
        print(f"{k:>20} | {res[k]:.3f}")
    print(f"{'kernel ms per step':>20} | {total_us / 1e3:.3f}")
    gi = res["graph_idle"]
    print(f"{'graph, per replay':>20} | {gi['kernels']:.0f} kernels, busy {gi['busy_ms']:.3f} ms, "
          f"gaps between them {gi['gaps_inside_ms']:.3f} ms")  # fmt: skip
    for r in kernels[:25]:
        print(f"{r['us']:9.1f} us  x{r['calls_per_step']:6.1f}  {r['kernel'][:90]}")
    write_result("gpu_step", "cuda", args.out, res, script="benchmarks/gpu_step.py")


if __name__ == "__main__":
    main()
