"""A grammar compile worker: a small process that compiles grammars of one backend for
`compile_pool`, which starts it as
`python -m braid.runtime.constrained.compile_worker TASKS RESULTS PARENT_PID BACKEND` and kills
it when a compile overruns its time limit.

TASKS and RESULTS are pipe fds. Each message is a frame: an 8-byte little-endian length, then
that many bytes. The worker imports BACKEND's library first (seconds for xgrammar, which
imports torch and transformers), while the parent builds what it sends first: the backend's
`worker_payload` as it is (outlines-core's pickled `Vocabulary`, xgrammar's serialized
`TokenizerInfo`). Then come the tasks, pickled, one `(kind, spec)` at a time; the worker
answers each, pickled, with `(artifact, None)` (the
backend's `worker_build`: an outlines-core `Index`, a serialized xgrammar `CompiledGrammar`) or
`(None, message)`, the message naming the field as the backend's `ValueError` does.

The worker never outlives its parent: it exits when the task pipe closes, and Linux kills it
(PR_SET_PDEATHSIG) when the parent thread that started it ends, which covers a parent killed
while the worker is deep in a compile. An outlines-core worker imports no torch, so it starts
quickly (measured: docs/benchmarks.md, Figures behind design choices); an xgrammar one imports
torch with xgrammar and takes seconds.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys
from typing import Any

from braid.runtime.constrained import get_grammar_backend

_HEADER = struct.Struct("<Q")


def write_frame(fd: int, data: bytes) -> None:
    """Write one frame (blocks until the reader has taken what the pipe cannot hold);
    `BrokenPipeError` if the reader is gone."""
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read_frame(fd: int) -> bytes | None:
    """The next frame's bytes, or None if the writer closed the pipe (or died mid-frame)."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    return _read_exactly(fd, _HEADER.unpack(header)[0])


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def compile_task(backend: Any, state: Any, task: tuple[str, Any]) -> tuple[Any, str | None]:
    """One task's answer: `backend`'s artifact for it, or the message of why the spec cannot be
    compiled."""
    kind, spec = task
    try:
        return backend.worker_build(state, kind, spec), None
    except ValueError as e:
        return None, str(e)
    except Exception as e:  # anything else fails this grammar alone, not the worker
        return None, f"{kind}: grammar compilation failed: {type(e).__name__}: {e}"


def _die_with_parent_thread() -> None:
    # ipc.sockets has the same call, but importing it loads zmq and the message codec.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the closed task pipe still ends an idle worker


def main(argv: list[str]) -> None:
    tasks, results, parent_pid = (int(a) for a in argv[:3])
    _die_with_parent_thread()
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent_pid:
        return  # the parent died before the line above took effect
    backend = get_grammar_backend(argv[3])
    payload = read_frame(tasks)
    if payload is None:
        return
    state = backend.worker_load(payload)
    while (data := read_frame(tasks)) is not None:
        answer = compile_task(backend, state, pickle.loads(data))
        write_frame(results, pickle.dumps(answer, pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    main(sys.argv[1:])
