"""The attention-backend interface every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from braid.runtime.executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `init_forward_metadata` is called once per forward, before the first layer, and may store
    per-forward state in `batch.attn_metadata` (and nowhere else). `forward` writes the new
    tokens' K and V into the KV pool at `batch.out_cache_loc` and returns the attention output.
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`q`: [tokens, heads, head_dim]; `k`, `v`: [tokens, kv_heads, head_dim].
        Returns [tokens, heads * head_dim]."""
