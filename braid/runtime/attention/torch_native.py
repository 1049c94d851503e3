"""Attention in plain torch (`scaled_dot_product_attention`) over the paged KV cache.

Runs on CPU and CUDA. Extend (prefill on top of a cached prefix) goes request by request: each
request's keys are gathered through the request-to-token table and its new tokens attend to the
prefix and causally among themselves. Decode is one batched call: the keys of all requests are
gathered into a padded [batch, max_len, kv_heads, head_dim] block with a length mask (a lone
sequence that sees all its keys: no padding and no mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from braid.runtime.attention import BACKENDS
from braid.runtime.attention.base import AttentionBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.layers.rotary import apply_rotary


@dataclass
class _ExtendMeta:
    # Per request: (token slice start, end, kv slots of the whole sequence, mask or None).
    items: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # [batch, max_len] KV slots, padded with slot 0 ([max_len]: no mask)
    # [batch, 1, 1, max_len] True where the key is visible; None: every key is (one sequence)
    mask: torch.Tensor | None
    # One sequence whose slots are one ascending run [start, start + n): its keys are a view
    # of the pool's rows, nothing gathered (the allocator hands a request's pages out in
    # order, so a sequence without a prefix hit usually has one run).
    span: tuple[int, int] | None = None


@BACKENDS.register
class TorchNativeBackend(AttentionBackend):
    """Attention in plain torch; no CUDA-graph support (`supports_cuda_graph` is False).

    Every key and value attended to is read back from the pool after the new tokens are
    stored, so with an fp8 pool the new tokens of an extend are seen quantized too, as the
    Triton backend sees them."""

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    @property
    def device(self) -> torch.device:
        return self.req_to_token.table.device

    def _visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= q_pos - k_pos < self.sliding_window
        return mask

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.table
        device = table.device
        rows = batch.req_pool_indices.tolist()
        if batch.mode is ForwardMode.DECODE:
            seq_lens = batch.seq_lens
            max_len = int(seq_lens.max())
            k_pos = torch.arange(max_len, device=device)[None, :]
            slots = table[batch.req_pool_indices, :max_len]
            if batch.tree_prefix is not None:  # keys past the prefix come from the tail
                prefix, tail = batch.tree_prefix[:, None], batch.tree_tail
                at = (k_pos - prefix).clamp(0, tail.shape[1] - 1)
                slots = torch.where(k_pos < prefix, slots, tail.gather(1, at))
            window = self.sliding_window
            sees_all = window is None or max_len <= window
            if len(rows) == 1 and batch.tree_prefix is None and sees_all:
                # One sequence that sees all its keys: no mask (SDPA's unmasked path is a
                # quarter faster at a batch-1 step's sizes; equal within float32 rounding).
                slots = slots.reshape(-1)
                batch.attn_metadata = _DecodeMeta(slots, None, _ascending_run(slots))
                return
            mask = self._visible((seq_lens - 1)[:, None], k_pos) & (k_pos < seq_lens[:, None])
            slots = torch.where(mask, slots, 0)
            batch.attn_metadata = _DecodeMeta(slots=slots, mask=mask[:, None, None, :])
            return
        items = []
        start = 0
        for row, prefix, n in zip(rows, batch.prefix_lens, batch.extend_lens):
            total = prefix + n
            slots = table[row, :total]
            mask = None
            window_hit = self.sliding_window is not None and total > self.sliding_window
            if prefix or window_hit:
                q_pos = torch.arange(prefix, total, device=device)[:, None]
                k_pos = torch.arange(total, device=device)[None, :]
                mask = self._visible(q_pos, k_pos)
            items.append((start, start + n, slots, mask))
            start += n
        batch.attn_metadata = _ExtendMeta(items=items)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        rotary: tuple[Any, Any] | None = None,
    ) -> torch.Tensor:
        if rotary is not None:
            q, k = apply_rotary(q, k, *rotary)
        pool = self.kv_pool
        pool.store(layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_metadata
        # `pool.read`: index_select, not advanced indexing: several times faster on CPU
        # (measured: docs/benchmarks.md, Figures behind design choices); an fp8 pool's rows
        # come back dequantized. SDPA's own GQA (enable_gqa) avoids copying each KV head out
        # once per query head.
        if batch.mode is ForwardMode.DECODE:
            b = q.shape[0]
            if meta.span is not None and not pool.quantized:
                first, n = meta.span
                kk, vv = pool.k[layer_id][first : first + n], pool.v[layer_id][first : first + n]
            else:
                kk, vv = pool.read(layer_id, meta.slots.reshape(-1), q.dtype)
            max_len = kk.shape[0] // b
            kk = kk.view(b, max_len, self.num_kv_heads, -1)
            vv = vv.view(b, max_len, self.num_kv_heads, -1)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                kk.transpose(1, 2),
                vv.transpose(1, 2),
                attn_mask=meta.mask,
                scale=self.scale,
                enable_gqa=True,
            )
            return o.reshape(b, -1)
        out = torch.empty_like(q)
        for start, end, slots, mask in meta.items:
            qi = q[start:end].transpose(0, 1).unsqueeze(0)
            ki, vi = pool.read(layer_id, slots, q.dtype)
            ki = ki.transpose(0, 1).unsqueeze(0)
            vi = vi.transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start:end] = oi[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)


def _ascending_run(slots: torch.Tensor) -> tuple[int, int] | None:
    """(first, n) when `slots` ([n]) are first, first + 1, ..., else None."""
    n = slots.shape[0]
    first, last = int(slots[0]), int(slots[-1])
    if last - first != n - 1:
        return None
    if n > 2 and not torch.equal(slots, torch.arange(first, last + 1, device=slots.device)):
        return None
    return first, n
