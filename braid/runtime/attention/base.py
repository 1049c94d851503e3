"""The attention-backend interface every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from braid.runtime.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `init_forward_metadata` is called once per forward, before the first layer, and may store
    per-forward state in `batch.attn_metadata` (and nowhere else). `forward` rotates q and k
    when given `rotary`, writes the new tokens' K and V into the KV pool at
    `batch.out_cache_loc`, and returns the attention output.

    CUDA graphs (decode only; `executor/cuda_graph.py` is the caller). A backend whose
    `supports_cuda_graph` is True implements the three `*cuda_graph*` hooks below, and a
    decode forward through it can be captured once per padded batch size and replayed:

    1. `init_cuda_graph_state(max_bs)`, once, before any capture.
    2. Capture at size bs: the caller builds a decode `ForwardBatch` of bs rows over its own
       static input tensors, calls `init_forward_metadata_capture_cuda_graph(batch)` in place
       of `init_forward_metadata`, and captures the model forward. That batch's
       `req_pool_indices` and `seq_lens` hold padding values (table row 0, length 1) and are
       never updated: the backend keeps its own static copies, which the captured kernels
       read.
    3. Replay: `init_forward_metadata_replay_cuda_graph(batch, bs)` with the real decode batch
       of n <= bs requests, then the graph's replay. Rows n..bs-1 are padding: token 0 at
       position 0 whose K/V the caller writes to slot 0 (the KV pool's padding page); the
       backend makes their attention read only valid KV slots, and their outputs are
       discarded.

    A backend without graph support leaves `supports_cuda_graph` False, and its hooks raise
    `NotImplementedError` saying so.
    """

    supports_cuda_graph: ClassVar[bool] = False

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device of the KV pool and request-to-token table this backend reads."""

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

    def enable_tree_tails(self, depth: int) -> None:
        """Decode batches will carry draft-tree tails of up to `depth` slots
        (`ForwardBatch.tree_prefix`, `tree_tail`); call before `init_cuda_graph_state` so the
        captured graphs read them too. A backend without graphs reads any tail a batch has
        and has nothing to prepare; one with a sliding window refuses (`ValueError`)."""
        if getattr(self, "sliding_window", None) is not None:
            raise ValueError("draft trees do not go with a sliding window")

    def _no_cuda_graph(self) -> NotImplementedError:
        return NotImplementedError(
            f"attention backend {type(self).__name__} does not support CUDA graphs "
            "(use a backend whose supports_cuda_graph is True, or disable_cuda_graph=True)"
        )

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static decode metadata for captured batches of up to `max_bs`
        requests. Called once, before the first capture; `ValueError` if `max_bs` < 1."""
        raise self._no_cuda_graph()

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Set `batch.attn_metadata` for capturing a decode forward of `batch.batch_size`
        rows: it refers to the backend's static buffers (reset to padding values), so that a
        replay reads what `init_forward_metadata_replay_cuda_graph` copied in. `ValueError`
        for a batch that is not decode, or larger than `init_cuda_graph_state`'s `max_bs`."""
        raise self._no_cuda_graph()

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        """Before replaying the graph captured at size `bs`: copy the real decode `batch`'s
        request rows and lengths (n <= bs requests) into the static buffers on the device (no
        host synchronisation), pad rows n..bs-1, and set `batch.attn_metadata` to what the
        capture used. `ValueError` for a batch that is not decode or does not fit `bs`, or if
        `init_cuda_graph_state` was not called."""
        raise self._no_cuda_graph()
