"""Plain-torch forms of the kernels the layers also run without Triton: the CPU path of
`braid.runtime.layers` and the references the kernels are tested against.

They live here, beside the kernels and apart from them, because both sides import them: the
kernel modules (which import Triton) re-export them as their `*_reference`, and the layers call
them without importing Triton. This module imports torch alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` in plain torch, computed in float32 as Hugging Face does. Without
    `residual`: `norm(x)`; with it: `(norm(x + residual), x + residual)`."""
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension, in plain torch."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---- fp8 KV cache ------------------------------------------------------------------------------

KV_FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


@functools.lru_cache(maxsize=1024)
def kv_inverse_scale(scale: float) -> float:
    """1 / `scale`, each rounded to float32 once: what a quantized K/V value is multiplied by
    before its cast, in torch and in every kernel alike (a float32 multiplication is one IEEE
    rounding on every device; a division by a Python number on CUDA is not, torch multiplying
    by its own reciprocal). Equal to dividing by `scale` when `scale` is a power of two (1.0,
    the default, included). Cached: the launchers ask for it every layer of every forward."""
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"a KV cache scale must be a positive finite number, got {scale!r}")
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(scale, dtype=torch.float32))


def quantize_kv_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V rows as an fp8 KV cache stores them: clamp(x * (1 / scale), +-448) in float32,
    cast to float8_e4m3fn (round to nearest even). The clamp comes first: a bare cast of a value
    past 448 is NaN on some builds."""
    inv = kv_inverse_scale(scale)
    return (x.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(KV_FP8_DTYPE)


def dequantize_kv_reference(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a read of stored K/V rows gives: fp8 -> float32, times `scale`, in `dtype`. A float
    cache's rows are returned as they are (in `dtype`)."""
    if x.dtype != KV_FP8_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)
