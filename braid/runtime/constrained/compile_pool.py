"""Compiling grammars off the scheduler's critical path.

outlines-core builds an index in Rust with the GIL released, so worker threads compile while
the scheduler keeps running forwards. The workers are daemon threads of a small pool written
here rather than a `ThreadPoolExecutor`: a compile cannot be interrupted, and an executor's
threads are joined at interpreter exit, so one pathological grammar (some take minutes) would
hold up the scheduler process's exit. When a compile overruns its time limit the pool starts a
spare worker, so other requests' grammars do not queue behind it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from braid.runtime.constrained.grammar import CompiledGrammar, GrammarCompiler, grammar_key

T = TypeVar("T")

# Spare workers started for overrunning compiles, at most (each may run to the end of its grammar).
MAX_SPARE_WORKERS = 8


class AsyncGrammarCompiler:
    """Compiles grammars on `workers` daemon threads, started by the first `submit`. The
    `GrammarCompiler` (which loads the tokenizer's vocabulary) is built by the first compile,
    also off the caller's thread. Identical specs compiling at the same time share one compile.
    `submit` is meant for one thread (the scheduler's)."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._build_lock = threading.Lock()
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._names = itertools.count()
        self._workers = workers
        self._threads = 0
        self._overrun: set[Future[CompiledGrammar]] = set()  # each has one spare worker

    @property
    def compiler(self) -> GrammarCompiler | None:
        """The compiler, once some compile has built it."""
        return self._compiler

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
            start = self._workers - self._threads  # workers start with the first compile
        for _ in range(start):
            self._start_worker()
        with self._lock:
            fut = self._in_flight.get(key)
            if fut is None:
                fut = Future()
                self._in_flight[key] = fut
                self._tasks.put((key, kind, spec, fut))
        return fut

    def overran(self, fut: Future[CompiledGrammar]) -> None:
        """Tell the pool that `fut` ran past its caller's time limit: a spare worker starts so
        that the stuck one does not delay other grammars."""
        with self._lock:
            if fut.done() or fut in self._overrun or len(self._overrun) >= MAX_SPARE_WORKERS:
                return
            self._overrun.add(fut)
        self._start_worker()

    def wait(self, futures: list[Future[CompiledGrammar]], timeout_s: float) -> None:
        """Block until one of `futures` is done or `timeout_s` passes."""
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def _start_worker(self) -> None:
        with self._lock:
            self._threads += 1
        name = f"braid-grammar-{next(self._names)}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _get_compiler(self) -> GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _work(self) -> None:
        while True:
            key, kind, spec, fut = self._tasks.get()
            try:
                result = self._get_compiler().compile(kind, spec)
            except ValueError as e:
                error: Exception | None = e
            except Exception as e:  # a failing tokenizer load or compile must fail one request
                error = ValueError(f"{kind}: grammar compilation failed: {type(e).__name__}: {e}")
            else:
                error = None
            with self._lock:
                self._in_flight.pop(key, None)
                self._overrun.discard(fut)
                retire = self._threads > self._workers + len(self._overrun)
                if retire:
                    self._threads -= 1
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            if retire:
                return


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
        or ran out of time, each with its error message."""
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
                        "(the limit is grammar_compile_timeout_s, --grammar-compile-timeout)",
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
