"""Model files, a registry from Hugging Face architecture names to braid classes, and loading."""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, type] = {}

# Architecture -> module that registers it; imported on first use.
_LAZY = {
    "LlamaForCausalLM": "braid.runtime.models.llama",
    "MistralForCausalLM": "braid.runtime.models.llama",
    "Qwen2ForCausalLM": "braid.runtime.models.llama",
    "Qwen3ForCausalLM": "braid.runtime.models.llama",
}


def register_model(*architectures: str):
    """Class decorator: registers a model class for the given architectures and returns it."""

    def wrap(cls):
        for arch in architectures:
            _REGISTRY[arch] = cls
        return cls

    return wrap


def get_model_class(architecture: str) -> type:
    if architecture not in _REGISTRY and architecture in _LAZY:
        importlib.import_module(_LAZY[architecture])
    if architecture not in _REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported (supported: {sorted(_LAZY)})"
        )
    return _REGISTRY[architecture]


def supported_architectures() -> list[str]:
    return sorted(_LAZY)
