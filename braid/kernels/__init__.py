"""Triton kernels, each with a typed launcher and a torch reference beside it (STYLE rule 11).

The package exports the launchers, imported on first use: importing `braid.kernels` does not
import Triton, and the kernels are compiled (or, under TRITON_INTERPRET=1, interpreted)
according to the environment at that first use. Each launcher checks its arguments and
raises `ValueError` naming the one that is wrong; the `*_reference` functions live in the
kernel modules (`braid.kernels.norm.rmsnorm_reference`, ...), except those the runtime's layers
also run as their CPU path, which live in `braid.kernels.reference` (torch alone, no Triton)
and are re-exported by their kernel modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from braid.kernels.activation import silu_and_mul
    from braid.kernels.argmax import argmax_rows
    from braid.kernels.attention_decode import decode_attention
    from braid.kernels.attention_extend import extend_attention
    from braid.kernels.fp8_quant import per_token_quant_fp8
    from braid.kernels.gguf_gemm import gguf_linear
    from braid.kernels.int4_gemv import int4_gemv
    from braid.kernels.kv_store import store_kv
    from braid.kernels.norm import rmsnorm
    from braid.kernels.quant_gemm import int4_linear, int8_linear
    from braid.kernels.quant_gemv import fp8_gemv, int8_gemv
    from braid.kernels.quant_planar import dequantize_int4_planar, int4_planar_linear
    from braid.kernels.rope import rotary
    from braid.kernels.skinny_gemm import skinny_linear
    from braid.kernels.token_bitmask import apply_token_bitmask_

_LAUNCHERS = {
    "argmax_rows": "braid.kernels.argmax",
    "store_kv": "braid.kernels.kv_store",
    "decode_attention": "braid.kernels.attention_decode",
    "extend_attention": "braid.kernels.attention_extend",
    "rmsnorm": "braid.kernels.norm",
    "rotary": "braid.kernels.rope",
    "silu_and_mul": "braid.kernels.activation",
    "apply_token_bitmask_": "braid.kernels.token_bitmask",
    "skinny_linear": "braid.kernels.skinny_gemm",
    "int4_linear": "braid.kernels.quant_gemm",
    "int8_linear": "braid.kernels.quant_gemm",
    "per_token_quant_fp8": "braid.kernels.fp8_quant",
    "int4_gemv": "braid.kernels.int4_gemv",
    "int8_gemv": "braid.kernels.quant_gemv",
    "fp8_gemv": "braid.kernels.quant_gemv",
    "int4_planar_linear": "braid.kernels.quant_planar",
    "dequantize_int4_planar": "braid.kernels.quant_planar",
    "gguf_linear": "braid.kernels.gguf_gemm",
}

__all__ = [
    "apply_token_bitmask_",
    "argmax_rows",
    "decode_attention",
    "dequantize_int4_planar",
    "extend_attention",
    "fp8_gemv",
    "gguf_linear",
    "int4_gemv",
    "int4_linear",
    "int4_planar_linear",
    "int8_gemv",
    "int8_linear",
    "per_token_quant_fp8",
    "rmsnorm",
    "rotary",
    "silu_and_mul",
    "skinny_linear",
    "store_kv",
]


def __getattr__(name: str) -> Any:
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(_LAUNCHERS[name]), name)
    raise AttributeError(f"module 'braid.kernels' has no attribute {name!r}")
