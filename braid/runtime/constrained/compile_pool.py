"""Compiling grammars off the scheduler's critical path, in worker processes that can be stopped.

An outlines-core compile cannot be interrupted and some take minutes (`(a|b)*a(a|b){14}` on
SmolLM2's vocabulary), so indexes are built in worker processes (`compile_worker`): when a
compile overruns its time limit its worker is killed and replaced, and no CPU keeps burning
for a request that has already failed.

The workers are `subprocess.Popen` children, not `multiprocessing` ones: the scheduler runs in
a daemonic multiprocessing process (`braid.runtime.launch.spawn_runtime`), and a daemonic
process may not start multiprocessing children. A spawned child would also import its target's
module (and so torch) and the parent's main module, where this worker imports outlines-core
alone, so it starts fast and stays small (measured with SmolLM2's vocabulary: docs/benchmarks.md,
Figures behind design choices).

What crosses the pipes: the `GrammarCompiler` (tokenizer, vocabulary, cache, forced strings)
stays in this process, built by the first compile as before. Each worker gets the outlines-core
`Vocabulary` once, pickled, and for each compile returns the `Index`, which outlines-core
pickles as bincode (a large regex's index is several times a JSON schema's). Loading it here is
quick but holds the GIL, against a far longer build (which releases the GIL, in the worker).
(Sizes and times measured: docs/benchmarks.md, Figures behind design choices.)

Threads: each worker has a driver thread here that starts it, feeds it tasks from a shared
queue and waits for its answers; a replacement starts as soon as a worker ends, before the
next task. The caller's thread only queues tasks and, when one overruns, writes a byte that
wakes the driver, which terminates the worker (SIGKILL after `STOP_GRACE_S`). Nothing starts
before the first `submit`, so a server without constrained requests pays nothing. The drivers
are daemon threads, and each worker dies with the driver thread that started it
(PR_SET_PDEATHSIG) or when its task pipe closes, so the scheduler process exits promptly and
leaves no worker behind.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from braid.runtime.constrained.compile_worker import read_frame, write_frame
from braid.runtime.constrained.grammar import CompiledGrammar, GrammarCompiler
from braid.runtime.constrained.spec import grammar_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

# An overrunning worker gets this long to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 0.5
TIMEOUT_HINT = "(the limit is grammar_compile_timeout_s, --grammar-compile-timeout)"
_WORKER_MODULE = "braid.runtime.constrained.compile_worker"
# The directory holding the `braid` package this module was imported from.
_BRAID_ROOT = Path(__file__).resolve().parents[3]


class _Worker:
    """A compile worker process and its pipes. Used by its driver thread alone, except `stop`,
    which the pool calls under its lock."""

    def __init__(self, vocabulary: bytes) -> None:
        tasks_in, self._tasks = os.pipe()
        self._results, results_out = os.pipe()
        self._wake_in, self._wake_out = os.pipe()
        self.stopping = False
        # The worker imports braid from wherever this process did, installed or not.
        path = [str(_BRAID_ROOT), os.environ.get("PYTHONPATH")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
        argv = [sys.executable, "-m", _WORKER_MODULE, str(tasks_in), str(results_out)]
        try:
            self.proc = subprocess.Popen(
                [*argv, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                pass_fds=(tasks_in, results_out),
                env=env,
            )
        except BaseException:
            self._close_pipes()
            raise
        finally:
            os.close(tasks_in)
            os.close(results_out)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._results, selectors.EVENT_READ)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        try:
            write_frame(self._tasks, vocabulary)
        except BrokenPipeError:
            self.close()
            raise OSError(f"the compile worker {self.exit_status} at start-up") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_status(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "is running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def compile(self, kind: str, spec: Any) -> tuple[Any, str | None] | None:
        """The worker's `(index, error message)` for one task, or None if it died or `stop`
        was called first."""
        try:
            write_frame(self._tasks, pickle.dumps((kind, spec), pickle.HIGHEST_PROTOCOL))
        except BrokenPipeError:
            return None
        events = self._selector.select()
        if any(key.fd == self._wake_in for key, _ in events):
            return None
        data = read_frame(self._results)
        return None if data is None else pickle.loads(data)

    def stop(self) -> None:
        """Make the driver give up the task at hand and close this worker. Never blocks."""
        self.stopping = True
        os.write(self._wake_out, b"\0")

    def close(self) -> None:
        """End the process (SIGTERM, then SIGKILL after `STOP_GRACE_S`), reap it and close the
        pipes."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._selector.close()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for fd in (self._tasks, self._results, self._wake_in, self._wake_out):
            os.close(fd)


@dataclass(eq=False)
class _Task:
    key: tuple[str, str]
    spec: Any
    future: Future[CompiledGrammar]
    worker: _Worker | None = None  # the worker compiling it, once one is

    @property
    def kind(self) -> str:
        return self.key[0]


class AsyncGrammarCompiler:
    """Compiles grammars in `workers` worker processes, started by the first `submit` and kept
    for later ones. The `GrammarCompiler` (which loads the tokenizer's vocabulary) is built by
    the first compile, off the caller's thread. Identical specs compiling at the same time share
    one compile. `submit` and `overran` never wait for a process; they are meant for one thread
    (the scheduler's)."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._make_compiler = make_compiler
        self._workers = workers
        self._compiler: GrammarCompiler | None = None
        self._vocabulary: bytes | None = None  # the compiler's, pickled for the workers
        self._build_lock = threading.Lock()
        self._lock = threading.Lock()  # guards what follows, and settles the futures
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._in_flight: dict[tuple[str, str], _Task] = {}
        self._live: set[_Worker] = set()
        self._drivers: list[threading.Thread] = []
        self._closed = False

    @property
    def compiler(self) -> GrammarCompiler | None:
        """The compiler, once some compile has built it."""
        return self._compiler

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the workers running now (for tests and operators)."""
        with self._lock:
            return sorted(w.pid for w in self._live)

    def submit(self, kind: str, spec: Any) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; already done on a cache hit. It fails with a
        `ValueError` naming the field when the spec cannot be compiled."""
        compiler = self._compiler
        if compiler is not None:
            hit = compiler.cached(kind, spec)
            if hit is not None:
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
        key = grammar_key(kind, spec)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler has been shut down")
            if not self._drivers:
                self._drivers = [
                    threading.Thread(target=self._drive, name=f"braid-grammar-{i}", daemon=True)
                    for i in range(self._workers)
                ]
                for t in self._drivers:
                    t.start()
            task = self._in_flight.get(key)
            if task is None:
                task = self._in_flight[key] = _Task(key, spec, Future())
                self._tasks.put(task)
        return task.future

    def overran(self, fut: Future[CompiledGrammar]) -> None:
        """Tell the pool that `fut` ran past its caller's time limit: its compile is given up (a
        running one's worker is killed and replaced, off this thread) and `fut` fails with a
        timeout `ValueError`, as do the requests sharing it."""
        with self._lock:
            task = next((t for t in self._in_flight.values() if t.future is fut), None)
            if task is None:
                return  # done already, or not ours
            timed_out = ValueError(f"{task.kind}: grammar compilation timed out {TIMEOUT_HINT}")
            self._settle(task, error=timed_out)
            if task.worker is not None:
                task.worker.stop()

    def wait(self, futures: list[Future[CompiledGrammar]], timeout_s: float) -> None:
        """Block until one of `futures` is done or `timeout_s` passes."""
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Fail the compiles not yet done, end the workers and their threads (waiting up to
        `timeout_s` for them); `submit` raises after this."""
        with self._lock:
            self._closed = True
            for task in list(self._in_flight.values()):
                self._settle(task, error=ValueError(f"{task.kind}: grammar compilation cancelled"))
                if task.worker is not None:
                    task.worker.stop()
            drivers, self._drivers = self._drivers, []
        for _ in drivers:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout_s
        for t in drivers:
            t.join(max(0.0, deadline - time.monotonic()))

    # ---- driver threads -------------------------------------------------------------------
    def _drive(self) -> None:
        worker = self._start_worker_or_log()
        while (task := self._tasks.get()) is not None:
            worker = self._run(task, worker)
        if worker is not None:
            self._end(worker)

    def _run(self, task: _Task, worker: _Worker | None) -> _Worker | None:
        """Compile `task` on `worker` (starting one if there is none); returns the worker for
        the next task."""
        if task.future.done():
            return worker  # it ran out of time while queued
        try:
            compiler = self._get_compiler()
            if worker is None:
                worker = self._start_worker()
        except Exception as e:  # a failing tokenizer load or start must fail one request
            with self._lock:
                self._settle(task, error=_as_value_error(task.kind, e))
            return worker
        with self._lock:
            if task.future.done():
                return worker
            task.worker = worker
        grammar = error = None
        try:
            answer = worker.compile(task.kind, task.spec)
            if answer is not None:
                index, message = answer
                if message is None:
                    grammar = compiler.add(task.kind, task.spec, index)
                else:
                    error = ValueError(message)
        except Exception as e:  # a garbled answer: treat the worker as broken
            answer, error = None, _as_value_error(task.kind, e)
        with self._lock:
            task.worker = None  # from here `overran` no longer reaches this worker
            replace = answer is None or worker.stopping
        if replace:
            self._end(worker)  # dead, stopped, or stopped just after it answered
        if answer is None and error is None:
            error = ValueError(
                f"{task.kind}: grammar compilation failed: the compile worker {worker.exit_status}"
            )
        with self._lock:
            self._settle(task, grammar, error)
        return self._start_worker_or_log() if replace else worker

    def _get_compiler(self) -> GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                compiler = self._make_compiler()
                self._vocabulary = pickle.dumps(compiler.vocabulary, pickle.HIGHEST_PROTOCOL)
                self._compiler = compiler
            return self._compiler

    def _start_worker(self) -> _Worker:
        self._get_compiler()
        assert self._vocabulary is not None
        worker = _Worker(self._vocabulary)
        with self._lock:
            self._live.add(worker)
        return worker

    def _start_worker_or_log(self) -> _Worker | None:
        """A fresh worker, or None if the pool is shutting down or one cannot start (logged;
        the next task tries again and fails with the reason)."""
        if self._closed:
            return None
        try:
            return self._start_worker()
        except Exception as e:  # reported to the next request as well
            logger.warning("a grammar compile worker did not start: %s: %s", type(e).__name__, e)
            return None

    def _end(self, worker: _Worker) -> None:
        worker.close()
        with self._lock:
            self._live.discard(worker)

    def _settle(
        self,
        task: _Task,
        grammar: CompiledGrammar | None = None,
        error: Exception | None = None,
    ) -> None:
        """Complete `task`'s future, unless something else has (the caller holds the lock)."""
        if self._in_flight.get(task.key) is task:
            del self._in_flight[task.key]
        if task.future.done():
            return
        if error is None:
            task.future.set_result(grammar)
        else:
            task.future.set_exception(error)


def _as_value_error(kind: str, e: Exception) -> ValueError:
    if isinstance(e, ValueError):
        return e
    return ValueError(f"{kind}: grammar compilation failed: {type(e).__name__}: {e}")


@dataclass
class _Pending(Generic[T]):
    item: T
    kind: str
    future: Future[CompiledGrammar]
    deadline: float


class PendingGrammars(Generic[T]):
    """Items (requests) waiting for their grammars, in arrival order, each with a deadline."""

    def __init__(self, compiler: AsyncGrammarCompiler, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"grammar compile timeout must be positive, got {timeout_s!r}")
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._items: list[_Pending[T]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return (p.item for p in self._items)

    def add(self, item: T, kind: str, spec: Any) -> None:
        fut = self.compiler.submit(kind, spec)
        self._items.append(_Pending(item, kind, fut, time.monotonic() + self.timeout_s))

    def remove(self, item: T) -> bool:
        """Stop waiting for `item`'s grammar (the compile, if running, still completes and is
        cached); returns whether it was waiting."""
        for p in self._items:
            if p.item is item:
                self._items.remove(p)
                return True
        return False

    def clear(self) -> list[T]:
        items = [p.item for p in self._items]
        self._items.clear()
        return items

    def poll(self) -> tuple[list[tuple[T, CompiledGrammar]], list[tuple[T, str]]]:
        """Take out the items whose grammar is ready, in arrival order, and those that failed
        or ran out of time, each with its error message. An item out of time stops its compile
        (see `AsyncGrammarCompiler.overran`), failing the later items that share it too."""
        ready: list[tuple[T, CompiledGrammar]] = []
        failed: list[tuple[T, str]] = []
        now = time.monotonic()
        keep = []
        for p in self._items:
            if p.future.done():
                error = p.future.exception()
                if error is None:
                    ready.append((p.item, p.future.result()))
                else:
                    failed.append((p.item, str(error)))
            elif now >= p.deadline:
                self.compiler.overran(p.future)
                failed.append(
                    (
                        p.item,
                        f"{p.kind}: grammar compilation timed out after {self.timeout_s:g} s "
                        + TIMEOUT_HINT,
                    )
                )
            else:
                keep.append(p)
        self._items = keep
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some grammar is ready or `timeout_s` passes (for a scheduler with
        nothing else to do)."""
        if self._items:
            self.compiler.wait([p.future for p in self._items], timeout_s)
