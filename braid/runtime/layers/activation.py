"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
