"""The Llama family: Llama 2/3.x, SmolLM2, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k norm).

braid's own implementation: fused QKV and gate-up projections, attention through the
pluggable backend over the paged KV cache, tied embeddings where the config asks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from braid.runtime.attention.base import AttentionBackend
from braid.runtime.executor.forward_batch import ForwardBatch
from braid.runtime.layers.activation import silu_and_mul
from braid.runtime.layers.embedding import LMHead, VocabEmbedding
from braid.runtime.layers.linear import Linear
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.models import register_model
from braid.runtime.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(
            cfg.hidden_size,
            {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            bias=cfg.qkv_bias,
            dtype=dtype,
        )
        self.o_proj = Linear(cfg.q_size, {None: cfg.hidden_size}, bias=cfg.o_bias, dtype=dtype)
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


SiluMulDown = Callable[[torch.Tensor, Linear], torch.Tensor]

# Rows up to which the MLP fuses its activation into the down projection on CUDA (a batch-1
# decode step). More rows run the fused kernel's tl.dot form, which repeats the activation per
# output block and per warp: correct, but not measured to pay; raise this after measuring
# (benchmarks/kernels.py has a down_proj M=16 fused row).
FUSED_MLP_MAX_ROWS = 1


def silu_mul_down(gate_up: torch.Tensor, down: Linear) -> torch.Tensor:
    """`down(silu(gate) * up)`: the activation, then the projection (two kernels on CUDA)."""
    return down(silu_and_mul(gate_up))


def select_silu_mul_down(device: torch.device, dtype: torch.dtype) -> SiluMulDown:
    """The MLP's activation and down projection for weights on `device` in `dtype`.

    On CUDA in bfloat16 / float16, a 2-D input of 1..FUSED_MLP_MAX_ROWS rows (a batch-1 decode
    step) runs both in one kernel (`skinny_linear(..., activation="silu_and_mul")`), with the
    activation rounded exactly as `silu_and_mul` rounds it: one launch fewer per layer, for
    outputs equal to the two-kernel path's up to the order of the float32 sum. Other inputs,
    and every input elsewhere, run `silu_mul_down`. The kernel's first call autotunes
    (host-synchronising), which the CUDA-graph runner's eager warm-up does before capture.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return silu_mul_down
    from braid.kernels.skinny_gemm import skinny_linear

    def fused(gate_up: torch.Tensor, down: Linear) -> torch.Tensor:
        if gate_up.dim() == 2 and 1 <= gate_up.shape[0] <= FUSED_MLP_MAX_ROWS:
            return skinny_linear(gate_up, down.weight, down.bias, activation="silu_and_mul")
        return down(silu_and_mul(gate_up))

    return fused


class LlamaMLP(nn.Module):
    """`down(silu(gate) * up)`, with the activation and down projection chosen once, at
    construction, from the weights' device and dtype (`select_silu_mul_down`); the attribute
    `silu_mul_down` holds the choice."""

    def __init__(self, cfg: ModelConfig, dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, {"gate": inter, "up": inter}, bias=cfg.mlp_bias, dtype=dtype
        )
        self.down_proj = Linear(inter, {None: cfg.hidden_size}, bias=cfg.mlp_bias, dtype=dtype)
        self.silu_mul_down = select_silu_mul_down(self.down_proj.weight.device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_mul_down(self.gate_up_proj(x), self.down_proj)


class LlamaDecoderLayer(nn.Module):
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


# Whether a one-token forward on CUDA (batch-1 decode) runs each layer's norms, projections and
# activation in fused kernels (`select_one_row_forward`); tests switch it off to compare.
FUSE_ONE_ROW = True


def select_one_row_forward(
    device: torch.device, dtype: torch.dtype
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The decoder layer's forward for one token on CUDA in bfloat16 / float16, else None.

    A batch-1 decode step of an 8B model is bound by reading the weights, and each small
    kernel between the projections costs about 2 us of launch and ramp (measured on an H200:
    `benchmarks/gpu_step.py`). This path runs each RMSNorm (with its residual add) inside the
    projection that follows it, the activation inside the down projection (`LlamaMLP`'s
    choice), and o_proj in the same skinny kernel (`braid.kernels.skinny_linear`, measured
    12.1 us against cuBLAS's 13.0 us for o_proj): four launches fewer per layer, with every
    rounding point of the unfused path (the sums in the projections may add in another order).
    """
    if not FUSE_ONE_ROW or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    from braid.kernels.skinny_gemm import skinny_linear

    def norm_then(proj: Linear, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """`proj(norm(x + residual))` and the new residual `x + residual`, in one kernel."""
        w = dict(norm_weight=norm.weight, eps=norm.eps)
        if residual is None:
            return skinny_linear(x, proj.weight, proj.bias, **w), x
        new = torch.empty_like(x)
        out = skinny_linear(x, proj.weight, proj.bias, **w, residual=residual, residual_out=new)
        return out, new

    def forward(layer, x, residual, cos_sin, batch, attn):
        sa, mlp = layer.self_attn, layer.mlp
        qkv, residual = norm_then(sa.qkv_proj, layer.input_layernorm, x, residual)
        h = sa.attend(qkv, cos_sin, batch, attn)
        h = skinny_linear(h, sa.o_proj.weight, sa.o_proj.bias)
        gate_up, residual = norm_then(mlp.gate_up_proj, layer.post_attention_layernorm, h, residual)
        return mlp.silu_mul_down(gate_up, mlp.down_proj), residual

    return forward


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary.lookup(batch.positions)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos_sin, batch, attn)
        h, _ = self.norm(h, residual)
        return h


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(nn.Module):
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
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
        )

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits (float32) for the rows `batch.logits_indices` selects."""
        h = self.model(batch, attn)
        return self.lm_head(h[batch.logits_indices]).float()
