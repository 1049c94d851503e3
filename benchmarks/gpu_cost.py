"""What a model's forwards cost, from its shapes, and the offline-throughput bound built on it
(used by benchmarks/gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from braid.runtime.distributed.group import TPGroup, sharding
from braid.runtime.layers.parallel import head_shard
from braid.runtime.models import get_model_class
from braid.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    """What the model's forwards cost, from its shapes. Parameters are counted on a meta-device
    build of braid's own model class, so fused and tied weights count as braid holds them."""

    weight_bytes: int  # every parameter, embedding included (as the device README's roofline)
    embedding_bytes: int
    layer_matmul_params: int  # the 2-D weights inside the decoder layers
    lm_head_params: int
    attn_flops_per_pair: int  # QK^T + PV over all layers and heads, per (query, key) pair
    kv_bytes_per_token: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> ModelCost:
        """The whole model's costs, or with `tp` > 1 one tensor-parallel rank's: its shard
        as braid builds it (rank 0 of `tp`), its share of the heads, the KV and the LM head."""
        group = TPGroup(0, tp, 0, None, None)
        with sharding(group), torch.device("meta"):
            model = get_model_class(cfg.architecture)(cfg, dtype, 8)
        size = torch.finfo(dtype).bits // 8
        params = dict(model.named_parameters())
        embed = next(p for n, p in params.items() if "embed_tokens" in n)
        shard = head_shard(cfg.num_heads, cfg.num_kv_heads, 0, tp)
        kv_share = shard.num_kv_heads / cfg.num_kv_heads
        return cls(
            weight_bytes=sum(p.numel() for p in params.values()) * size,
            embedding_bytes=embed.numel() * size,
            layer_matmul_params=sum(
                p.numel() for n, p in params.items() if ".layers." in n and p.dim() == 2
            ),
            lm_head_params=-(-cfg.vocab_size // tp) * cfg.hidden_size,
            attn_flops_per_pair=2 * 2 * cfg.num_layers * shard.num_heads * cfg.head_dim,
            kv_bytes_per_token=round(cfg.kv_bytes_per_token(size) * kv_share),
        )

    def forward_flops(self, new_tokens: int, cached: int = 0, logits: int = 1) -> float:
        """FLOPs of one sequence's forward of `new_tokens` after `cached` ones: 2 per weight per
        token in the layers, 2 per lm_head weight per logits row (braid computes logits only
        where it samples), and the causal attention pairs (each new token attends to the cached
        ones, the earlier new ones and itself)."""
        pairs = new_tokens * cached + new_tokens * (new_tokens + 1) // 2
        return (
            2 * self.layer_matmul_params * new_tokens
            + 2 * self.lm_head_params * logits
            + self.attn_flops_per_pair * pairs
        )


def offline_bound(
    cost: ModelCost, n: int, n_in: int, n_out: int, batch: int, bw: float, rate: float
) -> dict:
    """A lower bound on the time of `n` prompts of `n_in` tokens, `n_out` out each, at most
    `batch` decoded together: every prompt's prefill FLOPs at the matmul rate, then waves of
    `batch` sequences whose every decode step takes max(bytes read / bw, FLOPs / rate), bytes
    read = all weights + the KV of every sequence in the step."""
    prefill_s = n * cost.forward_flops(n_in) / rate
    waves = [batch] * (n // batch) + ([n % batch] if n % batch else [])
    decode_s = 0.0
    for b in waves:
        for step in range(1, n_out):  # the first output token comes from the prefill
            ctx = n_in + step
            mem = (cost.weight_bytes + b * ctx * cost.kv_bytes_per_token) / bw
            decode_s += max(mem, b * cost.forward_flops(1, cached=ctx - 1) / rate)
    return {
        "batch": batch,
        "waves": len(waves),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "bound_s": prefill_s + decode_s,
        "formula": "bound_s = n * prefill_flops(n_in) / matmul_rate + sum over waves of "
        "batch B, over decode steps s = 1..n_out-1 of max((weight_bytes + B * (n_in + s) * "
        "kv_bytes_per_token) / copy_bw, B * flops(1 token, n_in + s keys) / matmul_rate); "
        "B = min(n, max_running_requests, kv_capacity // (n_in + n_out))",
    }
