"""What every benchmark script shares: the machine description and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info(device: str) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return info


def wait_for_graphs(llm, limit_s: float = 300.0) -> float:
    """Wait until the engine has captured every decode batch size it left for idle time, so
    that no timed request waits behind a capture (seconds waited). A capture takes 0.1-2.6 s
    on the H200 at the 8B shapes; timing before they end cost the 8k prefill 20% (2026-12-04,
    docs/benchmarks.md)."""
    t0 = time.perf_counter()
    while llm.stats().get("cuda_graph_sizes_pending", 0) > 0:
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError(f"decode graphs still pending after {limit_s:.0f} s")
        time.sleep(0.1)
    waited = time.perf_counter() - t0
    print(f"decode graphs all captured ({waited:.1f} s waited)", flush=True)
    return waited


def code_version() -> str | None:
    """The braid commit a result was measured at: $BRAID_CODE_VERSION where the command sets
    it (the GPU machine's copy of the tree has no .git, or a stale one), else `git rev-parse
    --short HEAD` with "-dirty" where tracked files differ from it, else None."""
    if os.environ.get("BRAID_CODE_VERSION"):
        return os.environ["BRAID_CODE_VERSION"]
    root = str(Path(__file__).resolve().parent.parent)

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def write_result(
    benchmark: str, device: str, out: str | None, fields: dict, *, script: str | None = None
) -> Path:
    """Write `fields` with the benchmark's name, date, command, commit and machine as JSON (default:
    results/<benchmark>_<device>.json) and return the path. `script` is the path the command
    line names (default: benchmarks/<benchmark>.py)."""
    script = script or f"benchmarks/{benchmark}.py"
    result = {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "code": code_version(),
        "device": device,
        "machine": machine_info(device),
        **fields,
    }
    path = Path(out) if out else RESULTS / f"{benchmark}_{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def _elapsed_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn` takes: CUDA events around it on a GPU (device time, no launch latency
    from the host clock), the host clock on a CPU."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(
    device: str, nbytes: int = 1 << 30, repeats: int = 20, per_repeat: int = 5
) -> dict[str, float]:
    """Measured device-to-device copy rate of an `nbytes` tensor into another, counted as bytes
    read + written (2 * nbytes per copy) per second; `per_repeat` back-to-back copies per timed
    repeat (so launch gaps are not timed as copying) after as many warm-up ones.

    Returns `bytes_per_s` (the best repeat: the rate the memory can reach, which is what a
    roofline needs), `median_bytes_per_s`, `tensor_bytes` and `repeats`."""
    dev = torch.device(device)
    numel = nbytes // 4
    times = _copy_times(dev, numel, repeats, per_repeat)
    moved = 2 * numel * 4 * per_repeat
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the tensors died with _copy_times
    return {
        "bytes_per_s": moved / min(times),
        "median_bytes_per_s": moved / statistics.median(times),
        "tensor_bytes": numel * 4,
        "repeats": repeats,
    }


def matmul_rate(
    device: str,
    n: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 10,
    per_repeat: int = 5,
) -> dict[str, float | str]:
    """Measured `torch.matmul` rate of two n x n matrices in `dtype`, in FLOP/s (2 n^3 per
    product); `per_repeat` back-to-back products per timed repeat after as many warm-up ones.

    Returns `flops_per_s` (the best repeat), `median_flops_per_s`, `n`, `dtype`, `repeats`."""
    dev = torch.device(device)
    times = _matmul_times(dev, n, dtype, repeats, per_repeat)
    flops = 2 * n**3 * per_repeat
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the matrices died with _matmul_times
    return {
        "flops_per_s": flops / min(times),
        "median_flops_per_s": flops / statistics.median(times),
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
    }


def _copy_times(dev: torch.device, numel: int, repeats: int, per_repeat: int) -> list[float]:
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def run() -> None:
        for _ in range(per_repeat):
            dst.copy_(src)

    run()
    return [_elapsed_s(run, dev) for _ in range(repeats)]


def _matmul_times(
    dev: torch.device, n: int, dtype: torch.dtype, repeats: int, per_repeat: int
) -> list[float]:
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=dev, dtype=dtype)

    def run() -> None:
        for _ in range(per_repeat):
            torch.matmul(a, b, out=c)

    run()
    return [_elapsed_s(run, dev) for _ in range(repeats)]
