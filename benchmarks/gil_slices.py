"""Why the scheduler process shortens its GIL slices (`scheduler.process.GIL_SLICE_S`).

One thread issues a stream of small torch ops, each of which releases the GIL (on CUDA: kernel
launches, as a decode-graph capture or a step does), first alone, then while another thread
runs pure Python (as the tokenizer's import and load do while the model loads), at CPython's
default switch interval and at braid's. At the default, each release can cost the launching
thread a whole 5 ms slice before it runs again.

    python benchmarks/gil_slices.py                 # CUDA if present, else CPU
    python benchmarks/gil_slices.py --ops 4000

Writes benchmarks/results/gil_slices_<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import write_result  # noqa: E402
from braid.runtime.scheduler.process import GIL_SLICE_S  # noqa: E402


def _ops(x: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        torch.mm(x, x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(1000))


def measure(x: torch.Tensor, n: int, interval: float, repeats: int) -> dict:
    """Median seconds over `repeats` for `n` ops alone and beside a busy thread, at `interval`."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        alone = statistics.median(_ops(x, n) for _ in range(repeats))
        stop = threading.Event()
        busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
        busy.start()
        try:
            beside = statistics.median(_ops(x, n) for _ in range(repeats))
        finally:
            stop.set()
            busy.join()
    finally:
        sys.setswitchinterval(old)
    return {"switch_interval_s": interval, "alone_s": alone, "beside_busy_thread_s": beside}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(64, 64, device=device)
    _ops(x, 100)  # warm-up
    rows = [measure(x, args.ops, s, args.repeats) for s in (0.005, GIL_SLICE_S)]
    for r in rows:
        slow = r["beside_busy_thread_s"] / r["alone_s"]
        print(
            f"switch interval {r['switch_interval_s'] * 1e3:.1f} ms: {args.ops} ops alone "
            f"{r['alone_s'] * 1e3:.0f} ms, beside a busy thread "
            f"{r['beside_busy_thread_s'] * 1e3:.0f} ms ({slow:.1f}x)"
        )
    write_result("gil_slices", device, args.out, {"ops": args.ops, "rows": rows})


if __name__ == "__main__":
    main()
