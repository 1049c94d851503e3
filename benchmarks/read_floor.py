"""The read floor of `benchmarks/quant_kernels.py`: kernels that only read a layer's bytes,
the cost any one-row kernel over them meets, launch and tail included.

- `read_words` (`_read_kernel`): int32 words in contiguous slices, one per program, xor'ed.
- `read_rows` (`_read_rows_kernel`): planar int4 weights loaded as `int4_gemv` loads them (codes
  tile by tile, 64 bytes a row a 128-input block, each group's meta words, by (row block,
  split) programs), xor'ed per row: the GEMV's access pattern without its arithmetic.
- `xor_all`: the host's xor, to check that every word was read once.

Imported when the benchmark runs, so TRITON_INTERPRET (set by `--smoke`) is read first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels.gemv_split import _block_and_split, grid, split_length


@triton.jit
def _read_kernel(Src, Out, words, per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The xor of Src's words [pid * per_program, (pid + 1) * per_program) into Out[pid]:
    reads and nothing else."""
    start = tl.program_id(0) * per_program
    end = tl.minimum(start + per_program, words)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        idx = off + tl.arange(0, BLOCK)
        acc ^= tl.load(Src + idx, mask=idx < end, other=0)
    tl.store(Out + tl.program_id(0), tl.xor_sum(acc, axis=0))


@triton.jit
def _read_rows_kernel(Q, Meta, Out, N, KB, SPLIT_BLOCKS, GROUP_BLOCKS: tl.constexpr,
                      BLOCK_N: tl.constexpr, SUBS: tl.constexpr, STAGES: tl.constexpr,
                      SPLITS_FIRST: tl.constexpr):  # fmt: skip
    """`int4_gemv`'s loads (planar codes [BLOCK_N, 16] words a 128-input block, each group's
    meta words), xor'ed per row into Out[split, rows]: its access pattern without its math."""
    block, split = _block_and_split(SPLITS_FIRST)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    q_rows = Q + rows.to(tl.int64)[:, None] * (KB * 16) + tl.arange(0, 16)[None, :]
    first = split * SPLIT_BLOCKS
    end = tl.minimum(first + SPLIT_BLOCKS, KB)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.int32)
    macc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for b0 in tl.range(first, end, SUBS, num_stages=STAGES):
        for sb in tl.static_range(SUBS):
            b = b0 + sb
            mask = rmask & ((rows * 0 + b) < end)  # past the split's end: masked off
            acc ^= tl.load(q_rows + b * 16, mask=mask[:, None], other=0)
            if b % GROUP_BLOCKS == 0:
                macc ^= tl.load(Meta + (b // GROUP_BLOCKS) * N + rows, mask=mask, other=0)
    tl.store(Out + split * N + rows, tl.xor_sum(acc, axis=1) ^ macc, mask=rmask)


def read_rows(q: torch.Tensor, meta: torch.Tensor, group: int, cfg: tuple) -> torch.Tensor:
    """`_read_rows_kernel` over planar int4 weights (`q`, `meta`, groups of `group`, a
    multiple of 128) with the launch shape (block_n, block_k, split_k, warps, stages,
    splits_first), one launch: [split_k, N] xors."""
    block_n, block_k, split_k, warps, stages, splits_first = cfg
    n, kb = q.shape[0], q.shape[1] // 16
    subs = block_k // 128
    split_blocks = split_length(kb, split_k, subs)
    out = torch.empty(split_k, n, dtype=torch.int32, device=q.device)  # every entry stored
    _read_rows_kernel[grid(triton.cdiv(n, block_n), split_k, splits_first)](
        q, meta, out, n, kb, split_blocks, GROUP_BLOCKS=group // 128, BLOCK_N=block_n, SUBS=subs,
        STAGES=stages, SPLITS_FIRST=splits_first, num_warps=warps,
    )  # fmt: skip
    return out


def read_words(
    src: torch.Tensor, programs: int, block: int, warps: int, stages: int
) -> torch.Tensor:
    """Per-program xors of int32 `src` (`_read_kernel`), one launch: its words cut into
    slices of whole BLOCKs, as many as makes at most `programs` (fewer where the slices'
    rounding up to BLOCKs covers the words sooner)."""
    words = src.numel()
    per_program = triton.cdiv(triton.cdiv(words, programs), block) * block
    launched = triton.cdiv(words, per_program)
    out = torch.empty(launched, dtype=torch.int32, device=src.device)
    _read_kernel[(launched,)](src, out, words, per_program, BLOCK=block, STAGES=stages,
                              num_warps=warps)  # fmt: skip
    return out


def xor_all(t: torch.Tensor) -> int:
    """The xor of all of int32 `t`'s words (on the host)."""
    import numpy as np

    return int(np.bitwise_xor.reduce(t.cpu().numpy().ravel()))
