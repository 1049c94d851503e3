"""RMSNorm, computed in float32 as Hugging Face does, with an optional fused residual add.

On CUDA the norm runs as one Triton kernel (`braid.kernels.rmsnorm`, same rounding points);
elsewhere as plain torch (`braid.kernels.reference.rmsnorm_reference`). The choice is made
once, from the device the weight is created on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from braid.kernels.reference import rmsnorm_reference


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _select_rmsnorm(
    device: torch.device,
) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    if device.type != "cuda":
        return rmsnorm_reference
    from braid.kernels.norm import rmsnorm

    def fused(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # The kernel reads whole rows with unit stride; per-head q/k norms get heads sliced
        # from the fused QKV output, which are not (a no-op for the contiguous hidden states).
        return rmsnorm(x.contiguous(), weight, eps, residual)

    return fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shard_names = (None,)
        self._norm = _select_rmsnorm(self.weight.device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        return self._norm(x, self.weight, self.eps, residual)
