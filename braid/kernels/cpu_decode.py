"""The native CPU decode forward (`native/cpu_decode.cpp`): built with the machine's g++ the
first time it is asked for, cached, and loaded into torch (`torch.classes.braid_cpu`).

The build takes about 10 s on a 2-core machine and happens once per machine, torch version
and source: the library lands in `<cache>/native/<key>/` under a key made of the source's
hash, torch's version and the CPU's model and flags (it is built with -march=native), so a
cache shared across machines never loads a library built for another CPU. A build writes to
a temporary name and renames it into place, so processes that build at once do not read a
half-written file.

`load_cpu_decoder` returns None, with the reason, where no compiler is found or the build
fails: the runtime then keeps its Python decode path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "native" / "cpu_decode.cpp"
LIBRARY = "braid_cpu_decode.so"
# -ffp-contract=off: no multiply-add fused, so the bits do not depend on the instructions
# the compiler chose (the source's header says why that matters).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC", "-w")


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith(("model name", "flags"))
    ]
    return "\n".join(keep[:2])


def library_key() -> str:
    """The cache key of the library this machine, torch and source build."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version, _cpu_identity(), " ".join(FLAGS)):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compile(out: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (g++ or c++ on PATH, or CXX)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(SOURCE), "-o", str(out)]
    cmd += [f"-I{p}" for p in include_paths()]
    cmd += [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr[-2000:]}")


def build(cache_dir: Path) -> tuple[Path, float]:
    """The library's path under `cache_dir`, built if missing, and the seconds spent building
    (0.0 when it was there). `RuntimeError` if it cannot be built."""
    target = cache_dir / library_key() / LIBRARY
    if target.exists():
        return target, 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / LIBRARY
        _compile(partial)
        os.replace(partial, target)
    return target, time.perf_counter() - t0


@functools.cache
def _load(path: str) -> None:
    torch.ops.load_library(path)


def load_cpu_decoder(cache_dir: Path) -> tuple[type | None, str]:
    """`torch.classes.braid_cpu.CpuDecoder`, built under `cache_dir` if needed, and a line for
    the log: how long the build took, or why there is no class (then None)."""
    try:
        path, seconds = build(cache_dir)
        _load(str(path))
    except (OSError, RuntimeError) as e:
        return None, f"native CPU decode unavailable, the Python path runs: {e}"
    how = f"built in {seconds:.1f} s" if seconds else "cached"
    return torch.classes.braid_cpu.CpuDecoder, f"native CPU decode loaded ({how}, {path})"
