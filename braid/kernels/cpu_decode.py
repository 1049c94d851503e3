"""The native CPU decode forward (`native/cpu_decode.cpp`): built with the machine's g++ the
first time it is asked for, cached, and loaded into torch (`torch.classes.braid_cpu`).

The build takes about 10 s on a 2-core machine and happens once per machine, torch version
and source: the library lands in `<cache>/native/<key>/` under a key made of the source's
hash, torch's version and the CPU's model and flags (it is built with -march=native), so a
cache shared across machines never loads a library built for another CPU. A build writes to
a temporary name and renames it into place, so processes that build at once do not read a
half-written file.

`load_cpu_decoder` returns None, with the reason, where no compiler is found, the build fails
or hangs, or the library does not load: the runtime then keeps its Python decode path.
"""

from __future__ import annotations

import fcntl
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


# The /proc/cpuinfo fields that say what -march=native compiles for (x86: model and flags;
# Arm: implementer, part and features), first occurrence of each.
_CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")
# A build that takes longer than this has hung (it takes about 10 s on 2 cores).
BUILD_TIMEOUT_S = 300.0


def _cpu_identity() -> str:
    """What -march=native compiles for on this machine."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in _CPU_FIELDS and name not in found:
            found[name] = value.strip()
    return platform.machine() + "\n" + "\n".join(f"{k}: {v}" for k, v in sorted(found.items()))


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
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{compiler} took more than {BUILD_TIMEOUT_S:.0f} s") from e
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr[-2000:]}")


def build(cache_dir: Path, key: str | None = None) -> tuple[Path, float]:
    """The library's path under `cache_dir`, built if missing, and the seconds spent building
    (0.0 when it was there); `key`: `library_key()`, if the caller has it. Processes that ask
    at once build it once: the others wait on a lock file beside it. `RuntimeError` if it
    cannot be built."""
    target = cache_dir / (key or library_key()) / LIBRARY
    if target.exists():
        return target, 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built while this process waited
            return target, 0.0
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / LIBRARY
            _compile(partial)
            os.replace(partial, target)
    return target, time.perf_counter() - t0


# The library this process loaded, by key: torch registers its classes once per process, and
# loading a second copy (another cache directory, another source) would abort the process.
_loaded: dict[str, Path] = {}


def load_cpu_decoder(cache_dir: Path) -> tuple[type | None, str]:
    """`torch.classes.braid_cpu.CpuDecoder`, built under `cache_dir` if needed, and a line for
    the log: how long the build took, or why there is no class (then None). A process loads
    one library: asked again for the same key it reuses it wherever it lies; for another
    key (the source changed under a running process) it answers None."""
    key = library_key()
    if key in _loaded:
        return torch.classes.braid_cpu.CpuDecoder, f"native CPU decode loaded ({_loaded[key]})"
    if _loaded:
        return None, "native CPU decode unavailable: another build of it is loaded already"
    try:
        path, seconds = build(cache_dir, key)
        torch.ops.load_library(str(path))
    except Exception as e:  # any failure to build or load leaves the Python path
        return None, f"native CPU decode unavailable, the Python path runs: {e}"
    _loaded[key] = path
    how = f"built in {seconds:.1f} s" if seconds else "cached"
    return torch.classes.braid_cpu.CpuDecoder, f"native CPU decode loaded ({how}, {path})"
