"""The Llama family: Llama 2/3.x, SmolLM2, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k norm).

braid's own implementation: fused QKV and gate-up projections, attention through the
pluggable backend over the paged KV cache, tied embeddings where the config asks. The layers
are the tensor-parallel ones (`layers.parallel`): built inside `distributed.group.sharding`
each rank holds its heads, its MLP columns and its vocabulary block; outside it, the whole
model.
"""

from __future__ import annotations

import torch
from torch import nn

from braid.runtime.attention.base import AttentionBackend
from braid.runtime.distributed.group import building_group
from braid.runtime.forward_batch import ForwardBatch
from braid.runtime.layers.fusion import (
    select_one_row_forward,
    select_prepared_one_row_forward,
    select_silu_mul_down,
)
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_shards,
    qkv_shards,
)
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.models import MODELS
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.native_decode import NativeCpuDecode


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        # Under tensor parallelism (`distributed.group.sharding`) this rank's heads only.
        heads, shards = qkv_shards(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, building_group())
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = heads.num_heads * cfg.head_dim
        self.kv_size = heads.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, shards, bias=cfg.qkv_bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos_sin, batch, attn))

    def attend(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Attention from the QKV projection's output, before `o_proj`."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # The backend rotates q and k (on CUDA in the kernel that also stores K and V).
        return attn.forward(q, k, v, self.layer_id, batch, rotary=cos_sin)


class LlamaMLP(nn.Module):
    """`down(silu(gate) * up)`, with the activation and down projection chosen once, at
    construction, by `layers.fusion.select_silu_mul_down`; the attribute `silu_mul_down`
    holds the choice."""

    def __init__(self, cfg: ModelConfig, dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        shards = column_shards({"gate": inter, "up": inter}, building_group(), "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, shards, bias=cfg.mlp_bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.silu_mul_down = select_silu_mul_down(self.down_proj.weight.device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_mul_down(self.gate_up_proj(x), self.down_proj)


class LlamaDecoderLayer(nn.Module):
    """A `layers.fusion.PreNormDecoderLayer`; `one_row` holds that module's choice of a fused
    forward for one token (None: every input runs the layer's own path)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, dtype)
        self.mlp = LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.one_row = select_one_row_forward(self.input_layernorm.weight.device, dtype)

    def forward(self, x, residual, cos_sin, batch, attn):
        if self.one_row is not None and x.dim() == 2 and x.shape[0] == 1:
            return self.one_row(self, x, residual, cos_sin, batch, attn)
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, batch, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # The decoder layers as one native call for CPU decode steps, where the weights allow
        # (`after_weights_loaded`); None: every forward runs the layers here.
        self.native_decode: NativeCpuDecode | None = None

    def after_weights_loaded(self) -> None:
        self.native_decode = NativeCpuDecode.for_model(self)
        for layer in self.layers:
            if layer.one_row is None:
                layer.one_row = select_prepared_one_row_forward(layer)

    def forward(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Hidden states of the batch's tokens. A vision-language model passes the embeddings
        itself (`input_embeds`, image rows filled in) and, for M-RoPE, its own rotary rows.
        `deepstack=(rows, features)` (Qwen3-VL): after layer `i` the hidden states of `rows`
        gain `features[i]` ([len(rows), hidden]), as transformers adds them."""
        h = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        if cos_sin is None:
            cos_sin = self.rotary.lookup(batch.positions)
        native = self.native_decode
        if (
            native is not None
            and input_embeds is None
            and deepstack is None
            and not batch.aux_layers
        ):
            out = native(h, cos_sin, batch, attn)
            if out is not None:
                batch.aux_hidden_states = None
                return out
        rows, extra = deepstack if deepstack is not None else (None, [])
        residual = None
        wanted, captured = batch.aux_layers, {}
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos_sin, batch, attn)
            if i < len(extra):
                # The layer's output is h + residual (the next norm adds them); add them here,
                # in transformers' order, so the next layer starts from the sum.
                h = h + residual if residual is not None else h.clone()
                h.index_add_(0, rows, extra[i].to(h.dtype))
                residual = None
            if wanted and i in wanted:
                captured[i] = h + residual if residual is not None else h.clone()
        batch.aux_hidden_states = [captured[i] for i in wanted] if wanted else None
        if residual is None:
            return self.norm(h)
        h, _ = self.norm(h, residual)
        return h


def lm_head_for(
    cfg: ModelConfig, dtype: torch.dtype, embed: VocabParallelEmbedding
) -> ParallelLMHead:
    """The LM head of a model whose token embedding is `embed`: tied to it when the config
    says so (the vision-language models build theirs with this too)."""
    tied = embed if cfg.tie_word_embeddings else None
    return ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tied_to=tied)


@MODELS.register
class LlamaForCausalLM(nn.Module):
    """Serves every architecture `braid.runtime.models.MODELS` maps to this module."""

    # Its forward leaves the final hidden states in the batch when asked (embeddings).
    pools_hidden_states = True

    # checkpoint projection name -> (braid's fused parameter, shard)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # checkpoint keys that hold no weights (precomputed rotary tables in old checkpoints)
    ignored_key_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, max_positions)
        self.lm_head = lm_head_for(cfg, dtype, self.model.embed_tokens)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits (float32) for the rows `batch.logits_indices` selects."""
        h = self.model(batch, attn)
        if batch.capture_hidden:
            batch.hidden_states = h
        return self.lm_head(h[batch.logits_indices], batch.head_rows).float()
