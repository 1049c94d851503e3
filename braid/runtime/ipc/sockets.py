"""Socket addresses and helpers the runtime's processes share (how they start and end:
`children.py`)."""

from __future__ import annotations

import ctypes
import gc
import os
import socket
import tempfile
import time
from dataclasses import dataclass

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


def send(sock: zmq.Socket, msg: object) -> None:
    sock.send_multipart(codec.encode(msg), copy=False)
