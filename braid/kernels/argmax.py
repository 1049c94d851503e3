"""Row-wise argmax of logits: greedy sampling's one reduction.

`torch.argmax` over one row of a 128k vocabulary runs as a single-row reduction: one kernel many
times longer than a short launch, a small but avoidable share of a batch-1 decode step on an
H200 (measured: docs/benchmarks.md, Figures behind design choices). Here the row is cut into
chunks reduced in parallel (stage 1: each chunk's max and first index of it), then one program
per row picks the first chunk holding the row's max (stage 2): two short launches. Ties go to
the lowest index, as in `torch.argmax`; a row of all -inf gives 0, as there. NaN counts as the
maximum, as there (a NaN row gives its first NaN, unless a +inf comes before it); whatever a
row holds, the index is in range, since greedy ids go straight into the next step's input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import check_tensor, next_pow2

# Elements per stage-1 program: 64 programs per row for a 128k vocabulary.
CHUNK = 2048


@triton.jit
def _argmax_chunks(X, Vals, Idx, stride_x, V, NUM_CHUNKS, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
    best = tl.max(x, 0)
    # The first position holding the chunk's max; for a chunk of all -inf that is its first
    # position, which is < V (padding past V never comes first).
    first = tl.min(tl.where(x == best, offs, V + CHUNK), 0)
    tl.store(Vals + row * NUM_CHUNKS + part, best)
    tl.store(Idx + row * NUM_CHUNKS + part, first.to(tl.int64))


@triton.jit
def _argmax_merge(Vals, Idx, Out, NUM_CHUNKS, BLOCK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < NUM_CHUNKS
    vals = tl.load(Vals + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    best = tl.max(vals, 0)
    # Chunks are in index order: the first chunk with the max holds the first index of it.
    part = tl.min(tl.where(mask & (vals == best), offs, BLOCK_P), 0)
    part = tl.minimum(part, NUM_CHUNKS - 1)  # never read past the row
    tl.store(Out + row, tl.load(Idx + row * NUM_CHUNKS + part))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a 2-D float tensor with unit stride in its last dimension: int64
    [rows], the first index of each row's maximum (NaN counting as the maximum). No host
    synchronisation."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    rows, v = x.shape
    if v < 1:
        raise ValueError(f"x must have at least one column, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride in its last dimension, got {x.stride()}")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(v, CHUNK)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    _argmax_chunks[(rows, chunks)](x, vals, idx, x.stride(0), v, chunks, CHUNK=CHUNK)
    _argmax_merge[(rows,)](vals, idx, out, chunks, BLOCK_P=max(2, next_pow2(chunks)))
    return out


def argmax_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """What `argmax_rows` computes: torch's argmax over the last dimension."""
    return x.argmax(dim=-1)
