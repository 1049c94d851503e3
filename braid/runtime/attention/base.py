"""The attention-backend interface every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from braid.runtime.executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `init_forward_metadata` is called once per forward, before the first layer, and may store
    per-forward state in `batch.attn_metadata` (and nowhere else). `forward` rotates q and k
    when given `rotary`, writes the new tokens' K and V into the KV pool at
    `batch.out_cache_loc`, and returns the attention output.
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
        rotary: tuple[Any, Any] | None = None,
    ) -> torch.Tensor:
        """`q`: [tokens, heads, head_dim]; `k`, `v`: [tokens, kv_heads, head_dim].
        `rotary`: what `RotaryEmbedding.lookup` returned for the batch's positions, applied to
        q and k before K is stored (`apply_rotary`; a backend may fuse it with the store, and
        may rotate q and k in place). Returns [tokens, heads * head_dim]."""
