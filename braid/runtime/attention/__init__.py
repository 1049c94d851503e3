"""Attention backends behind one interface, in a registry of lazily imported factories."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from braid.runtime.attention.base import AttentionBackend

_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    """Class decorator: registers an attention backend under `name` and returns the class."""

    def wrap(cls):
        _REGISTRY[name] = cls
        return cls

    return wrap


_LAZY = {
    "torch_native": "braid.runtime.attention.torch_native",
    "triton": "braid.runtime.attention.triton_backend",
}


def backend_names() -> list[str]:
    """The names `create_backend` accepts, sorted; listing them imports no backend."""
    return sorted(set(_LAZY) | set(_REGISTRY))


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in _REGISTRY and name in _LAZY:
        import importlib

        importlib.import_module(_LAZY[name])
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend {name!r} is unknown (have {sorted(_LAZY)})")
    return _REGISTRY[name](**kwargs)
