"""The split-K epilogue the one-row GEMVs share (`quant_gemv`, `int4_gemv`, `gguf_gemm`): each
split of K writes its float32 partial sums to a workspace, and the last split of a row block
to arrive (an atomic counter) adds them in split order, scales, adds the bias and stores. One
launch, and the same bits whatever order the programs ran in; the counters return to zero.
`_sum_splits` is the summing part alone (also GGUF's several-row kernel's, over its tiles).

Program order (`GemvConfig.splits_first`): the grid is (row blocks, splits) or, with
SPLITS_FIRST, (splits, row blocks). The GPU starts programs in grid order, the first axis
fastest, so the first order has the programs running at one time read one slice of K from
every row, the second every slice of a few rows' whole length."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_and_split(SPLITS_FIRST: tl.constexpr):
    """(row block, split of K) of this program, in the grid order SPLITS_FIRST names."""
    if SPLITS_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


def split_length(total: int, split_k: int, step: int) -> int:
    """Each split's length along K: `total` cut into `split_k` pieces, each rounded up to whole
    loop `step`s (the last split may run short, or be empty)."""
    return triton.cdiv(triton.cdiv(total, split_k), step) * step


def grid(n_blocks: int, split_k: int, splits_first: bool) -> tuple[int, int]:
    """The launch grid of `n_blocks` row blocks by `split_k` splits, as `_block_and_split`
    reads it."""
    return (split_k, n_blocks) if splits_first else (n_blocks, split_k)


@triton.jit
def _sum_splits(y, block, split, idx, mask, Partials, Counters, STRIDE, SPLIT_K: tl.constexpr):
    """(The splits' y summed in split order, whether this program holds that sum): each split
    writes y to `Partials + split * STRIDE + idx`, and the last of block's SPLIT_K splits to
    arrive reads them all back and sets the block's counter to zero again."""
    last = True
    if SPLIT_K > 1:
        tl.store(Partials + split * STRIDE + idx, y, mask=mask)
        # Every thread's partial is written before one thread announces the split.
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + block, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            y = tl.load(Partials + idx, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                y += tl.load(
                    Partials + s * STRIDE + idx, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(Counters + block, 0)
    return y, last


@triton.jit
def _finish(
    y,
    block,
    split,
    rows,
    rmask,
    Out,
    Bias,
    ColScales,
    row_scale,
    Partials,
    Counters,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """Stores `((sum of the splits' y) * row_scale) * ColScales[rows] + Bias[rows]`, rounded
    once to Out's dtype; with SPLIT_K > 1 only the last split of the row block does."""
    y, last = _sum_splits(y, block, split, rows, rmask, Partials, Counters, N, SPLIT_K)
    if last:
        y = y * row_scale
        if HAS_SCALES:
            y = y * tl.load(ColScales + rows, mask=rmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=rmask)
