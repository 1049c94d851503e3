"""Compiling grammars off the scheduler's critical path, time-limited per request.

Each constraint goes to its candidate backends in turn (`GrammarCompiler.candidates`: one may
refuse a spec only when compiling it), and every backend compiles in worker processes
(`compile_worker`): a compile cannot be interrupted, and each library has inputs that take
minutes (outlines-core on `(a|b)*a(a|b){14}` over SmolLM2's vocabulary; xgrammar on a 70 kB
schema; llguidance's pure-Python GBNF converter, holding the GIL, on a long grammar) or crash
the process (llguidance on a Lark grammar of 2000 chained rules: SIGSEGV). When a compile
overruns its time limit its worker is killed and replaced, so no CPU keeps burning for a
request that has already failed; a crashed worker fails its request alone.

The workers are `subprocess.Popen` children, not `multiprocessing` ones: the scheduler runs in
a daemonic multiprocessing process (`braid.runtime.launch.spawn_runtime`), and a daemonic
process may not start multiprocessing children. A spawned child would also import its target's
module and the parent's main module, where this worker imports its backend alone: an
outlines-core or llguidance worker starts fast and stays small (measured with SmolLM2's
vocabulary: docs/benchmarks.md, Figures behind design choices); an xgrammar one imports torch
(xgrammar does) and takes seconds to start.

What crosses the pipes: the `GrammarCompiler` (tokenizer, vocabulary, cache, the backends'
views of the vocabulary) stays in this process, built by the first compile. Each worker serves
one backend and gets that backend's `worker_payload` once (outlines-core's pickled
`Vocabulary`, xgrammar's serialized `TokenizerInfo`, nothing for llguidance); for each compile
it returns the backend's artifact (an outlines-core `Index`, pickled as bincode, a large
regex's several times a JSON schema's; xgrammar's JSON serialization of the compiled grammar;
llguidance's checked grammar text), which the backend loads here.
Loading is quick but holds the GIL, against a far longer build (which releases the GIL, in the
worker). (Sizes and times measured: docs/benchmarks.md, Figures behind design choices.)

Threads: each driver thread takes tasks from a shared queue; it starts a worker of the
configured backend at once, one of another backend the first time a task goes there, and a
replacement as soon as one ends, before the next task. A worker starts before its payload is
made, and imports its library meanwhile. The caller's thread only queues tasks and, when one
overruns, writes a byte that wakes the driver, which terminates the worker (SIGKILL after
`STOP_GRACE_S`). Nothing starts before the first `submit` or `start` (which a GPU scheduler
calls as its load begins: the workers import their library while the weights load), so a CPU
server without constrained requests pays nothing. The drivers are daemon threads, and each
worker dies with the driver thread that started it (PR_SET_PDEATHSIG) or when its task pipe
closes, so the scheduler process exits promptly and leaves no worker behind.
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
from braid.runtime.constrained.grammar import CompiledGrammar, GrammarCompiler, matches_nothing
from braid.runtime.constrained.spec import check_spec, grammar_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

# An overrunning worker gets this long to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 0.5
TIMEOUT_HINT = "(the limit is grammar_compile_timeout_s, --grammar-compile-timeout)"
_WORKER_MODULE = "braid.runtime.constrained.compile_worker"
# The directory holding the `braid` package this module was imported from.
_BRAID_ROOT = Path(__file__).resolve().parents[3]
# Keeps the worker's working directory (or script directory) off its sys.path.
_SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()


class _Worker:
    """A compile worker process of one backend, and its pipes. Used by its driver thread
    alone, except `stop`, which the pool calls under its lock."""

    def __init__(self, backend: str) -> None:
        """Start the process, which imports `backend`'s library and waits for `send_payload`."""
        self.backend = backend
        tasks_in, self._tasks = os.pipe()
        self._results, results_out = os.pipe()
        self._wake_in, self._wake_out = os.pipe()
        self.stopping = False
        # The worker imports braid from wherever this process did, installed or not, and
        # nothing from the directory the server was started in (a `json.py` there would run
        # in every worker): it starts in the root directory, with `-P` (Python 3.11+) keeping
        # even that off sys.path, and relative PYTHONPATH entries made absolute first.
        inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        path = [str(_BRAID_ROOT), *(os.path.abspath(p) for p in inherited if p)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        argv = [sys.executable, *_SAFE_PATH, "-m", _WORKER_MODULE, str(tasks_in), str(results_out)]
        try:
            self.proc = subprocess.Popen(
                [*argv, str(os.getpid()), backend],
                stdin=subprocess.DEVNULL,
                pass_fds=(tasks_in, results_out),
                env=env,
                cwd=os.sep,
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

    def send_payload(self, payload: bytes) -> None:
        """Send the backend's `worker_payload`, before any task; `OSError` if the worker died."""
        try:
            write_frame(self._tasks, payload)
        except BrokenPipeError:
            try:  # reaped, so that the message says how it ended
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
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
        """The worker's `(artifact, error message)` for one task, or None if it died or `stop`
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
    started: float | None = None  # when a worker began compiling it (time.monotonic)

    @property
    def kind(self) -> str:
        return self.key[0]


class AsyncGrammarCompiler:
    """Compiles grammars on `workers` driver threads (each with its worker processes, for the
    backends that compile in one), started by the first `submit` and kept for later ones. The
    `GrammarCompiler` (which loads the tokenizer's vocabulary) is built by the first compile,
    off the caller's thread. Identical specs compiling at the same time share one compile.
    `submit` and `overran` never wait for a process; they are meant for one thread (the
    scheduler's)."""

    def __init__(
        self,
        make_compiler: Callable[[], GrammarCompiler],
        workers: int = 2,
        backend: str | None = None,
    ) -> None:
        """`backend`: the compiler's configured backend, if known before it is built: `start`
        then starts its workers before the compiler is built, and they import their library
        meanwhile."""
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._make_compiler = make_compiler
        self._backend = backend
        self._workers = workers
        self._compiler: GrammarCompiler | None = None
        self._payloads: dict[str, bytes] = {}  # each worker backend's, for its workers
        self._build_lock = threading.Lock()
        self._lock = threading.Lock()  # guards what follows, and settles the futures
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._in_flight: dict[tuple[str, str], _Task] = {}
        self._task_of: dict[Future[CompiledGrammar], _Task] = {}  # the in-flight ones
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
            self._start_drivers()
            task = self._in_flight.get(key)
            if task is None:
                task = self._in_flight[key] = _Task(key, spec, Future())
                self._task_of[task.future] = task
                self._tasks.put(task)
        return task.future

    def started(self, fut: Future[CompiledGrammar]) -> float | None:
        """When a worker began compiling `fut`'s spec (`time.monotonic()`), or None while it
        waits in the queue (or if it is done, or not ours)."""
        with self._lock:
            task = self._task_of.get(fut)
            return None if task is None else task.started

    def start(self) -> None:
        """Start the driver threads now rather than at the first `submit`: they build the
        compiler (the vocabulary) and start a worker at once, off the caller's thread, so the
        first constrained request does not wait for that."""
        with self._lock:
            if not self._closed:
                self._start_drivers()

    def _start_drivers(self) -> None:  # under self._lock
        if not self._drivers:
            self._drivers = [
                threading.Thread(target=self._drive, name=f"braid-grammar-{i}", daemon=True)
                for i in range(self._workers)
            ]
            for t in self._drivers:
                t.start()

    def overran(self, fut: Future[CompiledGrammar]) -> None:
        """Tell the pool that `fut` ran past its caller's time limit: its compile is given up (a
        running one's worker is killed and replaced, off this thread) and `fut` fails with a
        timeout `ValueError`, as do the requests sharing it."""
        with self._lock:
            task = self._task_of.get(fut)
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
        workers: dict[str, _Worker] = {}  # this thread's, by backend
        self._warm(workers)
        while (task := self._tasks.get()) is not None:
            self._run(task, workers)
        for worker in workers.values():
            self._end(worker)

    def _warm(self, workers: dict[str, _Worker]) -> None:
        """Start a worker of the configured backend, so the first compiles do not wait for one
        (a failure is logged; the first task tries again and reports it)."""
        try:
            self._start_worker(self._backend or self._get_compiler().backend, workers)
        except Exception as e:  # reported to the first request, which tries again
            if not self._closed:
                logger.warning(
                    "a grammar compile worker did not start: %s: %s", type(e).__name__, e
                )

    def _run(self, task: _Task, workers: dict[str, _Worker]) -> None:
        """Compile `task` on the first of its candidate backends that compiles it (a backend
        may refuse a spec only when compiling it). It fails with the first refusal if all
        refuse, and at once if it runs out of time, if its worker dies (a spec that crashes one
        library is not handed to the next) or if a backend says no output satisfies the spec
        (`grammar.matches_nothing`: nor would one from any other backend)."""
        if task.future.done():
            return  # cancelled while queued
        try:
            compiler = self._get_compiler()
            names = compiler.candidates(task.kind, task.spec)
            spec = check_spec(task.kind, task.spec)
        except Exception as e:  # a bad spec, a failing tokenizer load: fails one request
            with self._lock:
                self._settle(task, error=_as_value_error(task.kind, e))
            return
        errors: list[Exception] = []
        for name in names:
            grammar, error, died = self._compile_on(name, task, spec, workers)
            final = error is not None and matches_nothing(str(error))
            if grammar is not None or died or final or task.future.done():
                with self._lock:
                    self._settle(task, grammar, error)
                return
            errors.append(error)
        with self._lock:
            self._settle(task, error=errors[0])

    def _compile_on(
        self, name: str, task: _Task, spec: Any, workers: dict[str, _Worker]
    ) -> tuple[CompiledGrammar | None, Exception | None, bool]:
        """(grammar, None, False), or (None, why, whether the worker died or failed) for
        `task` on this thread's worker of backend `name`, started if there is none, replaced
        if it dies or is stopped (`overran`)."""
        try:
            compiler = self._get_compiler()
            backend = compiler.get_backend(name)
            worker = workers.get(name) or self._start_worker(name, workers)
        except Exception as e:  # a failing backend build or worker start
            return None, _as_value_error(task.kind, e), True
        with self._lock:
            if task.future.done():
                return None, None, True
            task.worker = worker
            if task.started is None:  # its time limit counts from here
                task.started = time.monotonic()
        error: Exception | None = None
        try:
            answer = worker.compile(task.kind, spec)
        except Exception as e:  # a garbled answer: treat the worker as broken
            answer, error = None, _as_value_error(task.kind, e)
        with self._lock:
            task.worker = None  # from here `overran` no longer reaches this worker
            replace = answer is None or worker.stopping
        if replace:
            self._end(worker)  # dead, stopped, or stopped just after it answered
            del workers[name]
        grammar = None
        if answer is None:
            error = error or ValueError(
                f"{task.kind}: grammar compilation failed: the {name} compile worker "
                f"{worker.exit_status}"
            )
        elif answer[1] is not None:
            error = ValueError(answer[1])
        else:
            try:  # cached even if its request ran out of time meanwhile: the next may use it
                loaded = backend.load(task.kind, spec, answer[0])
                grammar = compiler.add(task.kind, task.spec, loaded)
            except Exception as e:  # refused when loaded (llguidance with the vocabulary)
                error = _as_value_error(task.kind, e)
        if replace:
            self._start_worker_or_log(name, workers)
        return grammar, error, answer is None

    def _get_compiler(self) -> GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _payload(self, name: str) -> bytes:
        with self._build_lock:
            payload = self._payloads.get(name)
        if payload is None:
            payload = self._get_compiler().get_backend(name).worker_payload()
            with self._build_lock:
                payload = self._payloads.setdefault(name, payload)
        return payload

    def _start_worker(self, name: str, workers: dict[str, _Worker]) -> _Worker:
        """A new worker of backend `name` in `workers`. It is started before its payload is
        made (which on first use builds the compiler), and imports its library meanwhile."""
        worker = _Worker(name)
        with self._lock:
            self._live.add(worker)
        try:
            worker.send_payload(self._payload(name))
            if self._closed:  # shut down while the payload was made: no task will come
                raise RuntimeError("the grammar compiler has been shut down")
        except BaseException:
            self._end(worker)
            raise
        workers[name] = worker
        return worker

    def _start_worker_or_log(self, name: str, workers: dict[str, _Worker]) -> None:
        """A fresh worker of backend `name` in `workers`, unless the pool is shutting down or
        one cannot start (logged; the next task tries again and fails with the reason)."""
        if self._closed:
            return
        try:
            self._start_worker(name, workers)
        except Exception as e:  # reported to the next request as well
            if not self._closed:
                logger.warning(
                    "a grammar compile worker did not start: %s: %s", type(e).__name__, e
                )

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
        self._task_of.pop(task.future, None)
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


class PendingGrammars(Generic[T]):
    """Items (requests) waiting for their grammars, in arrival order. Each compile has
    `timeout_s` from when a worker starts it: time spent queued behind other compiles (each
    bounded the same way) does not count, so a trivial schema queued behind slow ones does not
    fail for their sake."""

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
        self._items.append(_Pending(item, kind, self.compiler.submit(kind, spec)))

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
            elif self._out_of_time(p.future, now):
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

    def _out_of_time(self, fut: Future[CompiledGrammar], now: float) -> bool:
        started = self.compiler.started(fut)
        return started is not None and now >= started + self.timeout_s

    def wait(self, timeout_s: float) -> None:
        """Block until some grammar is ready or `timeout_s` passes (for a scheduler with
        nothing else to do)."""
        if self._items:
            self.compiler.wait([p.future for p in self._items], timeout_s)
