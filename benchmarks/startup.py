"""Start to ready of `braid serve`, with the start-up overlap on and off in one run: the
runtime's processes started before the tokenizer loads (`BRAID_OVERLAP_STARTUP=1`) or after
it (`0`). Starts alternate between the two so that a machine's noise falls on both; each start
reports the time since its process started and the phases of its ready line.

    python benchmarks/startup.py                     # the embedded model, 3 starts of each
    python benchmarks/startup.py --model DIR --repeats 5 --server-args "--load-format dummy"
    python benchmarks/startup.py --config llama-3.1-8b --repeats 2 \
        --server-args "--load-format dummy"   # the H200 figure: the 8B shapes, CUDA graphs

On a machine whose caches are empty (Triton's kernels under braid's cache directory), the
first start is the fresh-machine figure and the later ones are second starts: each run records
its place in the order (`start`).

Writes benchmarks/results/startup_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from braid.runtime.ipc.sockets import free_port  # noqa: E402

READY = re.compile(r"ready at http://\S+ \((.*)\) in ([\d.]+) s: (.*)$")
INSIDE_LOAD = re.compile(r"model \S+ loaded: |CUDA graphs: ")
ALL_GRAPHS = "every decode batch size captured"
# The first constrained request's schema (`--first-request`): a small record.
FIRST_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def first_constrained_s(port: int) -> float:
    """Seconds for one JSON-schema completion (20 tokens of a token-id prompt) sent the moment
    the server is ready: what a first constrained request waits for (its compile, the grammar
    library's load, the mask path's first use)."""
    import httpx

    body = {
        "prompt": list(range(100, 116)),
        "max_tokens": 20,
        "temperature": 0.0,
        "json_schema": json.dumps(FIRST_SCHEMA),
    }
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed


def start_once(env: dict[str, str], extra: list[str], timeout: float, first_request: bool) -> dict:
    """One `braid serve` start, with `env` added to the environment, until its ready line
    (then, with `first_request`, one constrained request), then SIGTERM; its total, its phases
    and the scheduler's model-load and graph-capture lines (which split the scheduler's load)."""
    port = free_port()
    env = {**os.environ, **env}
    with tempfile.TemporaryFile("w+") as log:
        cmd = [sys.executable, "-m", "braid", "serve", "--port", str(port), *extra]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        started = time.monotonic()
        deadline = started + timeout
        line = None
        all_graphs_after_ready = None
        try:
            while line is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"braid serve did not become ready:\n{log.read()[-3000:]}")
                time.sleep(0.1)
                log.seek(0)
                line = next((x for x in log.read().splitlines() if READY.search(x)), None)
            ready_at = time.monotonic()
            first = first_constrained_s(port) if first_request else None
            # Decode graphs left for idle time: how long after ready until all are captured.
            log.seek(0)
            if "captured while the scheduler is idle" in log.read():
                while time.monotonic() < min(deadline, ready_at + 120) and proc.poll() is None:
                    log.seek(0)
                    if ALL_GRAPHS in log.read():
                        all_graphs_after_ready = time.monotonic() - ready_at
                        break
                    time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(60)
        log.seek(0)
        text = log.read()
    m = READY.search(line)
    # The scheduler's own lines before ready: weights loaded (in how long), graphs captured.
    inside = [x.split("] ", 1)[-1][:1200] for x in text.splitlines() if INSIDE_LOAD.search(x)]
    return {
        "total_s": float(m.group(2)),
        "first_constrained_request_s": first,
        "all_graphs_after_ready_s": all_graphs_after_ready,
        "phases": m.group(3),
        "model": m.group(1),
        "scheduler_lines": inside,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument(
        "--config",
        default=None,
        help="a config under benchmarks/configs (e.g. llama-3.1-8b) with --tokenizer's files",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: the embedded model's")
    ap.add_argument("--repeats", type=int, default=3, help="starts of each setting")
    ap.add_argument("--server-args", default="", help="extra `braid serve` flags")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--first-request",
        action="store_true",
        help="time one JSON-schema completion sent the moment each start is ready",
    )
    ap.add_argument(
        "--ab-env",
        default=None,
        help="alternate this environment variable between --ab-values (start-up overlap on) "
        "instead of the start-up overlap",
    )
    ap.add_argument(
        "--ab-values",
        default="1,0",
        help="--ab-env's two values, comma-separated (e.g. forkserver,spawn for "
        "BRAID_START_METHOD)",
    )
    ap.add_argument(
        "--fresh-triton",
        action="store_true",
        help="each start with an empty Triton cache (a fresh machine's compiles)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tokenizer and not args.config:
        ap.error("--tokenizer goes with --config")
    model = args.model
    if args.config:
        from benchmarks.structured_gpu import embedded_tokenizer_dir, model_dir

        tok = args.tokenizer or embedded_tokenizer_dir()
        model = str(model_dir(args.config, tok, Path(tempfile.mkdtemp()) / args.config))
    extra = (["--model", model] if model else []) + args.server_args.split()
    if args.ab_env:
        settings = {
            f"{args.ab_env}={v}": {args.ab_env: v, "BRAID_OVERLAP_STARTUP": "1"}
            for v in args.ab_values.split(",")
        }
    else:
        settings = {
            "overlap": {"BRAID_OVERLAP_STARTUP": "1"},
            "in_turn": {"BRAID_OVERLAP_STARTUP": "0"},
        }
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    start = 0
    for _ in range(args.repeats):
        for name, env in settings.items():
            start += 1
            if args.fresh_triton:
                env = {**env, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-")}
            r = {
                "start": start,
                **start_once(env, extra, args.timeout, args.first_request),
            }
            runs[name].append(r)
            print(f"{start}. {name:>8}: ready in {r['total_s']:.2f} s: {r['phases']}", flush=True)
            if r["first_constrained_request_s"] is not None:
                print(f"    first constrained request: {r['first_constrained_request_s']:.2f} s")
            if r["all_graphs_after_ready_s"] is not None:
                print(f"    every graph captured {r['all_graphs_after_ready_s']:.2f} s after ready")
            for x in r["scheduler_lines"]:
                print(f"    {x[:160]}", flush=True)
    summary = {
        name: {
            "best_s": min(r["total_s"] for r in rs),
            "median_s": statistics.median(r["total_s"] for r in rs),
        }
        for name, rs in runs.items()
    }
    print(summary)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fields = {
        "model": args.config or args.model or "smollm2-135m",
        "cpus": os.cpu_count(),
        "summary": summary,
        "fresh_triton": args.fresh_triton,
        "ab_env": args.ab_env,
    }
    write_result("startup", device, args.out, {**fields, "runs": runs})


if __name__ == "__main__":
    main()
