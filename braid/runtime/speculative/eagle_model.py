"""The EAGLE draft network (Li et al., 2024/2025) and its checkpoints.

EAGLE (1 and 2) drafts from features: at position t its input is the target's final hidden
state f_t with the embedding of the token at t + 1, `fc(cat(embed, f_t))`, through one Llama
decoder layer without an input norm; the output (the residual sum, not normed) is its guess of
f_{t+1}, and the target's LM head on it guesses the token at t + 2. EAGLE-3 takes three of the
target's layer outputs instead of f_t (`fc` maps their concatenation to one hidden state; the
draft's own outputs go in unmapped), norms the embedding and the feature separately before a
layer whose attention reads both (2 x hidden), and ends with a norm and its own LM head over a
smaller draft vocabulary, mapped to the target's ids by `d2t` (target id = draft id + d2t).

Checkpoints are the published ones: `config.json` (a Llama config; EAGLE-3's names
`LlamaForCausalLMEagle3`, `draft_vocab_size`, and optionally the target layers it reads in
`eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` or
`pytorch_model.bin`: EAGLE-1 keys `fc.*`, `layers.0.*`; EAGLE-3 keys `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; either may carry its own
`embed_tokens.weight` (else the target's embedding is used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from braid.runtime.attention.base import AttentionBackend
from braid.runtime.forward_batch import ForwardBatch
from braid.runtime.layers.embedding import LMHead, VocabEmbedding
from braid.runtime.layers.linear import Linear
from braid.runtime.layers.norm import RMSNorm, default_weight_loader
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from braid.runtime.speculative.checkpoint import safetensors_dir, tensor_shapes

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class EagleSpec:
    """What a checkpoint directory holds."""

    version: int  # 1 (EAGLE, EAGLE-2) or 3
    config: ModelConfig
    fc_bias: bool
    own_embedding: bool
    draft_vocab: int | None  # EAGLE-3's
    aux_layers: tuple[int, ...] | None  # EAGLE-3: the target layers whose outputs it reads

    @classmethod
    def read(cls, path: Path, version: int) -> EagleSpec:
        """The spec of the checkpoint in `path` (`ValueError` naming what is wrong)."""
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} has no config.json")
        raw: dict[str, Any] = json.loads(cfg_file.read_text())
        arch = (raw.get("architectures") or [""])[0]
        if arch in EAGLE3_ARCHS and version != 3:
            raise ValueError(f"{path} is an EAGLE-3 checkpoint: use speculative_algorithm EAGLE3")
        config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
        with safetensors_dir(path, WEIGHTS) as d:
            shapes = tensor_shapes(d)
        layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            version=version,
            config=config,
            fc_bias="fc.bias" in shapes,
            own_embedding="embed_tokens.weight" in shapes,
            draft_vocab=shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else None,
            aux_layers=tuple(layers) if layers else None,
        )


class EagleDraft(nn.Module):
    """EAGLE's draft network over one decoder layer (its attention on its own KV pool)."""

    stacked_params = LlamaForCausalLM.stacked_params
    ignored_key_suffixes = ("rotary_emb.inv_freq",)

    def __init__(
        self, spec: EagleSpec, target_hidden: int, dtype: torch.dtype, max_positions: int
    ) -> None:
        super().__init__()
        cfg, h = spec.config, spec.config.hidden_size
        self.version = spec.version
        self.hidden_size = h
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        if spec.own_embedding:
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, h, dtype)
        layer = LlamaDecoderLayer(cfg, 0, dtype)
        if spec.version == 1:
            self.fc = Linear(2 * h, {None: h}, bias=spec.fc_bias, dtype=dtype)
            del layer.input_layernorm  # EAGLE's first layer has no input norm
            self.layers = nn.ModuleList([layer])
            return
        self.fc = Linear(3 * target_hidden, {None: h}, bias=spec.fc_bias, dtype=dtype)
        layer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        attn = layer.self_attn
        attn.qkv_proj = Linear(
            2 * h,
            {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            bias=cfg.qkv_bias,
            dtype=dtype,
        )
        self.midlayer = layer
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        if spec.draft_vocab is None:
            raise ValueError("an EAGLE-3 checkpoint needs its lm_head.weight")
        self.lm_head = LMHead(spec.draft_vocab, h, dtype)
        # Draft id -> target id offsets; `t2d` (which target ids the draft has) is implied.
        self.d2t = nn.Parameter(torch.empty(spec.draft_vocab, dtype=torch.int64), False)
        self.t2d = nn.Parameter(torch.empty(cfg.vocab_size, dtype=torch.bool), False)
        for p in (self.d2t, self.t2d):
            p.weight_loader, p.shard_names = default_weight_loader, (None,)

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        # Some EAGLE-1 checkpoints store a first-layer input norm that EAGLE never applies.
        return None if key == "layers.0.input_layernorm.weight" else key

    def forward(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        embeds: torch.Tensor,
        features: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state the LM head reads, the feature the next draft step takes in) for
        every token of `batch`, given the embeddings of its tokens and the features paired
        with them (the target's, or this network's own)."""
        cos_sin = self.rotary.lookup(batch.positions)
        if self.version == 1:
            layer = self.layers[0]
            x = self.fc(torch.cat([embeds, features], dim=-1))
            h = layer.self_attn(x, cos_sin, batch, attn)
            h, residual = layer.post_attention_layernorm(h, x)
            out = layer.mlp(h) + residual
            return out, out
        layer = self.midlayer
        if features.shape[-1] != self.hidden_size:
            features = self.fc(features)  # the target's layer inputs, concatenated
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        h = layer.self_attn(x, cos_sin, batch, attn)
        h, residual = layer.post_attention_layernorm(h, features)
        normed, summed = self.norm(layer.mlp(h), residual)
        return normed, summed
