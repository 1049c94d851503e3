"""Attention through braid's Triton kernels (`braid.kernels`) over the paged KV cache.

Each layer writes the new tokens' K/V into the pool with `store_kv`, then runs
`extend_attention` (new tokens over their cached prefix, read through the request-to-token
table, and causally among themselves) or `decode_attention` (split-K over the table). The
per-forward metadata is built once per forward and shared by every layer; for decode it is
only device tensors and ints, so a decode step can be captured in a CUDA graph (see
`TritonBackend`). Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (slowly: for tests).
With an fp8 pool every kernel reads and writes it with the pool's per-layer scales.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from braid.kernels.attention_decode import decode_attention, workspace_numel
from braid.kernels.attention_extend import extend_attention
from braid.kernels.kv_store import store_kv
from braid.runtime.attention import BACKENDS
from braid.runtime.attention.base import AttentionBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode, packed_to_device
from braid.runtime.layers.rotary import FusedRotaryTables, apply_rotary

# Decode splits: enough programs to fill a GPU (about this many) without merging many tiny
# partial results; a power of two between 1 and MAX_KV_SPLITS.
_TARGET_PROGRAMS = 1024
MAX_KV_SPLITS = 16
# The table row and length given to padded rows of a captured decode batch.
PAD_REQ_ROW = 0
PAD_SEQ_LEN = 1


def _interpreting() -> bool:
    # The values Triton itself reads as true for this variable.
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")


def kv_splits_for_batch(bs: int, num_kv_heads: int) -> int:
    """Decode split count on a GPU for a batch of `bs` requests: enough (request, KV head,
    split) programs to fill it, a power of two up to MAX_KV_SPLITS."""
    programs = max(1, bs * num_kv_heads)
    splits = 1
    while splits < MAX_KV_SPLITS and programs * splits < _TARGET_PROGRAMS:
        splits *= 2
    return splits


@dataclass(frozen=True)
class _DecodeMeta:
    req_pool_indices: torch.Tensor  # [bs] rows of the request-to-token table
    seq_lens: torch.Tensor  # [bs] lengths including the new token
    workspace: torch.Tensor  # float32 split partials, reused by every layer
    num_kv_splits: int
    tree_prefix: torch.Tensor | None = None  # draft-tree rows: see ForwardBatch.tree_prefix
    tree_tail: torch.Tensor | None = None


@dataclass(frozen=True)
class _ExtendMeta:
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    max_extend_len: int


@dataclass(frozen=True)
class _MixedMeta:
    """A mixed extend: the first `tokens` rows through the extend kernel, the decode tail
    (one row per request) through the decode kernel."""

    extend: _ExtendMeta
    decode: _DecodeMeta
    tokens: int


@dataclass(frozen=True)
class _GraphBuffers:
    max_bs: int
    req_pool_indices: torch.Tensor  # int64 [max_bs]
    seq_lens: torch.Tensor  # int64 [max_bs]
    workspace: torch.Tensor  # float32, sized for max_bs at any split count
    tree_prefix: torch.Tensor | None  # int64 [max_bs], with tree tails enabled
    tree_tail: torch.Tensor | None  # int64 [max_bs, depth]


@BACKENDS.register
class TritonBackend(AttentionBackend):
    """Triton attention over `KVPool` and `ReqToTokenPool`.

    Eager use is `init_forward_metadata(batch)` then `forward(...)` per layer, as for every
    backend. `num_kv_splits` fixes the decode split count; by default it depends only on the
    batch size (`kv_splits_for(bs)`), so a captured graph for a batch size always uses the same.
    A mixed extend (`ForwardBatch.decode_tail`) runs its decode rows through the decode kernel
    (split-K over each row's KV) and only the prefill rows through the extend kernel, whose
    blocks of queries a one-token row would mostly leave empty.

    CUDA graphs (decode only), as `AttentionBackend` describes them:

    1. `init_cuda_graph_state(max_bs)` allocates static int64 `req_pool_indices` and
       `seq_lens` buffers of `max_bs` entries and a workspace big enough for any bs <= max_bs.
    2. `init_forward_metadata_capture_cuda_graph(batch)` points the metadata at the first bs
       entries of the static buffers, set to padding values.
    3. `init_forward_metadata_replay_cuda_graph(batch, bs)` copies the real batch's
       `req_pool_indices` and `seq_lens` into the static buffers in place (device copies, no
       host synchronisation) and fills rows n..bs-1 with padding: table row `PAD_REQ_ROW` and
       length `PAD_SEQ_LEN` (1). A padded row therefore reads one KV slot,
       `req_to_token[PAD_REQ_ROW, 0]`: page 0's slot 0 while that row has never been used (the
       table starts zeroed), else some request's slot; either way a valid index, so the read
       is harmless and its output row is discarded (`ReqToTokenPool` has no reserved padding
       row; reserving one would make the read exactly slot 0).
    """

    supports_cuda_graph = True

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        num_kv_splits: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        device = req_to_token.table.device
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"attention_backend 'triton' runs on CUDA; on {device.type} it needs "
                "TRITON_INTERPRET=1 set before start (slow: for tests) or 'torch_native'"
            )
        if num_kv_splits is not None and not 1 <= num_kv_splits <= MAX_KV_SPLITS:
            raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.num_kv_splits = num_kv_splits
        self._graph: _GraphBuffers | None = None
        self.tree_depth = 0  # tails the decode graphs read (speculative draft trees)

    def enable_tree_tails(self, depth: int) -> None:
        """Let captured decode graphs read draft-tree tails of up to `depth` slots (call before
        `init_cuda_graph_state`); eager forwards read any tail a batch has."""
        if self.sliding_window is not None:
            raise ValueError("draft trees do not go with a sliding window")
        self.tree_depth = depth

    @property
    def device(self) -> torch.device:
        return self.req_to_token.table.device

    def kv_splits_for(self, bs: int) -> int:
        """Decode split count for a batch of `bs` requests (a function of bs alone)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if self.device.type != "cuda":
            # The CPU interpreter runs programs one after another: splitting only adds work
            # (two splits still exercise the merge).
            return 2
        return kv_splits_for_batch(bs, self.num_kv_heads)

    def _workspace(self, bs: int, splits: int) -> torch.Tensor:
        n = workspace_numel(bs, self.num_heads, self.head_dim, splits)
        return torch.empty(n, dtype=torch.float32, device=self.device)

    # ---- eager ----------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        if batch.mode is ForwardMode.DECODE:
            splits = self.kv_splits_for(bs)
            batch.attn_metadata = _DecodeMeta(
                req_pool_indices=batch.req_pool_indices,
                seq_lens=batch.seq_lens,
                workspace=self._workspace(bs, splits),
                num_kv_splits=splits,
                tree_prefix=batch.tree_prefix,
                tree_tail=batch.tree_tail,
            )
            return
        tail = batch.decode_tail if 0 < batch.decode_tail < bs else 0
        n = bs - tail  # requests through the extend kernel
        starts, start = [], 0
        for ext in batch.extend_lens[:n]:
            starts.append(start)
            start += ext
        # One host-to-device copy for the three length vectors, each view 16-byte aligned
        # (unaligned views compiled a second variant of the extend kernel the first time a
        # batch of an odd size came: 1.7 s into a serving run on the H200).
        prefix_t, extend_t, starts_t = packed_to_device(
            [batch.prefix_lens[:n], batch.extend_lens[:n], starts], self.device
        )
        extend = _ExtendMeta(
            req_pool_indices=batch.req_pool_indices[:n],
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            extend_start_loc=starts_t,
            max_extend_len=max(batch.extend_lens[:n], default=0),
        )
        if not tail:
            batch.attn_metadata = extend
            return
        splits = self.kv_splits_for(tail)
        decode = _DecodeMeta(
            req_pool_indices=batch.req_pool_indices[n:],
            seq_lens=batch.seq_lens[n:],
            workspace=self._workspace(tail, splits),
            num_kv_splits=splits,
        )
        batch.attn_metadata = _MixedMeta(extend, decode, tokens=start)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        rotary: tuple[Any, Any] | None = None,
    ) -> torch.Tensor:
        k_buf = self.kv_pool.k[layer_id]
        v_buf = self.kv_pool.v[layer_id]
        # An fp8 pool's scales: plain floats, so a captured graph holds them as constants.
        k_scale, v_scale = self.kv_pool.scales(layer_id)
        if rotary is not None and isinstance(rotary[1], FusedRotaryTables):
            # One kernel rotates q and k and writes K and V (saves a launch per layer).
            positions, tables = rotary
            store = (v, k_buf, v_buf, batch.out_cache_loc)
            tables.rotate(q, k, positions, store=store, kv_scales=(k_scale, v_scale))
        else:
            if rotary is not None:
                q, k = apply_rotary(q, k, *rotary)
            store_kv(k_buf, v_buf, k, v, batch.out_cache_loc, k_scale=k_scale, v_scale=v_scale)
        meta = batch.attn_metadata
        scales = (k_scale, v_scale)
        if isinstance(meta, _DecodeMeta):
            o = self._decode(q, k_buf, v_buf, meta, scales)
        elif isinstance(meta, _MixedMeta):
            n = meta.tokens
            head = self._extend(q[:n], k[:n], v[:n], k_buf, v_buf, meta.extend, scales)
            tail = self._decode(q[n:], k_buf, v_buf, meta.decode, scales)
            o = torch.cat([head.view(n, -1), tail.view(q.shape[0] - n, -1)])
        else:
            o = self._extend(q, k, v, k_buf, v_buf, meta, scales)
        return o.view(q.shape[0], -1)

    def _decode(self, q, k_buf, v_buf, meta: _DecodeMeta, scales) -> torch.Tensor:
        return decode_attention(
            q,
            k_buf,
            v_buf,
            self.req_to_token.table,
            meta.req_pool_indices,
            meta.seq_lens,
            self.scale,
            num_kv_splits=meta.num_kv_splits,
            window=self.sliding_window,
            workspace=meta.workspace,
            tree_prefix=meta.tree_prefix,
            tree_tail=meta.tree_tail,
            k_scale=scales[0],
            v_scale=scales[1],
        )

    def _extend(self, q, k, v, k_buf, v_buf, meta: _ExtendMeta, scales) -> torch.Tensor:
        return extend_attention(
            q,
            k,
            v,
            k_buf,
            v_buf,
            self.req_to_token.table,
            meta.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_start_loc,
            self.scale,
            window=self.sliding_window,
            max_extend_len=meta.max_extend_len,
            k_scale=scales[0],
            v_scale=scales[1],
        )

    # ---- CUDA-graph decode ----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static decode metadata for batches of up to `max_bs` requests."""
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        need = max(
            workspace_numel(bs, self.num_heads, self.head_dim, self.kv_splits_for(bs))
            for bs in range(1, max_bs + 1)
        )
        depth = self.tree_depth
        self._graph = _GraphBuffers(
            max_bs=max_bs,
            req_pool_indices=torch.full(
                (max_bs,), PAD_REQ_ROW, dtype=torch.int64, device=self.device
            ),
            seq_lens=torch.full((max_bs,), PAD_SEQ_LEN, dtype=torch.int64, device=self.device),
            workspace=torch.empty(need, dtype=torch.float32, device=self.device),
            tree_prefix=torch.full((max_bs,), PAD_SEQ_LEN, dtype=torch.int64, device=self.device)
            if depth
            else None,
            tree_tail=torch.zeros(max_bs, depth, dtype=torch.int64, device=self.device)
            if depth
            else None,
        )

    def _graph_meta(self, bs: int) -> _DecodeMeta:
        g = self._graph
        if g is None:
            raise ValueError("init_cuda_graph_state(max_bs) must be called first")
        if not 1 <= bs <= g.max_bs:
            raise ValueError(f"batch size {bs} is outside [1, max_bs={g.max_bs}]")
        return _DecodeMeta(
            req_pool_indices=g.req_pool_indices[:bs],
            seq_lens=g.seq_lens[:bs],
            workspace=g.workspace,
            num_kv_splits=self.kv_splits_for(bs),
            tree_prefix=None if g.tree_prefix is None else g.tree_prefix[:bs],
            tree_tail=None if g.tree_tail is None else g.tree_tail[:bs],
        )

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Metadata for capturing a decode forward of `batch.batch_size` rows over the
        static buffers (filled with padding values)."""
        if batch.mode is not ForwardMode.DECODE:
            raise ValueError("only decode batches are captured in CUDA graphs")
        meta = self._graph_meta(batch.batch_size)
        meta.req_pool_indices.fill_(PAD_REQ_ROW)
        meta.seq_lens.fill_(PAD_SEQ_LEN)
        if meta.tree_prefix is not None:
            meta.tree_prefix.fill_(PAD_SEQ_LEN)
            meta.tree_tail.zero_()
        batch.attn_metadata = meta

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        """Copy the real decode `batch` (n <= bs requests) into the static buffers, padding
        rows n..bs-1, and set `batch.attn_metadata` to what the graph captured at size bs."""
        meta = self._graph_meta(bs)
        if batch.mode is not ForwardMode.DECODE:
            raise ValueError("only decode batches are replayed from CUDA graphs")
        n = batch.batch_size
        if n > bs:
            raise ValueError(f"batch of {n} requests does not fit a graph of size {bs}")
        meta.req_pool_indices[:n].copy_(batch.req_pool_indices, non_blocking=True)
        meta.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        meta.req_pool_indices[n:].fill_(PAD_REQ_ROW)
        meta.seq_lens[n:].fill_(PAD_SEQ_LEN)
        if meta.tree_prefix is not None:
            if batch.tree_prefix is None:  # every row reads its table row alone
                meta.tree_prefix[:n].copy_(batch.seq_lens, non_blocking=True)
            else:
                width = batch.tree_tail.shape[1]
                if width > self.tree_depth:
                    raise ValueError(
                        f"a tail of {width} is deeper than the graphs' {self.tree_depth}"
                    )
                meta.tree_prefix[:n].copy_(batch.tree_prefix, non_blocking=True)
                meta.tree_tail[:n, :width].copy_(batch.tree_tail, non_blocking=True)
            meta.tree_prefix[n:].fill_(PAD_SEQ_LEN)
        elif batch.tree_prefix is not None:
            raise ValueError("this decode batch has draft-tree tails the graphs were not built for")
        batch.attn_metadata = meta
