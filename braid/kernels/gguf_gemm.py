"""`gguf_linear`: the dequantizing GEMM of GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K) kept in their codes and per-group scales, the layout of
`braid.kernels.gguf_reference.KernelPlanes`: W[n, k] = (code[n, k] - zero) * scale[g, n] +
offset[g, n], g = k // G (G = 32, or 16 for Q6_K), codes 4-bit packed eight a word or 8-bit
one a byte; the K-quants' scale and offset an integer per group times a float16 per
super-block of 256, as in the file. Every weight is the file's, exact in float32, so the
product is the dequantized model's up to the order of float32 sums.

Three paths by rows:

- **one row** (a batch-1 decode step; `_gguf_gemv_kernel`): each program owns BLOCK_N outputs
  and one split of K (SPLIT_K programs along K, reduced by `gemv_split._finish`: one launch,
  the same bits whatever order the programs ran in), walking it in tiles of BW words of codes
  per output (eight 4-bit codes a word, or four 8-bit ones: the 8-bit codes are read as
  words too). Code j of every word of the tile is one plane: inputs 8 w + j (or 4 w + j), so
  each plane multiplies a strided slice of x, and no tile is reshaped. A code becomes a float
  by OR'ing its bits into the mantissa of a float of fixed exponent and subtracting that float
  (one LOP3 and one FADD, exact); one FFMA multiplies it in. Each word's sum is scaled once
  (the group's scale, a gather of the [K / G, N] plane) and the offset term is the group's
  offset times the word's sum of x; the sum is float32, rounded once to x's dtype after the
  bias. Launch shapes are autotuned per (N, K, G, code width, offset or not) over
  `GEMV_SHAPES` on CUDA; the splits' scratch is `quant_gemv.GemvWorkspace`'s.
- **more rows** (`_gguf_kernel`): each program owns BLOCK_M rows, BLOCK_N outputs and one split
  of K, and walks it in tiles of BLOCK_K codes: the tile's weights made as `dequantize_gguf`
  makes them (code * scale + offset, exact in float32, rounded once to x's dtype;
  `_tile_weights`: 4-bit codes as [BLOCK_N, words, 8] nibbles with each word's scale, 8-bit
  ones as [BLOCK_N, groups, G] bytes with each group's, one reshape; in blocks of 16 rows
  Q4_0 and Q4_1 load each group's factors once and spread them to its words, 4-8% faster
  there on an H100, and no faster at more rows or with super-blocks), then one `tl.dot` with
  x (or, SWAP, of the weights on the left with x's rows on the right, the accumulator
  transposed once at the end), summed in float32. Up to 16 rows K may be split, so that
  small layers fill the GPU (the splits' sums: `gemv_split._sum_splits`). Autotuned per (N,
  K, G, code width, offset or not, row class); timings in docs/benchmarks.md.
- **many rows** (from `quant_planar.DEQUANTIZE_MIN_ROWS`, as the int4 layers do): compute-bound,
  so one pass writes the weight out in x's dtype (`dequantize_gguf`: each weight exact in
  float32, rounded once to bfloat16 or float16) and cuBLAS multiplies (accumulating as it
  does for a float layer).

Under TRITON_INTERPRET=1 one small fixed configuration of each runs instead (K split in two
in both, so the CPU tests cover the split-K reductions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import FLOAT_DTYPES, check_tensor, dot_precision
from braid.kernels.gemv_split import _finish, _sum_splits
from braid.kernels.gguf_reference import SUPER_BLOCK, KernelPlanes, gguf_linear_reference
from braid.kernels.quant_gemm import MAGIC_BITS, _bench, _check_common, _row_class
from braid.kernels.quant_gemv import GemvWorkspace
from braid.kernels.quant_planar import DEQUANTIZE_MIN_ROWS

__all__ = ["dequantize_gguf", "gguf_linear", "gguf_linear_reference"]


@triton.jit
def _codes(Q, offs_n, mask_n, k0, K, BITS: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
           BK: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BK] float32 codes less ZERO of the columns k0..k0 + BK (-ZERO past K),
    exactly."""
    if BITS == 4:
        offs_w = k0 // 8 + tl.arange(0, BK // 8)
        rows = Q + offs_n.to(tl.int64)[:, None] * (K // 8)
        mask = mask_n[:, None] & (offs_w < K // 8)[None, :]
        words = tl.load(rows + offs_w[None, :], mask=mask, other=0)
        shifts = tl.arange(0, 8) * 4
        nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        bits = tl.reshape(nib | 0x4B400000, (BLOCK_N, BK))
    else:
        offs_k = k0 + tl.arange(0, BK)
        rows = Q + offs_n.to(tl.int64)[:, None] * K
        mask = mask_n[:, None] & (offs_k < K)[None, :]
        c = tl.load(rows + offs_k[None, :], mask=mask, other=0)
        bits = c.to(tl.int32) + 0x4B400000
    return bits.to(tl.float32, bitcast=True) - (12582912.0 + ZERO)


@triton.jit
def _word_plane(words, hi, J: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
                ZERO: tl.constexpr, magic):  # fmt: skip
    """Code J of each int32 word (BITS 4: nibble J of eight; 8: byte J of four, signed or not)
    as float32, exactly. Codes in the lower half word are read from `words`, the others from
    `hi` (the word shifted down 16 bits), each left in place at bit SH < 16: OR'ed into the
    mantissa of 1.5 * 2**(23 - SH) (`magic`, the bits of 1.5 * 2**23, with SH off its
    exponent) the code adds to that float, which is then subtracted with the zero point ZERO
    (the code less ZERO comes out). A signed byte has its top bit flipped first (b + 128) and
    128 more subtracted."""
    HALF: tl.constexpr = 16 // BITS
    SH: tl.constexpr = BITS * (J % HALF)
    MASK: tl.constexpr = ((1 << BITS) - 1) << SH
    if J < HALF:
        src = words
    else:
        src = hi
    if SIGNED:
        src = src ^ (0x80 << SH)
    bits = (src & MASK) | (magic - (SH << 23))
    base = 12582912.0 / (2.0**SH) + ZERO
    if SIGNED:
        base = base + 128.0
    return bits.to(tl.float32, bitcast=True) - base


@triton.jit
def _super_block(code0, G: tl.constexpr, SUB: tl.constexpr, TILE: tl.constexpr):
    """The super-block of a tile of TILE codes from code `code0` (0 without super-blocks);
    the tile must lie within one."""
    if SUB > 0:
        tl.static_assert((SUB * G) % TILE == 0)
        si = code0 // (SUB * G)
    else:
        si = 0
    return si


@triton.jit
def _tile_factor(Plane, Super, gi, si, offs_n, mask, mask_n, N, SUB: tl.constexpr):
    """The float32 scales (or offsets) [BLOCK_N, groups] of groups `gi` [1, groups] of outputs
    `offs_n`: the plane's values, times, where SUB (groups a super-block) is not 0, the
    factor of super-block `si` (a K-quant's integer times its float16 d: exact). A tile lies
    within one super-block (the kernels' tiles divide its codes and start at multiples of
    their size), so its factors are loaded once a tile, not once a group. The integers are
    converted as they are: through the bits of 1.5 * 2**23 (as the codes are) the several-row
    kernel took 6-23% longer at 16-64 rows of Q4_K and Q6_K on an H100 (docs/benchmarks.md)."""
    f = tl.load(Plane + gi * N + offs_n[:, None], mask=mask, other=0).to(tl.float32)
    if SUB > 0:
        f *= tl.load(Super + si * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    return f


@triton.jit
def _spread(f, BLOCK_N: tl.constexpr, GR: tl.constexpr, WPG: tl.constexpr):
    """[BLOCK_N, GR] group factors as [BLOCK_N, GR * WPG], each repeated for its words."""
    return tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK_N, GR, WPG)), (BLOCK_N, GR * WPG))


@triton.jit
def _tile_weights(Q, e0, end, offs_n, mask_n, Scale, Offset, SuperScale, SuperOffset, N, KQ,
                  G: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr,
                  HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPREAD: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] float32 weights (code - ZERO) * scale + offset (exact) of the codes
    from element e0 of each row of Q (0 from `end` on). Codes become floats through the bits
    of 1.5 * 2**23 with the code in the mantissa, less that float and ZERO. 4-bit: [BLOCK_N,
    words, 8] nibbles of the words, each word's scale (SPREAD: each group's factors loaded
    once and repeated for its G / 8 words, which BLOCK_K, a multiple of G, allows); 8-bit:
    [BLOCK_N, BLOCK_K] bytes (a signed byte sign-extends into the sum) as [BLOCK_N, groups,
    G], each group's scale (a 3-D load of the bytes ran 1.3-1.5x slower on an H100). One
    reshape merges the last two."""
    row0 = offs_n.to(tl.int64) * KQ
    if BITS == 4:
        ws = e0 + tl.arange(0, BLOCK_K // 8)
        wmask = mask_n[:, None] & (ws < end)[None, :]
        words = tl.load(Q + row0[:, None] + ws[None, :], mask=wmask, other=0)
        shifts = tl.arange(0, 8) * 4
        bits = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) | 0x4B400000
        if SPREAD:
            GR: tl.constexpr = BLOCK_K // G
            gs = tl.arange(0, GR)
            gi = (e0 // (G // 8) + gs)[None, :]
            fmask = mask_n[:, None] & (e0 + gs * (G // 8) < end)[None, :]
        else:
            gi = (ws // (G // 8))[None, :]
            fmask = wmask
    else:
        offs_k = e0 + tl.arange(0, BLOCK_K)
        cmask = mask_n[:, None] & (offs_k < end)[None, :]
        c = tl.load(Q + row0[:, None] + offs_k[None, :], mask=cmask, other=0)
        bits = tl.reshape(c.to(tl.int32) + 0x4B400000, (BLOCK_N, BLOCK_K // G, G))
        gs = tl.arange(0, BLOCK_K // G)
        wmask = mask_n[:, None] & (e0 + gs * G < end)[None, :]
        gi = (e0 // G + gs)[None, :]
        fmask = wmask
    PER: tl.constexpr = 8 if BITS == 4 else 1
    si = _super_block(e0 * PER, G, SUB, BLOCK_K)
    scale = _tile_factor(Scale, SuperScale, gi, si, offs_n, fmask, mask_n, N, SUB)
    if SPREAD:
        scale = _spread(scale, BLOCK_N, BLOCK_K // G, G // 8)
    w = (bits.to(tl.float32, bitcast=True) - (12582912.0 + ZERO)) * scale[:, :, None]
    if HAS_OFFSET:
        off = _tile_factor(Offset, SuperOffset, gi, si, offs_n, fmask, mask_n, N, SUB)
        if SPREAD:
            off = _spread(off, BLOCK_N, BLOCK_K // G, G // 8)
        w += off[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _tile_operands(x_rows, Q, e0, end, offs_n, mask_n, mask_m, ki, Scale, Offset, SuperScale,
                   SuperOffset, N, KQ, G: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr,
                   ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPREAD: tl.constexpr):  # fmt: skip
    """The dot's operands for the tile from element e0 of Q: the weights (`_tile_weights`) in
    x's dtype, and x's [BLOCK_M, BLOCK_K] slice they meet (0 past `end`)."""
    w = _tile_weights(
        Q, e0, end, offs_n, mask_n, Scale, Offset, SuperScale, SuperOffset, N, KQ, G, SUB, BITS,
        ZERO, HAS_OFFSET, BLOCK_N, BLOCK_K, SPREAD,
    )  # fmt: skip
    PER: tl.constexpr = 8 if BITS == 4 else 1
    xmask = mask_m[:, None] & (e0 * PER + ki < end * PER)[None, :]
    x = tl.load(x_rows + e0 * PER, mask=xmask, other=0.0)
    return w.to(x.dtype), x


@triton.jit(do_not_specialize=["M"])
def _gguf_kernel(
    X,
    Q,
    Scale,
    Offset,
    SuperScale,
    SuperOffset,
    Bias,
    Out,
    Partials,
    Counters,
    M,
    N,
    KQ,
    stride_xm,
    stride_om,
    G: tl.constexpr,
    SUB: tl.constexpr,
    BITS: tl.constexpr,
    ZERO: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    SWAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    PER: tl.constexpr = 8 if BITS == 4 else 1  # codes an element of Q
    BE: tl.constexpr = BLOCK_K // PER  # elements of Q a tile
    SPREAD: tl.constexpr = BITS == 4 and SUB == 0 and BLOCK_M == 16
    n_block, m_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ki = tl.arange(0, BLOCK_K)
    x_rows = X + offs_m[:, None] * stride_xm + ki[None, :]
    split_len = tl.cdiv(tl.cdiv(KQ, SPLIT_K), BE) * BE
    first = split * split_len
    end = tl.minimum(first + split_len, KQ)
    if SWAP:
        # The weights as the dot's left operand, [BLOCK_N, BLOCK_K] (made in registers, where
        # Hopper's wgmma reads its left operand), x's rows on the right.
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for e0 in tl.range(first, end, BE, num_stages=STAGES):
            w, x = _tile_operands(
                x_rows, Q, e0, end, offs_n, mask_n, mask_m, ki, Scale, Offset, SuperScale,
                SuperOffset, N, KQ, G, SUB, BITS, ZERO, HAS_OFFSET, BLOCK_N, BLOCK_K, SPREAD,
            )  # fmt: skip
            acc_t += tl.dot(w, tl.trans(x), input_precision=DOT_PREC)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for e0 in tl.range(first, end, BE, num_stages=STAGES):
            w, x = _tile_operands(
                x_rows, Q, e0, end, offs_n, mask_n, mask_m, ki, Scale, Offset, SuperScale,
                SuperOffset, N, KQ, G, SUB, BITS, ZERO, HAS_OFFSET, BLOCK_N, BLOCK_K, SPREAD,
            )  # fmt: skip
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    flat = offs_m[:, None] * N + offs_n[None, :]
    tile = m_block * tl.num_programs(0) + n_block
    acc, last = _sum_splits(acc, tile, split, flat, mask, Partials, Counters, M * N, SPLIT_K)
    if last:
        out = Out + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K codes, SPLIT_K, num_warps, num_stages, SWAP) per row class of the
# several-row kernel: tiles of several groups, so each step reads enough codes to keep the
# loads in flight; BLOCK_N down to 16 and K split (up to 16 rows, which bounds the scratch:
# `MAX_SPLIT_ROWS`) so that N = 4096 still makes enough programs for 132 SMs; SWAP puts the
# weights on the dot's left (on an H100 the 4-bit types' pick at 4-16 rows, 10-15% faster).
SHAPES = {
    16: [
        (16, 32, 256, 1, 4, 3, 0),
        (16, 64, 128, 1, 4, 4, 0),
        (16, 32, 256, 2, 4, 3, 0),
        (16, 64, 256, 2, 4, 3, 0),
        (16, 16, 256, 2, 4, 3, 0),
        (16, 32, 128, 4, 4, 4, 0),
        (16, 64, 128, 2, 4, 3, 1),
        (16, 64, 256, 2, 4, 3, 1),
        (16, 64, 128, 4, 4, 3, 1),
        (16, 128, 128, 2, 4, 3, 1),
        (16, 128, 128, 1, 8, 3, 1),
    ],
    64: [
        (64, 64, 128, 1, 4, 3, 0),
        (64, 32, 128, 1, 4, 3, 0),
        (32, 32, 128, 1, 4, 3, 0),
        (32, 64, 256, 1, 4, 3, 0),
        (64, 64, 128, 1, 4, 3, 1),
        (32, 64, 128, 1, 4, 3, 1),
        (64, 128, 128, 1, 8, 3, 1),
    ],
    128: [
        (64, 32, 128, 1, 4, 3, 0),
        (64, 64, 128, 1, 4, 3, 0),
        (128, 64, 64, 1, 8, 3, 0),
        (64, 128, 64, 1, 8, 3, 0),
    ],
}


def _config(
    bm: int, bn: int, bk: int, split: int, warps: int, stages: int, swap: int
) -> triton.Config:
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "STAGES": stages}
    meta["SWAP"] = bool(swap)
    return triton.Config(meta, num_warps=warps, num_stages=1)


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The configurations of the call's row class."""
    return [_config(*c) for c in SHAPES[kwargs["ROWS"]]]


@triton.jit
def _gguf_gemv_kernel(
    X,
    Q,
    Scale,
    Offset,
    SuperScale,
    SuperOffset,
    Bias,
    Out,
    Partials,
    Counters,
    N,
    KW,
    magic,
    G: tl.constexpr,
    SUB: tl.constexpr,
    BITS: tl.constexpr,
    SIGNED: tl.constexpr,
    ZERO: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BW: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS  # codes a word
    WPG: tl.constexpr = G // PER  # words a group
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    wi = tl.arange(0, BW)
    q_rows = Q + rows.to(tl.int64)[:, None] * KW + wi[None, :]
    split_words = tl.cdiv(tl.cdiv(KW, SPLIT_K), BW) * BW
    first = split * split_words
    end = tl.minimum(first + split_words, KW)
    acc = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
    for w0 in tl.range(first, end, BW, num_stages=STAGES):
        ws = w0 + wi
        wmask = rmask[:, None] & (ws < end)[None, :]
        words = tl.load(q_rows + w0, mask=wmask, other=0)
        hi = words >> 16
        part = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        xsum = tl.zeros([BW], dtype=tl.float32)
        for j in tl.static_range(PER):
            x = tl.load(X + ws * PER + j, mask=ws < end, other=0.0).to(tl.float32)
            part += _word_plane(words, hi, j, BITS, SIGNED, ZERO, magic) * x[None, :]
            if HAS_OFFSET:
                xsum += x
        gi = (ws // WPG)[None, :]
        si = _super_block(w0 * PER, G, SUB, BW * PER)
        acc += part * _tile_factor(Scale, SuperScale, gi, si, rows, wmask, rmask, N, SUB)
        if HAS_OFFSET:
            offset = _tile_factor(Offset, SuperOffset, gi, si, rows, wmask, rmask, N, SUB)
            acc += offset * xsum[None, :]
    _finish(
        tl.sum(acc, axis=1), block, split, rows, rmask, Out, Bias, Bias, 1.0, Partials, Counters, N,
        SPLIT_K, HAS_BIAS, False,
    )  # fmt: skip


@triton.jit
def _dequantize_kernel(
    Q, Scale, Offset, SuperScale, SuperOffset, Out, N, K, G: tl.constexpr, SUB: tl.constexpr,
    BITS: tl.constexpr, ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k0 = tl.program_id(1) * BLOCK_K
    c = _codes(Q, offs_n, mask_n, k0, K, BITS, ZERO, BLOCK_N, BLOCK_K)
    GROUPS: tl.constexpr = BLOCK_K // G
    offs_g = k0 // G + tl.arange(0, GROUPS)
    gmask = mask_n[:, None] & (offs_g < K // G)[None, :]
    gi = offs_g[None, :]
    si = _super_block(k0, G, SUB, BLOCK_K)
    scale = _tile_factor(Scale, SuperScale, gi, si, offs_n, gmask, mask_n, N, SUB)
    w = tl.reshape(c, (BLOCK_N, GROUPS, G)) * scale[:, :, None]
    if HAS_OFFSET:
        w += _tile_factor(Offset, SuperOffset, gi, si, offs_n, gmask, mask_n, N, SUB)[:, :, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out = Out + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    tl.store(out, tl.reshape(w, (BLOCK_N, BLOCK_K)).to(Out.dtype.element_ty), mask=mask)


def _planes(planes: KernelPlanes) -> tuple[list[torch.Tensor], dict]:
    """The kernels' plane arguments (Scale, Offset, SuperScale, SuperOffset; the scale plane
    in the place of those absent) and the constexprs that say which are real."""
    p = planes
    args = [p.scale] + [t if t is not None else p.scale for t in (p.offset, p.super_scale)]
    args.append(p.super_offset if p.super_offset is not None else p.scale)
    sub = SUPER_BLOCK // p.group_size if p.super_scale is not None else 0
    meta = {"G": p.group_size, "SUB": sub, "BITS": p.bits, "ZERO": p.zero}
    return args, meta | {"HAS_OFFSET": p.offset is not None}


def dequantize_gguf(planes: KernelPlanes, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight `planes` hold as [N, k] in `dtype`: (code - zero) * scale + offset, exact in
    float32, rounded once to `dtype` (a rounding of each weight for bfloat16 and float16)."""
    n = planes.codes.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=planes.codes.device)
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    args, meta = _planes(planes)
    _dequantize_kernel[grid](
        planes.codes, *args, out, n, k, **meta, BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


# One-row launch shapes: (BLOCK_N, words per row a tile, SPLIT_K, num_warps, num_stages).
# Starting points the first GPU run measures (benchmarks/gguf_gpu.py prints the pick per
# shape): tiles of 8-32 KB of codes, K split until the small layers fill the GPU.
GEMV_SHAPES = [
    (64, 16, 1, 4, 3),
    (64, 16, 4, 4, 3),
    (128, 16, 2, 4, 3),
    (128, 16, 4, 4, 2),
    (128, 32, 4, 8, 2),
    (64, 32, 8, 4, 2),
    (256, 16, 8, 8, 2),
    (32, 32, 4, 4, 3),
]
INTERPRET_GEMV = {"BLOCK_N": 16, "BW": 4, "SPLIT_K": 2, "STAGES": 1}
# Several rows under the interpreter: tiles of 64 codes, K split in two, so at K = 96 the
# second split is half a tile.
# (The tests set SWAP to run the other operand order.)
INTERPRET_ROWS = {
    "BLOCK_M": 16,
    "BLOCK_N": 16,
    "BLOCK_K": 64,
    "SPLIT_K": 2,
    "STAGES": 1,
    "SWAP": False,
}
# The several-row kernel's largest split per row class (its scratch: split x M x N partials).
MAX_SPLIT_ROWS = {rows: max(c[3] for c in shapes) for rows, shapes in SHAPES.items()}
# The scratch every launch shape fits: partials of the largest split, a counter for each row
# block of the smallest.
MAX_SPLIT = max(max(c[2] for c in GEMV_SHAPES), INTERPRET_GEMV["SPLIT_K"])
MIN_BLOCK_N = min(min(c[0] for c in GEMV_SHAPES), INTERPRET_GEMV["BLOCK_N"])


def _gemv_config(bn: int, bw: int, split: int, warps: int, stages: int) -> triton.Config:
    meta = {"BLOCK_N": bn, "BW": bw, "SPLIT_K": split, "STAGES": stages}
    return triton.Config(meta, num_warps=warps, num_stages=1)


if triton.knobs.runtime.interpret:
    _kernel, _gemv = _gguf_kernel, _gguf_gemv_kernel
else:
    _kernel = triton.autotune(
        [_config(*c) for c in SHAPES[16]],
        key=["N", "KQ", "G", "BITS", "HAS_OFFSET", "ROWS"],
        prune_configs_by={"early_config_prune": _prune},
        do_bench=_bench,
        cache_results=True,
    )(_gguf_kernel)
    _gemv = triton.autotune(
        [_gemv_config(*c) for c in GEMV_SHAPES],
        key=["N", "KW", "G", "BITS", "HAS_OFFSET"],
        do_bench=_bench,
        cache_results=True,
    )(_gguf_gemv_kernel)


def gguf_linear(
    x: torch.Tensor,
    planes: KernelPlanes,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for the GGUF weight `planes` hold (`KernelPlanes`), summed in float32
    and rounded once to x's dtype after the bias. From two rows the weight is first rounded to
    x's dtype (exact for float32); from `DEQUANTIZE_MIN_ROWS` rows it is written out so and
    cuBLAS multiplies, accumulating as it does for a float layer.

    `x`: [M, K] float, M >= 1, unit stride in K; `planes.codes`: contiguous int32 [N, K / 8]
    (bits 4) or int8 / uint8 [N, K] (bits 8); `planes.scale` (and `planes.offset`, or None):
    contiguous float16 [K / G, N], or with `planes.super_scale` (and `planes.super_offset`:
    contiguous float16 [K / 256, N], K a multiple of 256) int8 / uint8 [K / G, N]; G 16 or
    32 dividing K (`KernelPlanes.check`); `bias`: contiguous [N] of x's dtype, or None;
    `out`: [M, N] of x's dtype with unit stride in N (else a new tensor). All on x's
    device. Float32 x multiplies in full precision (no TF32). Never synchronises with the
    host once (N, K, G, bits, row class) has run once on CUDA.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if m < 1:
        raise ValueError(f"x must have at least one row, got shape {tuple(x.shape)}")
    n = planes.check(k, x.device)
    bits, codes = planes.bits, planes.codes
    m, out = _check_common(x, n, bias, out)
    bias_arg = bias if bias is not None else planes.scale
    if m == 1:
        # The splits' scratch, room for any launch shape the autotuner may pick; its counters
        # return to zero after every launch.
        partials, counters = GemvWorkspace.for_device(x.device).take(
            MAX_SPLIT * n, triton.cdiv(n, MIN_BLOCK_N)
        )
        words = codes.view(torch.int32) if bits == 8 else codes
        fixed = INTERPRET_GEMV if triton.knobs.runtime.interpret else {}
        grid1 = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
        args, meta = _planes(planes)
        _gemv[grid1](
            x, words, *args, bias_arg, out, partials, counters, n, words.shape[1], MAGIC_BITS,
            SIGNED=codes.dtype == torch.int8, HAS_BIAS=bias is not None, **meta, **fixed,
        )  # fmt: skip
        return out
    if m >= DEQUANTIZE_MIN_ROWS:
        # Compute-bound: a pass over the weight into x's dtype, then cuBLAS.
        weight = dequantize_gguf(planes, k, x.dtype)
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    fixed = INTERPRET_ROWS if triton.knobs.runtime.interpret else {}
    _launch_rows(_kernel, x, planes, bias, out, fixed)
    return out


def _launch_rows(kernel, x, planes: KernelPlanes, bias, out, meta: dict) -> None:
    """The several-row launch: the autotuned `_kernel` (`meta` empty), or `_gguf_kernel` with
    one launch shape's values in `meta` (the interpreter's; the GPU test of every shape)."""
    m, n = x.shape[0], out.shape[1]
    bias_arg = bias if bias is not None else planes.scale
    rows = _row_class(m)
    split = meta.get("SPLIT_K", MAX_SPLIT_ROWS[rows])
    # Scratch by N and the row class alone, so it never grows with M within a class: the
    # partials of `rows` rows, a counter per 16 x 16 block (every launch shape's tiles are at
    # least that).
    partials, counters = GemvWorkspace.for_device(x.device).take(
        split * rows * n if split > 1 else 1,
        triton.cdiv(rows, 16) * triton.cdiv(n, 16) if split > 1 else 1,
    )
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(n, meta["BLOCK_N"]),
        triton.cdiv(m, meta["BLOCK_M"]),
        meta["SPLIT_K"],
    )
    codes = planes.codes
    args, plane_meta = _planes(planes)
    kernel[grid](
        x, codes, *args, bias_arg, out, partials, counters, m, n, codes.shape[1], x.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, ROWS=rows, DOT_PREC=dot_precision(x.dtype),
        **plane_meta, **meta,
    )  # fmt: skip
