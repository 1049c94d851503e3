"""`Program` (what `@function` makes): run, run_batch, bind, trace, cache; and the default
backend (kept in `global_config`, as SGLang keeps it)."""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from braid.lang.backends.base import Backend
from braid.lang.config import current_sampling_defaults, global_config
from braid.lang.executor import Executor, Sessions
from braid.lang.interpreter import ProgramState
from braid.lang.ir import SAMPLING_ALIASES, SAMPLING_FIELDS, SamplingArgs

logger = logging.getLogger(__name__)

_default_lock = threading.Lock()
# run_batch's generator_style submits this many programs ahead of the one it yields.
_GENERATOR_CHUNK = 200


def as_backend(backend: Any) -> Backend:
    """A `Backend` from a backend, an `LLM`/`Engine`, a `Runtime` (its `endpoint`), a
    `braid serve` URL, or a model path."""
    if isinstance(backend, Backend):
        return backend
    from braid.runtime.engine import LLM

    if isinstance(backend, LLM):
        from braid.lang.backends.engine import EngineBackend

        return EngineBackend(backend)
    if isinstance(getattr(backend, "endpoint", None), Backend):  # SGLang's Runtime
        return backend.endpoint
    if isinstance(backend, str):
        if backend.startswith(("http://", "https://")):
            from braid.lang.backends.endpoint import RuntimeEndpoint

            return RuntimeEndpoint(backend)
        from braid.lang.backends.engine import EngineBackend

        return EngineBackend(LLM(backend), owns=True)
    raise ValueError(
        f"backend: expected braid.Engine/LLM, Runtime, RuntimeEndpoint, OpenAI, a URL or a model "
        f"path, got {type(backend).__name__}"
    )


def set_default_backend(backend: Any) -> Backend:
    """The backend programs run on when `run` is given none (`global_config.default_backend`);
    returns it."""
    b = as_backend(backend)
    with _default_lock:
        global_config.default_backend = b
    return b


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def resolve_backend(backend: Any) -> Backend:
    """`backend` as a Backend, or the default one; `ValueError` if there is none."""
    if backend is not None:
        return as_backend(backend)
    default = global_config.default_backend
    if default is None:
        raise ValueError(
            "no backend: pass backend=... or call braid.set_default_backend(braid.Engine(...)) "
            "(or a RuntimeEndpoint / OpenAI backend) first"
        )
    return as_backend(default)


def _split_kwargs(
    kwargs: dict[str, Any], params: set[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(program arguments, sampling arguments): a keyword the program takes is its argument
    even when a sampling argument has the same name (a program parameter `n`)."""
    sampling_names = SAMPLING_FIELDS | set(SAMPLING_ALIASES)
    sampling = {k: v for k, v in kwargs.items() if k in sampling_names and k not in params}
    args = {k: v for k, v in kwargs.items() if k not in sampling}
    return args, sampling


def _refuse_inside_a_trace(what: str) -> None:
    """A program run inside another's trace (a program that runs a program): the trace stops
    there (`TraceError`), and nothing runs with placeholder arguments."""
    from braid.lang.tracer import TRACING, TraceError

    if TRACING.get() is not None:
        raise TraceError(f"{what} inside a trace: a program run cannot be traced")


class Program:
    """A braid program. Call it (or `run`) to run it once, `run_batch` to run many."""

    def __init__(self, func: Callable, bound: dict[str, Any] | None = None) -> None:
        sig = inspect.signature(func)
        params = list(sig.parameters)
        if not params:
            raise ValueError(f"@function {func.__name__}: the first parameter must be the state")
        self.func = func
        self.bound = dict(bound or {})
        self.arg_names = params[1:]
        self._takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        self.sessions = True
        # The runtimes (`Backend.precache_key`) the program's first run has pre-computed its
        # constant prefix on, and the lock runs started alongside it wait on (they then hit
        # the prefix in the cache).
        self._precached: set[object] = set()
        self._precache_lock = threading.Lock()
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    @property
    def bind_arguments(self) -> dict[str, Any]:
        """The bound arguments (SGLang's name)."""
        return self.bound

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        unknown = sorted(k for k in kwargs if k not in self.arg_names)
        if unknown and not self._takes_any:
            raise ValueError(f"{self.__name__}.bind: the program takes no argument(s) {unknown}")
        bound = Program(self.func, {**self.bound, **kwargs})
        bound.sessions = self.sessions
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return _split_kwargs(kwargs, set(self.arg_names))

    def _start(
        self,
        backend: Backend,
        defaults: SamplingArgs,
        args: tuple,
        kwargs: dict[str, Any],
        precache: bool = False,
    ) -> tuple[ProgramState, Callable[[], None]]:
        # The run's name: its requests' program id, and its root session's when pinning.
        name = f"prog-{uuid.uuid4().hex[:12]}"
        sessions = Sessions(backend, program=name)
        session = name if self.sessions else None
        state = ProgramState(Executor(backend, defaults, session, sessions))
        call_kwargs = {**self.bound, **kwargs}

        def body() -> None:
            try:
                if precache:
                    self._precache_once(backend)
                state.ret_value = self.func(state, *args, **call_kwargs)
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
        and not parameters of the program are defaults for every gen; the rest go to the
        program. With `stream=True` it returns at once; read the state with `text_iter()`.
        Raises `ProgramError` (with the failing program line) if a step fails."""
        _refuse_inside_a_trace(f"{self.__name__}.run")
        prog_kwargs, sampling = self._split(kwargs)
        defaults = SamplingArgs.from_kwargs(sampling, f"{self.__name__}.run").over(
            current_sampling_defaults()
        )
        b = resolve_backend(backend)
        precache = global_config.enable_precache_with_tracing
        state, body = self._start(b, defaults, args, prog_kwargs, precache)
        if stream:
            state._ex.streamed = True  # reads from the caller wait for the body's end
            ctx = contextvars.copy_context()
            threading.Thread(
                target=ctx.run, args=(self._body_keeping_error, state, body), daemon=True
            ).start()
            return state
        try:
            body()
        finally:
            state._ex.wait_ended()  # the session is closed before run() returns or raises
        if state._ex.error is not None:
            raise state._ex.error
        if global_config.verbosity >= 2:
            print(state.text())
        return state

    @staticmethod
    def _body_keeping_error(state: ProgramState, body: Callable[[], None]) -> None:
        state._ex.body_thread = threading.get_ident()
        try:
            body()
        except Exception as e:
            # A streamed program's own exception surfaces through the state's iterators.
            state._ex._fail("program", e)

    def _as_kwargs(self, batch: list | tuple) -> list[dict[str, Any]]:
        """SGLang's two forms: a list of dicts, or a list of argument lists (by position)."""
        if not isinstance(batch, (list, tuple)):
            raise ValueError("run_batch: batch_kwargs must be a list of dicts of arguments")
        out = []
        for i, item in enumerate(batch):
            if isinstance(item, dict):
                out.append(item)
            elif isinstance(item, (list, tuple)) and len(item) <= len(self.arg_names):
                out.append(dict(zip(self.arg_names, item)))
            else:
                raise ValueError(
                    f"run_batch: item {i} must be a dict of arguments or a list of at most "
                    f"{len(self.arg_names)} positional arguments, got {type(item).__name__}"
                )
        return out

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[list[Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per item (a dict of arguments, or a list of them by position),
        in parallel; states in input order (with `generator_style`, yielded in order as they
        finish). The constant prefix the programs share is computed once before they start.
        A failed program's state raises its error when read (`state.error()` returns it)."""
        _refuse_inside_a_trace(f"{self.__name__}.run_batch")
        items = self._as_kwargs(batch_kwargs)
        defaults = SamplingArgs.from_kwargs(sampling, f"{self.__name__}.run_batch").over(
            current_sampling_defaults()
        )
        if not items:
            return iter(()) if generator_style else []
        b = resolve_backend(backend)
        if num_threads == "auto":
            num_threads = min(len(items), 128)
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"run_batch: num_threads must be 'auto' or >= 1, got {num_threads!r}")
        if len(items) > 1 and global_config.enable_precache_with_tracing:
            self.cache(b, unknown=set(items[0]))
        elif global_config.enable_precache_with_tracing:
            self._precache_once(b)

        def one(kw: dict[str, Any]) -> ProgramState:
            args, samp = self._split(kw)
            d = SamplingArgs.from_kwargs(samp, f"{self.__name__}.run_batch").over(defaults)
            state, body = self._start(b, d, (), args)
            try:
                body()
            except Exception as e:
                state._ex._fail("program", e)
            state._ex.wait_ended()
            return state

        def submit(pool: ThreadPoolExecutor, kw: dict[str, Any]):
            return pool.submit(contextvars.copy_context().run, one, kw)

        bar = tqdm(total=len(items), desc=self.__name__, disable=not progress_bar)
        if generator_style:
            return self._generate_states(items, num_threads, submit, bar)
        with ThreadPoolExecutor(num_threads, thread_name_prefix="braid-batch") as pool:
            futures = [submit(pool, kw) for kw in items]
            states = []
            for f in futures:
                states.append(f.result())
                bar.update(1)
        bar.close()
        return states

    @staticmethod
    def _generate_states(items, num_threads, submit, bar) -> Iterator[ProgramState]:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="braid-batch") as pool:
            for start in range(0, len(items), _GENERATOR_CHUNK):
                futures = [submit(pool, kw) for kw in items[start : start + _GENERATOR_CHUNK]]
                for f in futures:
                    state = f.result()
                    bar.update(1)
                    yield state
        bar.close()

    def trace(self, *, backend: Any = None, **kwargs: Any):
        """The program's `RequestGraph`: run symbolically, arguments not given left unknown.
        Raises `TraceError` (saying what to do) where an unknown value is used in Python.
        (`backend` is accepted for SGLang's signature; tracing runs no model.)"""
        from braid.lang.tracer import trace

        del backend
        return trace(self, {**self.bound, **kwargs})

    def compile(self, *, backend: Any = None):
        """SGLang's experimental program compiler: not supported (a clear `ValueError`)."""
        raise ValueError(
            f"{self.__name__}.compile(): SGLang's experimental compiler is not supported; "
            "trace() gives the program's graph and cache() pre-computes its shared prefix"
        )

    def cache(self, backend: Any = None, *, unknown: set[str] | None = None) -> str:
        """Compute the KV of the text every run of the program starts with, now (SGLang's
        `Program.cache`): later runs hit it in the prefix cache. Arguments in `unknown` (all
        unbound ones by default) are treated as unknown. Returns the text cached ("" when the
        program starts with something that depends on its arguments)."""
        b = resolve_backend(backend)
        names = set(self.arg_names) - set(self.bound) if unknown is None else unknown
        prefix = self.constant_prefix(b, names)
        if prefix:
            b.cache_prefix(prefix)
        return prefix

    def _precache_once(self, backend: Backend) -> None:
        """Before the program's first run on `backend`'s runtime, compute the text every run
        starts with (`cache`, every unbound argument unknown); runs started meanwhile wait for
        it, later runs skip it. Not where the backend keeps no cache (`cache_prefix` is
        Backend's no-op: tracing would run the body for nothing). (Never inside a trace: a run
        there is refused first.) A failure is said at debug level and the run goes on (it is
        only a head start)."""
        if type(backend).cache_prefix is Backend.cache_prefix:
            return
        key = backend.precache_key
        with self._precache_lock:
            if key in self._precached:
                return
            try:
                self.cache(backend)
            except Exception as e:
                logger.debug("%s: constant prefix not pre-computed (%r)", self.__name__, e)
                return
            self._precached.add(key)

    def constant_prefix(self, backend: Backend, unknown: set[str]) -> str:
        """The text every run starts with whatever the arguments in `unknown` are ("" if the
        program cannot be traced)."""
        from braid.lang.tracer import TraceError, render_constant, trace

        given = {k: v for k, v in self.bound.items() if k not in unknown}
        try:
            graph = trace(self, given, placeholders=unknown)
        except TraceError as e:
            # The program looks inside a value at run time: its prefix up to there still holds.
            logger.debug("%s: traced up to where it reads a run-time value (%s)", self.__name__, e)
            graph = e.graph
        except Exception as e:  # the program's own code failed on placeholders: no prefix
            logger.debug("%s: no shared prefix (tracing raised %r)", self.__name__, e)
            return ""
        return render_constant(graph.constant_prefix(), backend.role_template)
