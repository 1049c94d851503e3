"""Dynamic per-token fp8 (e4m3) quantization of activations, the first half of an FP8 W8A8
linear layer (`torch._scaled_mm` is the second): one program per row reads it once for its
max |x|, then again (from L2) to scale and round it, in one launch instead of the four of the
torch form (abs, amax, divide, cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import FLOAT_DTYPES, check_tensor, next_pow2
from braid.kernels.norm import norm_warps
from braid.kernels.prologue import _check_norm_args, _check_prologue, _input
from braid.kernels.quant_reference import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    per_token_quant_fp8_reference,
)
from braid.kernels.skinny_gemm import NORM_BLOCK_MAX, _rmsnorm_rstd

__all__ = ["per_token_quant_fp8", "per_token_quant_fp8_reference"]

# Widest load of a row: Llama hidden sizes up to 4096 (and 14336 in four). The norm made in
# the kernel before's place sums its squares in loads this wide: as `rmsnorm`'s up to 4096.
BLOCK_MAX = NORM_BLOCK_MAX
# Widest row of the activation made in the kernel before's place (Llama-3.1-8B's 14336).
ACT_BLOCK_MAX = 16384


@triton.jit
def _round_to_e4m3(v):
    """float32 v with |v| <= 448 -> the nearest e4m3 value (ties to even), still as float32,
    so the cast that follows is exact. Rounded here rather than by the cast because Triton's
    interpreter casts to fp8 without carrying into the exponent or rounding ties to even; on a
    GPU the two agree. Normal range (|v| >= 2**-6): keep 3 mantissa bits by integer rounding
    of the bits (a carry moves into the exponent, as it should). Subnormal range: multiples of
    2**-9, rounded by adding and subtracting 2**14, whose float32 spacing is 2**-9."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    a = tl.abs(v)
    # |v| rounded, then v's sign bit put back by hand: a negative value that rounds to zero is
    # -0, as the cast makes it (a negation compiled as 0 - x would give +0 on the GPU).
    sign = (bits >> 31) << 31
    sub = (((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _row_scale(amax, fp8_max, min_scale):
    """A row's scale max(amax / 448, min_scale) and its reciprocal, each one IEEE-rounded
    division (a plain / is approximate on GPUs), as `per_token_quant_fp8_reference` makes them
    (the codes are x * reciprocal, one rounded product each)."""
    scale = tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)
    return scale, tl.math.div_rn(1.0, scale)


@triton.jit
def _per_token_quant_kernel(
    X, Codes, Scales, K, stride_xm, fp8_max, min_scale, NormW, Residual, ResidualOut, eps,
    BLOCK: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    TRIGGER: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    pdl.trigger(TRIGGER)  # the GEMV after may start loading its weights (`pdl`)
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_xm
    c_row = Codes + row.to(tl.int64) * K
    offs = tl.arange(0, BLOCK)
    rstd = 1.0
    if NORM:  # one row (the wrapper checks): program 0 also stores x + residual
        rstd = _rmsnorm_rstd(X, Residual, ResidualOut, K, eps, HAS_RESIDUAL, BLOCK)
    if ONE_BLOCK:  # the row in registers: read (and made) once
        x = _input(x_row, NormW, Residual, offs, offs < K, rstd, K, ACT, NORM, HAS_RESIDUAL)
        scale, inverse = _row_scale(tl.max(tl.abs(x), 0), fp8_max, min_scale)
        tl.store(Scales + row, scale)
        q = _round_to_e4m3(tl.minimum(tl.maximum(x * inverse, -fp8_max), fp8_max))
        tl.store(c_row + offs, q.to(Codes.dtype.element_ty), mask=offs < K)
    else:
        amax = 0.0
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            x = _input(x_row, NormW, Residual, ks, ks < K, rstd, K, ACT, NORM, HAS_RESIDUAL)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
        scale, inverse = _row_scale(amax, fp8_max, min_scale)
        tl.store(Scales + row, scale)
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            x = _input(x_row, NormW, Residual, ks, ks < K, rstd, K, ACT, NORM, HAS_RESIDUAL)
            q = _round_to_e4m3(tl.minimum(tl.maximum(x * inverse, -fp8_max), fp8_max))
            tl.store(c_row + ks, q.to(Codes.dtype.element_ty), mask=ks < K)


def per_token_quant_fp8(
    x: torch.Tensor,
    *,
    activation: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn codes [M, K] contiguous, float32 scales [M, 1]) with
    x ~= codes * scales, bit for bit `per_token_quant_fp8_reference` on any device: each row's
    scale is max|row| / 448 (at least FP8_MIN_SCALE), its codes x * (1 / scale) rounded to
    nearest even.

    `x`: float [M, K] with unit stride in K (any row stride), M >= 0. Never synchronises with
    the host.

    Or, for one row, the codes of what the kernel before would store, made in its place (one
    launch for the two), with that kernel's roundings: `activation="silu_and_mul"` quantizes
    `silu_and_mul(x)` of x = [gate | up] [1, 2K]; `norm_weight` quantizes `rmsnorm(x,
    norm_weight, eps, residual)`'s first result, and `residual_out` receives its second (the
    same bits where K <= 4096: the sum of squares in one load as wide as `rmsnorm`'s, with its
    warps; wider rows add it in another order).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_prologue(activation, norm_weight)
    norm = norm_weight is not None
    fused = norm or activation is not None
    m, k = x.shape
    if activation is not None:
        k //= 2
    if fused and (m != 1 or x.shape[1] != (2 * k if activation else k) or x.stride(1) != 1):
        shape = "(1, 2 * K) ([gate | up])" if activation else "(1, K)"
        raise ValueError(
            f"x must have shape {shape} and unit stride with a fused producer, got {tuple(x.shape)}"
        )
    codes = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _check_norm_args(x, k, norm_weight, eps, residual, residual_out, codes)
    if m == 0 or k == 0:
        return codes, scales.fill_(FP8_MIN_SCALE)
    # The activation's row is held whole (the one program of a one-row launch reads it once).
    block = min(next_pow2(k), ACT_BLOCK_MAX if activation is not None else BLOCK_MAX)
    _per_token_quant_kernel[(m,)](
        x, codes, scales, k, x.stride(0), FP8_MAX, FP8_MIN_SCALE,
        norm_weight if norm else x, residual if residual is not None else x,
        residual_out if residual_out is not None else x, float(eps), BLOCK=block,
        ACT=activation is not None, NORM=norm, HAS_RESIDUAL=residual is not None,
        TRIGGER=pdl.enabled(x.device), ONE_BLOCK=k <= block,
        num_warps=norm_warps(block) if fused else 4,
    )  # fmt: skip
    return codes, scales
