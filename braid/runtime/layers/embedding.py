"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import select_linear_fn
from braid.runtime.layers.norm import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader
        self.weight.shard_names = (None,)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tied_to` reuses an embedding's weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
            )
            self.weight.weight_loader = default_weight_loader
            self.weight.shard_names = (None,)
        self._linear = select_linear_fn(self.weight.device, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._linear(h, self.weight, None)
