"""Activations.

On CUDA `silu_and_mul` runs as one Triton kernel (`braid.kernels.silu_and_mul`, same rounding
as the torch form); elsewhere as plain torch (`braid.kernels.reference`). It is a free function
called from the model files, with no construction to bind a choice at, so the check is the
tensor's device per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from braid.kernels.reference import silu_and_mul_reference


@functools.cache
def _fused() -> Callable[[torch.Tensor], torch.Tensor]:
    from braid.kernels.activation import silu_and_mul

    return silu_and_mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension (a new tensor)."""
    if x.is_cuda:
        return _fused()(x)
    return silu_and_mul_reference(x)
