"""Socket addresses and process-lifecycle helpers shared by the runtime's processes."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import zmq

from braid.runtime.ipc import codec


@dataclass(frozen=True)
class Addresses:
    """ipc:// endpoints, unique per launch (a fresh temp dir)."""

    scheduler: str
    detokenizer: str
    tokenizer: str
    directory: str

    @classmethod
    def fresh(cls) -> Addresses:
        d = tempfile.mkdtemp(prefix="braid-ipc-")
        return cls(f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer", f"ipc://{d}/tokenizer", d)


# What a runtime child imports before its work: torch and the runtime's modules, 1.6 s of a
# scheduler's 2.2 s start on the 2-core machine. A fork server imports them once per caller
# process (`runtime_process`); each later child is a fork of it, with them imported.
CHILD_PRELOAD = (
    "braid.runtime.scheduler.process",
    "braid.runtime.tokenizer.detokenizer_process",
)
START_METHOD_ENV = "BRAID_START_METHOD"


def runtime_process(target: Callable[..., None], args: tuple, name: str) -> BaseProcess:
    """A daemonic child (not started) that runs `target(*args)` with this process's environment
    as it is now. It starts from multiprocessing's fork server, preloaded with `CHILD_PRELOAD`
    (spawned where there is no fork server); start it with `start_children`. A fork server's
    child would otherwise have the server's environment, fixed when the server started; the
    preloaded modules read none at import (only when called), so taking the caller's first
    thing gives the child what a spawned one gets. `BRAID_START_METHOD=spawn` spawns (each
    child imports everything itself, as before the fork server)."""
    method = os.environ.get(START_METHOD_ENV) or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be forkserver or spawn, got {method!r}")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(CHILD_PRELOAD))
    return ctx.Process(
        target=_in_environment, args=(dict(os.environ), target, *args), name=name, daemon=True
    )


def _in_environment(env: dict[str, str], target: Callable[..., None], *args) -> None:
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    target(*args)


def start_children(procs: Iterable[BaseProcess]) -> None:
    """Start `procs` (from `runtime_process`), hiding the caller's main script from them."""
    with without_main_reimport():
        for p in procs:
            p.start()


@contextmanager
def without_main_reimport() -> Iterator[None]:
    """Spawned children normally re-run the caller's main script, so a script without an
    `if __name__ == "__main__"` guard would start the engine again in every child. braid's
    children need nothing from `__main__`, so hide it from multiprocessing while they start."""
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
    here waits on that process's pidfd. Not Linux's parent-death signal: a fork server's child
    (`runtime_process`) has the server for its parent, which outlives the caller while any of
    its children runs, and a spawned child's signal comes when the *thread* that started it
    ends (`TokenizerManager.spawn_early` starts them from a short-lived one). Without
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


def _kill_self_when_gone(pid: int) -> None:
    fd = _pidfd(pid)
    if fd is not None and fd >= 0:
        select.select([fd], [], [])
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


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the model's and tokenizer's Python objects) out of
    the garbage collector's view. A full collection otherwise walks them all: some 200 000
    objects in the server process, a pause long enough to hold `/health` past 100 ms under
    load (measured: docs/benchmarks.md, Soak). Call once, when start-up is over."""
    gc.collect()
    gc.freeze()


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim`; a no-op elsewhere).
    Tensors of every batch size leave freed blocks that glibc keeps mapped, so a process's RSS
    would creep up with traffic it no longer holds; call when idle."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def since_process_start() -> float | None:
    """Seconds since this process started (Linux: /proc, in clock ticks), or None where that
    is unknown."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a server started next can bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return True
    return fd >= 0 and not select.select([fd], [], [], 0)[0]


def send(sock: zmq.Socket, msg: object) -> None:
    sock.send_multipart(codec.encode(msg), copy=False)
