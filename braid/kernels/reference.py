"""Plain-torch forms of the kernels the layers also run without Triton: the CPU path of
`braid.runtime.layers` and the references the kernels are tested against.

They live here, beside the kernels and apart from them, because both sides import them: the
kernel modules (which import Triton) re-export them as their `*_reference`, and the layers call
them without importing Triton. This module imports torch alone.
"""

from __future__ import annotations

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
