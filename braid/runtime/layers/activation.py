"""Activations.

On CUDA `silu_and_mul` runs as one Triton kernel (`braid.kernels.silu_and_mul`, same rounding
as the torch form); elsewhere as plain torch. It is a free function called from the model
files, with no construction to bind a choice at, so the check is the tensor's device per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` in plain torch (the CPU path, and the reference for the kernel)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@functools.cache
def _fused() -> Callable[[torch.Tensor], torch.Tensor]:
    from braid.kernels.activation import silu_and_mul

    return silu_and_mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension (a new tensor)."""
    if x.is_cuda:
        return _fused()(x)
    return silu_and_mul_torch(x)
