"""`global_config`: the language's process-wide settings, under SGLang's names.

`default_backend` is where `set_default_backend` puts the backend that programs run on when
`run` is given none; `with using_backend(b):` overrides it for the code inside (and threads it
starts through braid), so programs for different backends can run side by side.
`with sampling_defaults(seed=...):` likewise gives the programs run inside it sampling
arguments that neither their gens nor their `run` call set.

Settings of SGLang's that concern its own runtime (token-ratio estimation, FlashInfer
workspace, GDS) have no meaning for braid's frontend and are not here.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_override: contextvars.ContextVar[Any] = contextvars.ContextVar("braid_backend", default=None)
_sampling: contextvars.ContextVar[Any] = contextvars.ContextVar("braid_sampling", default=None)


class GlobalConfig:
    def __init__(self) -> None:
        # 0: quiet; 2 or more: print each program's final text after `run`.
        self.verbosity = 0
        self._default_backend: Any = None
        # Decode output with special tokens removed (SGLang's setting; braid always does).
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        # run_batch first computes the constant prefix its programs share (traced), once.
        self.enable_precache_with_tracing = True
        # join(mode="concate_and_append") appends the branches' text; braid recomputes the
        # joined text's KV (with the prefix cache) rather than concatenating KV.
        self.enable_parallel_encoding = True

    @property
    def default_backend(self) -> Any:
        """The backend of the innermost `using_backend` block, else the one
        `set_default_backend` set (None if neither)."""
        backend = _override.get()
        return backend if backend is not None else self._default_backend

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        self._default_backend = backend


global_config = GlobalConfig()


@contextmanager
def using_backend(backend: Any) -> Iterator[Any]:
    """Programs run inside the block (and the threads braid starts for them) use `backend`
    when given none. Yields the resolved backend."""
    from braid.lang.program import as_backend

    b = as_backend(backend)
    token = _override.set(b)
    try:
        yield b
    finally:
        _override.reset(token)


@contextmanager
def sampling_defaults(**kwargs: Any) -> Iterator[Any]:
    """Programs that start running inside the block take these sampling arguments (`seed`,
    `temperature`, `max_new_tokens`, ...) wherever neither a gen nor the `run` / `run_batch`
    call gives them; an inner block's arguments go over an outer one's. A fixed `seed` makes
    programs one cannot edit sample reproducibly. `ValueError` names an unknown argument.
    Yields the resolved `SamplingArgs`."""
    from braid.lang.ir import SamplingArgs

    args = SamplingArgs.from_kwargs(kwargs, "sampling_defaults")
    outer = _sampling.get()
    token = _sampling.set(args if outer is None else args.over(outer))
    try:
        yield _sampling.get()
    finally:
        _sampling.reset(token)


def current_sampling_defaults() -> Any:
    """The `SamplingArgs` of the innermost `sampling_defaults` block (empty outside any)."""
    from braid.lang.ir import SamplingArgs

    args = _sampling.get()
    return SamplingArgs() if args is None else args
