"""Socket addresses and helpers the runtime's processes share (how they start and end:
`children.py`)."""

from __future__ import annotations

import ctypes
import gc
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


class Outbox:
    """The front end's line to the scheduler. Requests submitted inside `together()` are held
    and sent as one `GenerateBatch` when it ends (or every `max_held` of them), so the
    scheduler admits them in one iteration; any other message flushes them first, so an
    abort never overtakes its request. A block is synchronous code on the front end's
    loop (no await inside: other coroutines' requests would join it)."""

    def __init__(self, sock: zmq.Socket, max_held: int = 4096) -> None:
        self.sock = sock
        self.max_held = max_held
        self._held: list[bytes] | None = None  # encoded `GenerateReq` bodies

    @contextmanager
    def together(self, cancel: Callable[[str], None] | None = None) -> Iterator[list[str]]:
        """Hold what is submitted in the block. The block adds the ids it submits to the list
        it gets; should it raise, `cancel` is called on each (nothing it sent stays behind)."""
        sent: list[str] = []
        outer = self._held is not None  # inside another block, which sends
        if not outer:
            self._held = []
        try:
            yield sent
        except BaseException:
            for rid in sent if cancel else ():
                cancel(rid)
            raise
        finally:
            if not outer:
                try:
                    self._flush()
                finally:
                    self._held = None

    def requests(self, encoded: list[list[bytes]]) -> None:
        """Send (or hold) one prompt's samples, each `codec.encode(GenerateReq)`'s frames:
        several go as one message."""
        if self._held is None:
            frames = (
                encoded[0] if len(encoded) == 1 else codec.batch_frames([f[1] for f in encoded])
            )
            self.sock.send_multipart(frames)
            return
        self._held += [f[1] for f in encoded]
        if len(self._held) >= self.max_held:
            self._flush()

    def send(self, msg: object, flags: int = 0) -> None:
        self._flush(flags)
        self.sock.send_multipart(codec.encode(msg), flags)

    def close(self) -> None:
        self.sock.close(0)

    def _flush(self, flags: int = 0) -> None:
        if self._held:
            held = self._held[:]
            self._held.clear()
            self.sock.send_multipart(codec.batch_frames(held), flags)
