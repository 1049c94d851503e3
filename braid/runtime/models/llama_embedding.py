"""Decoder checkpoints saved without their LM head: transformers' `LlamaModel`, `MistralModel`,
`Qwen2Model` and `Qwen3Model`, the layout many embedding models are published in (their keys
lack the `model.` prefix). The network is `LlamaForCausalLM`'s; it serves embeddings only (the
scheduler refuses generation on it)."""

from __future__ import annotations

import torch
from torch import nn

from braid.runtime.attention.base import AttentionBackend
from braid.runtime.forward_batch import ForwardBatch
from braid.runtime.models import MODELS
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.llama import LlamaForCausalLM, LlamaModel


@MODELS.register
class LlamaEmbeddingModel(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_key_suffixes = LlamaForCausalLM.ignored_key_suffixes
    pools_hidden_states = True
    generates = False  # no LM head

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, max_positions)

    @staticmethod
    def checkpoint_key(key: str) -> str:
        """A base model's keys (`layers.0...`) under braid's `model.` prefix; keys that have
        it already (a causal LM's body saved alone) stay."""
        return key if key.startswith("model.") else f"model.{key}"

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The final hidden states go to `batch.hidden_states` always (pooling reads them);
        the logits are an empty [0, vocab]: nothing here samples, so no row asks for one."""
        h = self.model(batch, attn)
        batch.hidden_states = h
        assert batch.logits_indices.numel() == 0, "a model without an LM head cannot sample"
        return h.new_empty((0, self.config.vocab_size), dtype=torch.float32)
