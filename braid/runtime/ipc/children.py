"""The runtime's child processes (scheduler, detokenizer, tensor-parallel ranks): how they
start, and how they end with the process that started them (the caller).

They are forks of multiprocessing's fork server, which imports torch and the runtime's
process modules (`CHILD_PRELOAD`) once per caller process: each engine after the first in a
process starts 1.4 s sooner on the 2-core machine (docs/benchmarks.md, Start-up). A fork of
the server is made to be what a spawned child is, where that matters:

- the environment: the caller's as it is at the child's start (a fork has the server's, fixed
  when the server started). Variables read while torch imports (`IMPORT_TIME_ENV`: thread
  counts, torch's own) are fixed in the server: a child whose caller has changed one since
  is spawned instead;
- stdout and stderr: the caller's at the child's start, passed as file descriptors;
- braid itself: the server imports the caller's braid (its directory first on the server's
  path, the caller's working directory left off it: Python 3.11's fork server ignores the
  caller's `sys.path`), and a child checks that it runs the caller's; where the server's
  path lacks what the preload needs and the caller's has, its children import the modules
  themselves (correct, slower) and say so on stderr;
- `__main__`: hidden, so scripts need no `if __name__ == "__main__"` guard;
- death: with the caller (`die_with_parent`).

`BRAID_START_METHOD=spawn` spawns every child (each imports everything itself).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import forkserver, reduction
from multiprocessing.process import BaseProcess
from pathlib import Path

CHILD_PRELOAD = (
    "braid.runtime.scheduler.process",
    "braid.runtime.tokenizer.detokenizer_process",
)
START_METHOD_ENV = "BRAID_START_METHOD"
# Environment variables read while the preloaded modules import (libgomp's and the BLAS
# libraries' thread counts, torch's logging and the like): a child inherits the server's.
IMPORT_TIME_ENV = ("OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_", "TORCH", "PYTORCH", "TQDM_")

_lock = threading.Lock()  # the fork server's start, `__main__` while children start
_server: tuple[int, dict[str, str]] | None = None  # its pid and import-time environment


def runtime_process(target: Callable[..., None], args: tuple, name: str) -> BaseProcess:
    """A daemonic child (not started; `start_children` starts it) that runs `target(*args)`
    as described in the module docstring: forked from the fork server where it can be,
    spawned otherwise. `ValueError` for an unknown `BRAID_START_METHOD`."""
    method = os.environ.get(START_METHOD_ENV) or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be forkserver or spawn, got {method!r}")
    if method == "forkserver" and not _fork_server_fits():
        method = "spawn"
    caller = (dict(os.environ), _Stdio(), sys.modules["braid"].__file__, method == "forkserver")
    return mp.get_context(method).Process(
        target=_in_caller_state,
        args=(caller, target, *args),
        name=name,
        daemon=True,
    )


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV)}


def _fork_server_fits() -> bool:
    """Start the fork server unless it runs (preloaded, the caller's braid first on its path);
    whether this caller's children can be its forks (no fork server on this platform, or an
    import-time variable changed since it started: no)."""
    global _server
    if "forkserver" not in mp.get_all_start_methods():
        return False
    env = _import_time_env()
    with _lock:
        mp.get_context("forkserver").set_forkserver_preload(list(CHILD_PRELOAD))
        root = str(Path(__file__).resolve().parents[3])
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, saved["PYTHONPATH"]]))
        os.environ["PYTHONSAFEPATH"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        pid = forkserver._forkserver._forkserver_pid  # noqa: SLF001 - no public accessor
        if _server is None or _server[0] != pid:  # started now (the first time, or again)
            _server = (pid, env)
        return _server[1] == env


class _Stdio:
    """The caller's stdout and stderr at a child's start, pickled as file descriptors that
    multiprocessing passes to the child (a fork server's child would have the server's)."""

    def __reduce__(self):
        return (_received_fds, tuple(reduction.DupFd(fd) if _open(fd) else None for fd in (1, 2)))


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _received_fds(*fds) -> tuple[int | None, ...]:
    return tuple(None if f is None else f.detach() for f in fds)


def _in_caller_state(caller: tuple, target: Callable[..., None], *args) -> None:
    env, stdio, braid_file, forked = caller
    for fd, received in zip((1, 2), stdio):
        if received is not None and received != fd:
            os.dup2(received, fd)
            os.close(received)
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    here = sys.modules["braid"].__file__
    if os.path.realpath(here) != os.path.realpath(braid_file):
        raise RuntimeError(
            f"this runtime process imported braid from {here}, its caller from {braid_file}: "
            f"set {START_METHOD_ENV}=spawn"
        )
    missing = [m for m in CHILD_PRELOAD if m not in sys.modules]
    if forked and missing:
        # The server's path lacks what the caller's has (the server imports with its own
        # path): correct, but every start pays the imports.
        print(
            f"braid: the fork server could not import {', '.join(missing)}; each runtime "
            "process imports them itself (slower starts)",
            file=sys.stderr,
            flush=True,
        )
    target(*args)


def start_children(procs: Iterable[BaseProcess]) -> None:
    """Start `procs` (from `runtime_process`), hiding the caller's main script from them; if
    one fails to start, the ones started are killed before the error goes on."""
    started: list[BaseProcess] = []
    with without_main_reimport():
        try:
            for p in procs:
                p.start()
                started.append(p)
        except BaseException:
            for p in started:
                p.kill()
            raise


@contextmanager
def without_main_reimport() -> Iterator[None]:
    """Spawned children normally re-run the caller's main script, so a script without an
    `if __name__ == "__main__"` guard would start the engine again in every child. braid's
    children need nothing from `__main__`, so hide it from multiprocessing while they start
    (one caller at a time: two threads' save and restore would interleave)."""
    with _lock:
        main = sys.modules.get("__main__")
        saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(main, k, v)


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have this process killed when `parent_pid`, the process that started it, dies: a thread
    here waits on that process's pidfd (it needs the GIL to act: a native call holding it
    delays the end until it returns). Not Linux's parent-death signal: a fork server's child
    has the server for its parent, which outlives the caller while any of its children runs,
    and a spawned child's signal comes when the *thread* that started it ends
    (`TokenizerManager.spawn_early` starts them from a short-lived one). Without
    `parent_pid`, that signal (a no-op off Linux), for a child of a long-lived thread. The
    process loops also poll `parent_alive` as a fallback."""
    if parent_pid is not None:
        threading.Thread(
            target=_kill_self_when_gone, args=(parent_pid,), name="braid-parent", daemon=True
        ).start()
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def parent_alive(parent_pid: int) -> bool:
    """Whether `parent_pid`, the process that started this one, still runs (directly or, for
    a fork server's child, through the server)."""
    if os.getppid() == parent_pid:
        return True
    fd = _pidfd(parent_pid)
    if fd is None:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it runs, as another user
        return True
    return fd >= 0 and not _readable(fd, 0)


def _readable(fd: int, timeout_ms: int | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def _kill_self_when_gone(pid: int) -> None:
    fd = _pidfd(pid)
    if fd is not None and fd >= 0:
        _readable(fd, None)
    elif fd is None:
        while parent_alive(pid):
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


_PIDFDS: dict[int, int | None] = {}


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (opened once; readable once it has exited), None where the kernel has
    none; -1 where `pid` is already gone."""
    if pid not in _PIDFDS:
        try:
            _PIDFDS[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            _PIDFDS[pid] = -1
        except (OSError, AttributeError):
            _PIDFDS[pid] = None
    return _PIDFDS[pid]
