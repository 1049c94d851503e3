"""Socket addresses and process-lifecycle helpers shared by the runtime's processes."""

from __future__ import annotations

import ctypes
import os
import signal
import tempfile
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


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (a no-op elsewhere); the process
    loops also poll `parent_alive` as a fallback."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def send(sock: zmq.Socket, msg: object) -> None:
    sock.send_multipart(codec.encode(msg), copy=False)


def recv(sock: zmq.Socket) -> object:
    return codec.decode(sock.recv_multipart())
