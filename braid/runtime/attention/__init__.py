"""Attention backends behind one interface (`base.AttentionBackend`), in a registry of lazily
imported factories."""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.attention.base import AttentionBackend

BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention_backend",
    {
        "torch_native": "braid.runtime.attention.torch_native",
        "triton": "braid.runtime.attention.triton_backend",
        "flashinfer": "braid.runtime.attention.flashinfer_backend",
    },
)


def backend_names() -> list[str]:
    """The names `create_backend` accepts, sorted; listing them imports no backend."""
    return BACKENDS.names()


def create_backend(name: str, **kwargs) -> AttentionBackend:
    """The backend registered as `name`, built with `kwargs`; `ValueError` naming the field
    and the known names if `name` is unknown."""
    return BACKENDS.get(name)(**kwargs)
