"""Quantized linear layers: how a method stores a layer's weights, loads them from a checkpoint
and multiplies by them, chosen once at load (`EngineConfig.quantization`, or the checkpoint's
`quantization_config`).

Methods sit in `QUANTIZATION_METHODS`, a registry of lazily imported factories.
"""

from __future__ import annotations

from braid.runtime.registry import Registry

QUANTIZATION_METHODS: Registry = Registry("quantization", {})


def quantization_method_names() -> list[str]:
    """The names `quantization` accepts, sorted; listing them imports no method."""
    return QUANTIZATION_METHODS.names()
