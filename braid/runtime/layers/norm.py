"""RMSNorm, computed in float32 as Hugging Face does, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shard_names = (None,)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
