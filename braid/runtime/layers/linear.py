"""Linear layers whose weights know how to load their shards.

A fused projection (QKV, gate-up) is one weight made of named row blocks; each checkpoint
tensor names the block it fills, and loading checks the shape of every block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x @ W.T + b`, where W (and b) are stacked from named row shards.

    `shards` maps a shard name to its number of output rows, in order; a plain linear layer has
    the single shard `None`. Every parameter carries `weight_loader(param, tensor, shard)` and
    `shard_names`, which the strict weight loader uses to check that each shard is filled once.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str | None, int],
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.offsets: dict[str | None, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size
        self.out_features = start
        self.weight = nn.Parameter(torch.empty(start, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(start, dtype=dtype), requires_grad=False) if bias else None
        )
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard
                p.shard_names = tuple(shards)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        if shard not in self.offsets:
            raise ValueError(f"unknown shard {shard!r} (have {list(self.offsets)})")
        start, size = self.offsets[shard]
        expected = (size, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != expected {expected}"
            )
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
