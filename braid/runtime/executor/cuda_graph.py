"""Decode forwards replayed from CUDA graphs.

A batch-1 decode step of an 8B model launches several hundred small kernels; launched one by
one from Python, the host is the bottleneck: eager decode on an H200 reached a small fraction of
the bandwidth roofline (measured: docs/benchmarks.md, Figures behind design choices).
`CudaGraphRunner` captures the decode forward (the model up to the logits) once per padded
batch size and replays it: one launch per step. A batch of n requests runs in the graph of the
smallest captured size >= n; rows n.. are padding whose outputs are discarded.

Padding rows are harmless by construction: token id 0 at position 0, writing its K/V to slot 0
(page 0, which `KVPool` never hands out), and attending through the backend's padding row and
length (the CUDA-graph contract of `AttentionBackend`, which any backend whose
`supports_cuda_graph` is True keeps).
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from braid.runtime.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from braid.runtime.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SLOT = 0  # slot 0 of page 0: the KV pool's padding page


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured for decode batches of up to `max_bs` requests, ascending:
    1, 2, 4, 8, then every multiple of 8 below `max_bs`, then `max_bs` (padding wastes at most
    7 rows past 8, and small batches, the latency-bound ones, waste least)."""
    if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"max_bs must be a positive integer, got {max_bs!r}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 8))
    return [*sizes, max_bs]


def start_batch_sizes(sizes: Sequence[int]) -> list[int]:
    """Of the ascending `sizes`, those captured before the runtime is ready when the others
    wait for idle time: the powers of two and the largest (a batch pads to at most twice its
    size meanwhile)."""
    return [s for s in sizes if s & (s - 1) == 0 or s == sizes[-1]]


def padded_batch_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds `n` requests; None when `n` exceeds them
    all (that batch runs eagerly)."""
    if n < 1:
        raise ValueError(f"a decode batch has at least 1 request, got {n}")
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def _copy_padded(dst: torch.Tensor, src: torch.Tensor, pad: int) -> None:
    n = src.shape[0]
    dst[:n].copy_(src, non_blocking=True)
    dst[n:].fill_(pad)


class StaticDecodeInputs:
    """The input tensors captured decode graphs read, for up to `max_bs` rows: token ids,
    positions, KV write slots (all int64) and the logits row indices (0..max_bs-1).

    Their storage never changes: a graph captured over `batch(bs)` reads whatever `load`
    copied in last. `load` copies on the device only (no host synchronisation).
    """

    def __init__(self, max_bs: int, device: torch.device) -> None:
        def full(value: int) -> torch.Tensor:
            return torch.full((max_bs,), value, dtype=torch.int64, device=device)

        self.max_bs = max_bs
        self.input_ids = full(PAD_TOKEN_ID)
        self.positions = full(PAD_POSITION)
        self.out_cache_loc = full(PAD_SLOT)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        # A valid row and length, never updated: the backend reads its own static copies of
        # these two (`AttentionBackend`'s CUDA-graph contract).
        self._req_pool_indices = full(0)
        self._seq_lens = full(1)

    def batch(self, bs: int) -> ForwardBatch:
        """A decode `ForwardBatch` of `bs` rows over the static tensors (what a graph is
        captured on). Its `req_pool_indices` and `seq_lens` hold fixed padding values: the
        attention backend keeps the real ones (`init_forward_metadata_replay_cuda_graph`)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"bs must be in [1, {self.max_bs}], got {bs}")
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self._req_pool_indices[:bs],
            seq_lens=self._seq_lens[:bs],
            prefix_lens=[0] * bs,
            extend_lens=[1] * bs,
            logits_indices=self.logits_indices[:bs],
        )

    def load(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a decode `batch` of n <= bs requests into rows 0..n-1 and set rows n..bs-1 to
        padding (token `PAD_TOKEN_ID`, position `PAD_POSITION`, slot `PAD_SLOT`)."""
        n = batch.batch_size
        if batch.mode is not ForwardMode.DECODE:
            raise ValueError("only decode batches run in CUDA graphs")
        if not 1 <= n <= bs <= self.max_bs:
            raise ValueError(f"a batch of {n} requests does not fit bs={bs} (max {self.max_bs})")
        _copy_padded(self.input_ids[:bs], batch.input_ids, PAD_TOKEN_ID)
        _copy_padded(self.positions[:bs], batch.positions, PAD_POSITION)
        _copy_padded(self.out_cache_loc[:bs], batch.out_cache_loc, PAD_SLOT)

    def reset(self) -> None:
        """Every row back to padding (what a capture's warm-up run reads)."""
        self.input_ids.fill_(PAD_TOKEN_ID)
        self.positions.fill_(PAD_POSITION)
        self.out_cache_loc.fill_(PAD_SLOT)


class CudaGraphRunner:
    """Captures the decode forward of `model` (through `backend`) for every size in
    `capture_batch_sizes(max_bs)`, and replays it. `backend` is any `AttentionBackend` whose
    `supports_cuda_graph` is True (else `ValueError`). Without `lazy` every size is captured at
    construction; with it only `start_batch_sizes` are, and `capture_pending` captures one more
    each time the scheduler finds itself idle (a batch replays the smallest captured size that
    holds it, so until then it may pad further).

    Capture runs largest size first on one side stream, after one eager warm-up run per size
    (which compiles the Triton kernels and sets up cuBLAS outside the graph); all graphs share
    one memory pool, and each copies its logits into one static buffer of max_bs rows, so
    together they take about what the largest one needs. (Each graph keeping its own logits
    took the sum over the sizes: 34 GB for the 131 sizes up to 1024 rows at a 128K vocabulary,
    which ran the H200 out of memory.) The graphs read the KV pool and request-to-token table
    in place, so they stay valid for the life of the model runner. One log line reports the
    capture times.

    `can_run(batch)`: a decode batch of 1..max_bs requests with one logits row per request.
    `run(batch)`: its logits, [n, vocab] float32 -- a view of the graph's static output, valid
    until the next forward (which overwrites it).
    """

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_bs: int,
        capture_hidden: bool = False,
        aux_layers: tuple[int, ...] = (),
        tree_depth: int = 0,
        lazy: bool = False,
    ) -> None:
        if not backend.supports_cuda_graph:
            raise ValueError(
                f"attention backend {type(backend).__name__} does not support CUDA graphs "
                "(disable_cuda_graph=True, or --disable-cuda-graph, decodes eagerly)"
            )
        self.model = model
        self.backend = backend
        self.device = backend.device
        self.max_bs = max_bs
        # Speculative decoding: the graphs leave the hidden states (and EAGLE-3's layer
        # inputs) in static outputs too, handed to each replayed batch.
        self.capture_hidden = capture_hidden
        self.aux_layers = aux_layers
        self.tree_depth = tree_depth  # draft-tree tails the graphs read (the backend's)
        self._hidden: dict[int, tuple[torch.Tensor | None, list[torch.Tensor] | None]] = {}
        self.batch_sizes = capture_batch_sizes(max_bs)
        start = start_batch_sizes(self.batch_sizes) if lazy else self.batch_sizes
        # Sizes left for idle time, largest first (`capture_pending`).
        self.pending = [bs for bs in reversed(self.batch_sizes) if bs not in start]
        self.inputs = StaticDecodeInputs(max_bs, self.device)
        self.replays: collections.Counter[int] = collections.Counter()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max_bs, vocab]: every graph's output
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(self.device)
        self._pending_s = 0.0
        backend.init_cuda_graph_state(max_bs)
        self._capture_all(start)

    @torch.inference_mode()
    def _capture_all(self, sizes: list[int]) -> None:
        free_before = torch.cuda.mem_get_info(self.device)[0]
        times: dict[int, float] = {}
        t0 = time.perf_counter()
        # Largest first: smaller graphs then reuse the pool memory the larger ones freed.
        for bs in reversed(sizes):
            t = time.perf_counter()
            try:
                self._capture(bs)
            except RuntimeError as e:
                raise RuntimeError(
                    f"CUDA graph capture failed at batch size {bs}: {e} "
                    "(disable_cuda_graph=True, or --disable-cuda-graph, decodes eagerly)"
                ) from e
            times[bs] = time.perf_counter() - t
        total = time.perf_counter() - t0
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d) in %.2f s, %.0f MB; "
            "per size (bs:ms) %s%s",
            len(times),
            self.max_bs,
            total,
            used / 1e6,
            " ".join(f"{bs}:{times[bs] * 1e3:.0f}" for bs in sizes),
            f"; the other {len(self.pending)} sizes are captured while the scheduler is idle"
            if self.pending
            else "",
        )

    @torch.inference_mode()
    def capture_pending(self) -> bool:
        """Capture the largest size still pending (call only while no forward is queued or
        running); returns whether one was captured. A failed capture (out of memory) is
        logged and ends the pending captures: batches keep padding to captured sizes."""
        if not self.pending:
            return False
        bs = self.pending.pop(0)
        t = time.perf_counter()
        try:
            self._capture(bs)
        except RuntimeError as e:
            logger.warning(
                "CUDA graphs: capture at batch size %d failed (%s); the %d sizes left are not "
                "captured, their batches pad to captured sizes",
                bs,
                e,
                len(self.pending),
            )
            self.pending.clear()
            return False
        self._pending_s += time.perf_counter() - t
        if not self.pending:
            logger.info(
                "CUDA graphs: every decode batch size captured (the idle-time ones in %.2f s)",
                self._pending_s,
            )
        return True

    def _capture(self, bs: int) -> None:
        """Capture size `bs` and point the batches it now serves best at it."""
        # The static inputs hold the last replayed batch's rows: back to padding, so the
        # warm-up run writes its KV to the padding slot only.
        self.inputs.reset()
        batch = self.inputs.batch(bs)
        batch.capture_hidden, batch.aux_layers = self.capture_hidden, self.aux_layers
        stream = self._stream
        with torch.cuda.device(self.device):
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # Warm-up: nothing may compile in the capture.
                warm = self.model(batch, self.backend)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._logits is None:  # outside the graphs' pool, for all of them
                shape = (self.max_bs, *warm.shape[1:])
                self._logits = torch.empty(shape, dtype=warm.dtype, device=self.device)
            del warm
            graph = torch.cuda.CUDAGraph()
            # thread_local: the scheduler's other threads (its heartbeat reads CUDA events)
            # may call the runtime while a capture runs on this one.
            with torch.cuda.graph(
                graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
            ):
                # The graph's own logits go back to the pool once copied: the next (smaller)
                # capture reuses their memory.
                self._logits[:bs].copy_(self.model(batch, self.backend))
        self._hidden[bs] = (batch.hidden_states, batch.aux_hidden_states)
        self._graphs[bs] = graph
        captured = sorted(self._graphs)
        # _bucket[n]: the captured size a batch of n requests runs in.
        self._bucket = [0] + [
            padded_batch_size(n, captured) or self.max_bs for n in range(1, self.max_bs + 1)
        ]

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `batch` replays a graph: decode, 1..max_bs requests, one logits row each,
        asking for no hidden states the graphs do not capture, and no draft-tree tail deeper
        than they read."""
        n = batch.batch_size
        return (
            batch.mode is ForwardMode.DECODE
            and 1 <= n <= self.max_bs
            and batch.logits_indices.shape[0] == n
            and (not batch.capture_hidden or self.capture_hidden)
            and (not batch.aux_layers or batch.aux_layers == self.aux_layers)
            and (batch.tree_tail is None or batch.tree_tail.shape[1] <= self.tree_depth)
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch `can_run` accepts; no host synchronisation."""
        n = batch.batch_size
        bs = self._bucket[n]
        self.inputs.load(batch, bs)
        self.backend.init_forward_metadata_replay_cuda_graph(batch, bs)
        self._graphs[bs].replay()
        self.replays[bs] += 1
        hidden, aux = self._hidden[bs]
        if batch.capture_hidden:
            batch.hidden_states = hidden[:n]
            batch.aux_hidden_states = None if aux is None else [a[:n] for a in aux]
        return self._logits[:n]
