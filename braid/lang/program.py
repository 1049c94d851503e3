"""`Program` (what `@function` makes): run, run_batch, bind, trace; and the default backend."""

from __future__ import annotations

import inspect
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from braid.lang.backends.base import Backend
from braid.lang.interpreter import ProgramState, _Executor, _Sessions
from braid.lang.ir import SAMPLING_FIELDS, SamplingArgs

logger = logging.getLogger(__name__)

_default_backend: Backend | None = None
_default_lock = threading.Lock()


def as_backend(backend: Any) -> Backend:
    """A `Backend` from a backend, an `LLM`/`Engine`, a `braid serve` URL, or a model path."""
    if isinstance(backend, Backend):
        return backend
    from braid.runtime.engine import LLM

    if isinstance(backend, LLM):
        from braid.lang.backends.engine import EngineBackend

        return EngineBackend(backend)
    if isinstance(backend, str):
        if backend.startswith(("http://", "https://")):
            from braid.lang.backends.endpoint import RuntimeEndpoint

            return RuntimeEndpoint(backend)
        from braid.lang.backends.engine import EngineBackend

        return EngineBackend(LLM(backend), owns=True)
    raise ValueError(
        f"backend: expected braid.Engine/LLM, RuntimeEndpoint, OpenAI, a URL or a model path, "
        f"got {type(backend).__name__}"
    )


def set_default_backend(backend: Any) -> Backend:
    """The backend programs run on when `run` is given none; returns it."""
    global _default_backend
    b = as_backend(backend)
    with _default_lock:
        _default_backend = b
    return b


def get_default_backend() -> Backend | None:
    return _default_backend


def _resolve(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise ValueError(
            "no backend: pass backend=... or call braid.set_default_backend(braid.Engine(...)) "
            "(or a RuntimeEndpoint / OpenAI backend) first"
        )
    return _default_backend


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(program arguments, sampling arguments)."""
    sampling = {k: kwargs[k] for k in kwargs if k in SAMPLING_FIELDS or k == "max_new_tokens"}
    args = {k: v for k, v in kwargs.items() if k not in sampling}
    return args, sampling


class Program:
    """A braid program. Call it (or `run`) to run it once, `run_batch` to run many."""

    def __init__(self, func: Callable, bound: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise ValueError(f"@function {func.__name__}: the first parameter must be the state")
        self.func = func
        self.bound = dict(bound or {})
        self.arg_names = params[1:]
        self.sessions = True
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        return Program(self.func, {**self.bound, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _start(
        self, backend: Backend, defaults: SamplingArgs, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[ProgramState, Callable[[], None]]:
        sessions = _Sessions(backend)
        session = f"prog-{uuid.uuid4().hex[:12]}" if self.sessions else None
        state = ProgramState(_Executor(backend, defaults, session, sessions))
        call_kwargs = {**self.bound, **kwargs}

        def body() -> None:
            try:
                self.func(state, *args, **call_kwargs)
            finally:
                state._ex.end()

        return state, body

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Any = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once. Keywords that are sampling arguments (`max_new_tokens`, `temperature`, ...)
        are defaults for every gen; the rest go to the program. With `stream=True` it returns
        at once; read the state with `text_iter()`. Raises `ProgramError` (with the failing
        program line) if a step fails."""
        b = _resolve(backend)
        prog_kwargs, sampling = _split_kwargs(kwargs)
        defaults = SamplingArgs.from_kwargs(sampling, f"{self.__name__}.run")
        state, body = self._start(b, defaults, args, prog_kwargs)
        if stream:
            threading.Thread(
                target=self._body_keeping_error, args=(state, body), daemon=True
            ).start()
            return state
        try:
            body()
        finally:
            state._ex.wait_ended()  # the session is closed before run() returns or raises
        if state.error is not None:
            raise state.error
        return state

    @staticmethod
    def _body_keeping_error(state: ProgramState, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as e:
            # A streamed program's own exception surfaces through the state's iterators.
            state._ex._fail("program", e)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, in parallel; states in input order. The
        constant prefix the programs share is computed once before they start. A failed
        program's state raises its error when read (`state.error` holds it)."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(
            isinstance(k, dict) for k in batch_kwargs
        ):
            raise ValueError("run_batch: batch_kwargs must be a list of dicts of arguments")
        if not batch_kwargs:
            return []
        b = _resolve(backend)
        defaults = SamplingArgs.from_kwargs(sampling, f"{self.__name__}.run_batch")
        if num_threads == "auto":
            num_threads = min(len(batch_kwargs), 128)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"run_batch: num_threads must be 'auto' or >= 1, got {num_threads!r}")
        if len(batch_kwargs) > 1:
            prefix = self.constant_prefix(b, set(batch_kwargs[0]))
            if prefix:
                b.cache_prefix(prefix)

        def one(kw: dict[str, Any]) -> ProgramState:
            args, samp = _split_kwargs(kw)
            d = SamplingArgs.from_kwargs(samp, f"{self.__name__}.run_batch").over(defaults)
            state, body = self._start(b, d, (), args)
            try:
                body()
            except Exception as e:
                state._ex._fail("program", e)
            state._ex.wait_ended()
            return state

        with ThreadPoolExecutor(num_threads, thread_name_prefix="braid-batch") as pool:
            futures = [pool.submit(one, kw) for kw in batch_kwargs]
            bar = tqdm(total=len(futures), desc=self.__name__, disable=not progress_bar)
            states = []
            for f in futures:
                states.append(f.result())
                bar.update(1)
            bar.close()
        return states

    def trace(self, **kwargs: Any):
        """The program's `RequestGraph`: run symbolically, arguments not given left unknown.
        Raises `TraceError` (saying what to do) where an unknown value is used in Python."""
        from braid.lang.tracer import trace

        return trace(self, {**self.bound, **kwargs})

    def constant_prefix(self, backend: Backend, unknown: set[str]) -> str:
        """The text every run starts with whatever the arguments in `unknown` are ("" if the
        program cannot be traced)."""
        from braid.lang.tracer import TraceError, render_constant, trace

        given = {k: v for k, v in self.bound.items() if k not in unknown}
        try:
            graph = trace(self, given, placeholders=unknown)
        except TraceError as e:
            # The program looks inside a value at run time: its prefix up to there still holds.
            graph = e.graph
        except Exception as e:  # the program's own code failed on placeholders: no prefix
            logger.debug("%s: no shared prefix (tracing raised %r)", self.__name__, e)
            return ""
        return render_constant(graph.constant_prefix(), backend.role_template)
