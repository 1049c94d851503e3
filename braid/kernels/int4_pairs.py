"""The float16-pair arithmetic of the packed int4 GEMV (`int4_gemv`'s module docstring has
the scheme): one 32-bit word of the planar layout times four pairs of inputs in packed
halves (`_word`, through inline PTX; the interpreter's path does the same float16 arithmetic
lane by lane), the inputs of one 128-input block scaled and packed into those pairs
(`_block_inputs`), and the same inputs packed ahead of the GEMV (`pack_int4_inputs`), so a
GEMV can load them as words instead of making them in every program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import check_contiguous, check_tensor
from braid.kernels.norm import norm_warps
from braid.kernels.prologue import _check_norm_args, _check_prologue, _input
from braid.kernels.quant_reference import PLANAR_BLOCK
from braid.kernels.skinny_gemm import NORM_BLOCK_MAX, _rmsnorm_rstd

# Words of one block's packed inputs: the even and odd halves of the pairs (x0, x4), (x1,
# x5), (x2, x6), (x3, x7) of its eight 16-input planes, 8 words each.
PACKED_WORDS = 64


# One word's four float16 pairs (planes (0,4), (1,5), (2,6), (3,7)) less the zero, times the
# inputs, added to `acc`: $0 = acc out, $1 = word, $2..$5 = input pairs, $6 = acc in,
# $7 / $8 = (1024 + zero) / (1024 + 16 zero) in both halves. LUT 0xEA is (a & b) | c.
_WORD_PTX = tl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3, w; "
    "lop3.b32 t0, $1, 0x000f000f, 0x64006400, 0xea; "
    "lop3.b32 t1, $1, 0x00f000f0, 0x64006400, 0xea; "
    "shr.u32 w, $1, 8; "
    "lop3.b32 t2, w, 0x000f000f, 0x64006400, 0xea; "
    "lop3.b32 t3, w, 0x00f000f0, 0x64006400, 0xea; "
    "sub.f16x2 t0, t0, $7; sub.f16x2 t1, t1, $8; sub.f16x2 t2, t2, $7; sub.f16x2 t3, t3, $8; "
    "fma.rn.f16x2 $0, t0, $2, $6; fma.rn.f16x2 $0, t1, $3, $0; "
    "fma.rn.f16x2 $0, t2, $4, $0; fma.rn.f16x2 $0, t3, $5, $0; }"
)


# The same for codes read as float16 subnormals (`ZERO_LAST`): the nibbles masked in place are
# q * 2**-24 (bits 0-3 of a half) and 16 q * 2**-24 (bits 4-7) exactly, with no offset to remove;
# the zero is applied once per group after the sums. $0 = acc out, $1 = word, $2..$5 = input
# pairs, $6 = acc in.
_WORD_PTX_SUBNORMAL = tl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3, w; "
    "and.b32 t0, $1, 0x000f000f; and.b32 t1, $1, 0x00f000f0; shr.u32 w, $1, 8; "
    "and.b32 t2, w, 0x000f000f; and.b32 t3, w, 0x00f000f0; "
    "fma.rn.f16x2 $0, t0, $2, $6; fma.rn.f16x2 $0, t1, $3, $0; "
    "fma.rn.f16x2 $0, t2, $4, $0; fma.rn.f16x2 $0, t3, $5, $0; }"
)


@triton.jit
def _half(bits, SHIFT: tl.constexpr):
    """The float16 in bits SHIFT..SHIFT+15 of int32 `bits` (the interpreter's path)."""
    return ((bits >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _pack(lo, hi, PTX: tl.constexpr):
    """float32 `lo`, `hi` rounded to float16 and packed: lo in bits 0-15, hi in 16-31."""
    if PTX:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (hi_bits << 16) | lo_bits


@triton.jit
def _word(acc, w, xa, xb, xc, xd, zlo, zhi, PTX: tl.constexpr, ZERO_LAST: tl.constexpr):
    """`_WORD_PTX` (`_WORD_PTX_SUBNORMAL` with ZERO_LAST: `zlo`, `zhi` unused) on packed pairs;
    else its float16 arithmetic lane by lane (mul then add: two roundings where fma.rn has
    one) on unpacked lanes, returned as (low, high) sums."""
    if PTX:
        if ZERO_LAST:
            return tl.inline_asm_elementwise(
                _WORD_PTX_SUBNORMAL, "=r,r,r,r,r,r,r", [w, xa, xb, xc, xd, acc],
                dtype=tl.int32, is_pure=True, pack=1,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            _WORD_PTX, "=r,r,r,r,r,r,r,r,r", [w, xa, xb, xc, xd, acc, zlo, zhi],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        lo, hi = acc
        magic = 0 if ZERO_LAST else 0x64006400
        t0 = (w & 0x000F000F) | magic
        t1 = (w & 0x00F000F0) | magic
        t2 = ((w >> 8) & 0x000F000F) | magic
        t3 = ((w >> 8) & 0x00F000F0) | magic
        for t, x, z in ((t0, xa, zlo), (t1, xb, zhi), (t2, xc, zlo), (t3, xd, zhi)):
            if ZERO_LAST:
                lo = _half(t, 0) * _half(x, 0) + lo
                hi = _half(t, 16) * _half(x, 16) + hi
            else:
                lo = (_half(t, 0) - _half(z, 0)) * _half(x, 0) + lo
                hi = (_half(t, 16) - _half(z, 16)) * _half(x, 16) + hi
        return lo, hi


@triton.jit
def _words_sum(we, wo, xe, xo, zlo, zhi, PTX: tl.constexpr, ZERO_LAST: tl.constexpr):
    """Two words' 16 products (even word `we` with inputs `xe`, odd `wo` with `xo`), summed
    in float16 per half, then the halves in float32."""
    if PTX:
        acc = _word(we * 0, we, xe[0], xe[1], xe[2], xe[3], zlo, zhi, PTX, ZERO_LAST)
        acc = _word(acc, wo, xo[0], xo[1], xo[2], xo[3], zlo, zhi, PTX, ZERO_LAST)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; "
            "cvt.f32.f16 b, h; add.f32 $0, a, b; }",
            "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        zero = tl.zeros(we.shape, dtype=tl.float16)
        acc = _word((zero, zero), we, xe[0], xe[1], xe[2], xe[3], zlo, zhi, PTX, ZERO_LAST)
        lo, hi = _word(acc, wo, xo[0], xo[1], xo[2], xo[3], zlo, zhi, PTX, ZERO_LAST)
        return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _even_odd(v):
    """A [16] vector split into its even and odd elements ([8] each)."""
    return tl.split(tl.reshape(v, [8, 2]))


@triton.jit
def _block_inputs(X, NormW, Residual, b, xmask, rstd, K, ACT: tl.constexpr,
                  NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PTX: tl.constexpr,
                  ZERO_LAST: tl.constexpr):  # fmt: skip
    """The inputs of 128-input block `b` as the packed GEMV multiplies them: (ae, ao, be, bo,
    ce, co, de, do), the even and odd words of the float16 pairs (x0, x4) * f, (x1, x5) * f /
    16, (x2, x6) * f, (x3, x7) * f / 16 (x_p the block's inputs 16p..16p + 15), where the
    power of two f puts the block's largest |x| in [128, 256) (ZERO_LAST: [2**14, 2**15));
    g = 1 / f; and (ZERO_LAST) the block's sum of inputs, else 0."""
    ks = b * 128 + tl.arange(0, 16)
    x0 = _input(X, NormW, Residual, ks, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x1 = _input(X, NormW, Residual, ks + 16, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x2 = _input(X, NormW, Residual, ks + 32, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x3 = _input(X, NormW, Residual, ks + 48, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x4 = _input(X, NormW, Residual, ks + 64, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x5 = _input(X, NormW, Residual, ks + 80, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x6 = _input(X, NormW, Residual, ks + 96, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    x7 = _input(X, NormW, Residual, ks + 112, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL)
    m = tl.maximum(
        tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
        tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))),
    )
    # The block's largest |x| is 2**(e - 127) times [1, 2); f = 2**(134 - e) puts it in
    # [128, 256) (ZERO_LAST: f = 2**(141 - e), [2**14, 2**15)); the odd planes' inputs
    # take f / 16; g = 1 / f undoes it.
    e = tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23
    if ZERO_LAST:
        e = tl.minimum(tl.maximum(e, 15), 254)
        f = ((268 - e) << 23).to(tl.float32, bitcast=True)
        f_odd = ((264 - e) << 23).to(tl.float32, bitcast=True)
        g = ((e - 14) << 23).to(tl.float32, bitcast=True)
        xsum = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, axis=0)
    else:
        e = tl.minimum(tl.maximum(e, 8), 254)
        f = ((261 - e) << 23).to(tl.float32, bitcast=True)
        f_odd = ((257 - e) << 23).to(tl.float32, bitcast=True)
        g = ((e - 7) << 23).to(tl.float32, bitcast=True)
        xsum = g * 0.0
    ae, ao = _even_odd(_pack(x0 * f, x4 * f, PTX))
    be, bo = _even_odd(_pack(x1 * f_odd, x5 * f_odd, PTX))
    ce, co = _even_odd(_pack(x2 * f, x6 * f, PTX))
    de, do = _even_odd(_pack(x3 * f_odd, x7 * f_odd, PTX))
    return ae, ao, be, bo, ce, co, de, do, g, xsum


@triton.jit
def _packed_block_inputs(XP, XG, b, end):
    """`_block_inputs`' results for block `b` read back from `pack_int4_inputs`' buffers
    (zeros from block `end` on)."""
    w8 = tl.arange(0, 8)
    mask = (w8 * 0 + b) < end
    ok = b < end
    base = XP + b * 64 + w8
    ae = tl.load(base, mask=mask, other=0)
    ao = tl.load(base + 8, mask=mask, other=0)
    be = tl.load(base + 16, mask=mask, other=0)
    bo = tl.load(base + 24, mask=mask, other=0)
    ce = tl.load(base + 32, mask=mask, other=0)
    co = tl.load(base + 40, mask=mask, other=0)
    de = tl.load(base + 48, mask=mask, other=0)
    do = tl.load(base + 56, mask=mask, other=0)
    g = tl.load(XG + 2 * b, mask=ok, other=0.0)
    xsum = tl.load(XG + 2 * b + 1, mask=ok, other=0.0)
    return ae, ao, be, bo, ce, co, de, do, g, xsum


@triton.jit
def _pack_inputs_kernel(X, NormW, Residual, ResidualOut, eps, XP, XG, K, PTX: tl.constexpr,
                        ZERO_LAST: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr,
                        TRIGGER: tl.constexpr):  # fmt: skip
    pdl.trigger(TRIGGER)  # the GEMV after may start loading its weights (`pdl`)
    b = tl.program_id(0)
    xmask = tl.arange(0, 16) >= 0
    rstd = 1.0
    if NORM:
        rstd = _rmsnorm_rstd(X, Residual, ResidualOut, K, eps, HAS_RESIDUAL, NORM_BLOCK)
    ae, ao, be, bo, ce, co, de, do, g, xsum = _block_inputs(
        X, NormW, Residual, b, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL, PTX, ZERO_LAST
    )
    base = XP + b * 64 + tl.arange(0, 8)
    tl.store(base, ae)
    tl.store(base + 8, ao)
    tl.store(base + 16, be)
    tl.store(base + 24, bo)
    tl.store(base + 32, ce)
    tl.store(base + 40, co)
    tl.store(base + 48, de)
    tl.store(base + 56, do)
    tl.store(XG + 2 * b, g)
    tl.store(XG + 2 * b + 1, xsum)


@dataclass(frozen=True)
class PackedInputs:
    """One row's inputs packed for the int4 GEMV (`pack_int4_inputs`): `words` int32 [K / 128,
    64], `scales` float32 [K / 128, 2] (each block's g and its sum of inputs), for the
    GEMV's packed form `form` (`GemvConfig.packed`: 1 or 2, whose scalings differ)."""

    words: torch.Tensor
    scales: torch.Tensor
    form: int


def pack_int4_inputs(
    x: torch.Tensor,
    form: int,
    *,
    activation: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> PackedInputs:
    """x [1, K] (bfloat16 or float16, K a multiple of 128) packed as the int4 GEMV's packed
    form `form` packs it in each program (`_block_inputs`), bit for bit; `int4_gemv`'s
    `packed_inputs` then loads these words instead.

    Or what the kernel before would store, packed in its place (one launch for the two), with
    `int4_gemv`'s prologues: `activation="silu_and_mul"` packs `silu_and_mul(x)` of x = [gate
    | up] [1, 2K]; `norm_weight` packs `rmsnorm(x, norm_weight, eps, residual)`'s first
    result, and `residual_out` receives its second (the same bits where K <= 4096, as
    `per_token_quant_fp8`'s)."""
    check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    check_contiguous("x", x)
    _check_prologue(activation, norm_weight)
    k = x.shape[1] // 2 if activation is not None else x.shape[1]
    if x.shape[0] != 1 or k % PLANAR_BLOCK or x.shape[1] != (2 * k if activation else k):
        shape = "(1, 2 * K) ([gate | up])" if activation else "(1, K)"
        raise ValueError(
            f"x must have shape {shape} with K a multiple of 128, got {tuple(x.shape)}"
        )
    if form not in (1, 2):
        raise ValueError(f"form must be 1 or 2 (GemvConfig.packed), got {form!r}")
    kb = k // PLANAR_BLOCK
    words = torch.empty(kb, PACKED_WORDS, dtype=torch.int32, device=x.device)
    scales = torch.empty(kb, 2, dtype=torch.float32, device=x.device)
    norm = _check_norm_args(x, k, norm_weight, eps, residual, residual_out, words)
    norm_block = min(triton.next_power_of_2(k), NORM_BLOCK_MAX) if norm else 1
    _pack_inputs_kernel[(kb,)](
        x, norm_weight if norm else x, residual if residual is not None else x,
        residual_out if residual_out is not None else x, float(eps), words, scales, k,
        PTX=not triton.knobs.runtime.interpret, ZERO_LAST=form == 2,
        ACT=activation is not None, NORM=norm, HAS_RESIDUAL=residual is not None,
        NORM_BLOCK=norm_block, TRIGGER=pdl.enabled(x.device),
        num_warps=norm_warps(norm_block) if norm else 4,
    )  # fmt: skip
    return PackedInputs(words, scales, form)
