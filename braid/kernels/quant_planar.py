"""Several rows over planar int4 weights (`quant_reference.pack_int4_planar`, the form the
runtime keeps on CUDA): `int4_planar_linear` multiplies in Triton (decode batches, short
prompts), `dequantize_int4_planar` writes the weight out in a float dtype for cuBLAS (long
prompts, where the matmul is compute-bound and the extra pass over the weight is a few percent
of it). One row goes through `int4_gemv.int4_gemv`.

`int4_planar_linear`: each program owns BLOCK_M rows and BLOCK_N outputs and walks K in blocks
of 128 inputs; a block's 16 words per output hold 8 planes of 16 inputs each, and each plane is
one `tl.dot` of x's 16 matching columns with the plane's exact integers `code - zero` in x's
dtype (no shuffle of codes: the planar layout made each plane's inputs contiguous). The sums of
a group are scaled once, in float32; the result is rounded once, after the bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    dot_precision,
)
from braid.kernels.int4_gemv import _plane
from braid.kernels.quant_gemm import MAGIC_BITS
from braid.kernels.quant_reference import PLANAR_BLOCK

__all__ = ["dequantize_int4_planar", "int4_planar_linear"]

# From this many rows on, the runtime dequantizes the weight and calls cuBLAS instead
# (benchmarks/quant_kernels.py measures the crossover: 128 on an H200, 2026-12-02).
DEQUANTIZE_MIN_ROWS = 128

# (BLOCK_M, BLOCK_N, warps, stages) by rows: up to 16, up to 64, more. Starting guesses; the
# benchmark (benchmarks/quant_kernels.py) measures them against dequantize + cuBLAS.
PLANAR_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (16, 64, 4, 3),
    64: (64, 64, 4, 3),
    128: (128, 64, 8, 3),
}


def row_class(m: int) -> int:
    return 16 if m <= 16 else 64 if m <= 64 else 128


@triton.jit
def _meta_parts(Meta, g, rows, mask, N, magic):
    """(zero, scale) float32 of groups `g` for `rows`, from `(zero << 16) | f16 bits`."""
    meta = tl.load(Meta + g * N + rows, mask=mask, other=0)
    scale = (meta & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    zero = ((meta >> 16) | magic).to(tl.float32, bitcast=True) - 12582912.0
    return zero, scale


@triton.jit(do_not_specialize=["M"])
def _int4_planar_kernel(
    X,
    Q,
    Meta,
    Bias,
    Out,
    M,
    N,
    K,
    KB,
    GROUPS,
    stride_xm,
    stride_om,
    magic,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
):
    PPS: tl.constexpr = 8 if GROUP % 128 == 0 else (GROUP // 16 if 128 % GROUP == 0 else 1)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, rmask = offs_m < M, rows < N
    w16 = tl.arange(0, 16)
    q_rows = Q + rows.to(tl.int64)[:, None] * (KB * 16) + w16[None, :]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in tl.range(0, KB, num_stages=STAGES):
        wq = tl.load(q_rows + b * 16, mask=rmask[:, None], other=0)
        hi = wq >> 16
        for seg in tl.static_range(8 // PPS):
            g = rows * 0 + (b * 128 + seg * PPS * 16) // GROUP
            zero, scale = _meta_parts(Meta, g, rows, rmask & (g < GROUPS), N, magic)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(PPS):
                ks = b * 128 + (seg * PPS + j) * 16 + w16
                xmask = mmask[:, None] & (ks < K)[None, :]
                x = tl.load(x_rows + ks[None, :], mask=xmask, other=0.0)
                w = _plane(wq, hi, seg * PPS + j, zero, magic).to(x.dtype)
                part = tl.dot(x, tl.trans(w), part, input_precision=DOT_PREC)
            acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    out = Out + offs_m[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _dequantize_planar_kernel(
    Q, Meta, W, N, K, KB, GROUPS, magic, GROUP: tl.constexpr, BLOCK_N: tl.constexpr
):
    """W[n, k] = (code - zero) * scale in W's dtype, one 128-input block per program."""
    PPS: tl.constexpr = 8 if GROUP % 128 == 0 else (GROUP // 16 if 128 % GROUP == 0 else 1)
    b = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w16 = tl.arange(0, 16)
    q_rows = Q + rows.to(tl.int64)[:, None] * (KB * 16)
    wq = tl.load(q_rows + b * 16 + w16[None, :], mask=rmask[:, None])
    hi = wq >> 16
    w_rows = W + rows.to(tl.int64)[:, None] * K
    for seg in tl.static_range(8 // PPS):
        g = rows * 0 + (b * 128 + seg * PPS * 16) // GROUP
        zero, scale = _meta_parts(Meta, g, rows, rmask & (g < GROUPS), N, magic)
        for j in tl.static_range(PPS):
            ks = b * 128 + (seg * PPS + j) * 16 + w16
            w = _plane(wq, hi, seg * PPS + j, zero, magic) * scale[:, None]
            wmask = rmask[:, None] & (ks < K)[None, :]
            tl.store(w_rows + ks[None, :], w.to(W.dtype.element_ty), mask=wmask)


def _check_planar(
    qweight: torch.Tensor, meta: torch.Tensor, group_size: int, k: int, device: torch.device
) -> tuple[int, int, int]:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16:
        raise ValueError(f"group_size must be an integer >= 16, got {group_size!r}")
    if group_size % 16 or k % group_size:
        raise ValueError(f"group_size {group_size} must be a multiple of 16 that divides K = {k}")
    kb = triton.cdiv(k, PLANAR_BLOCK)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=device)
    check_contiguous("qweight", qweight)
    n = qweight.shape[0]
    check_shape("qweight", qweight, (n, kb * 16))
    check_tensor("meta", meta, ndim=2, dtypes=(torch.int32,), device=device)
    check_shape("meta", meta, (k // group_size, n))
    check_contiguous("meta", meta)
    return n, kb, k // group_size


def int4_planar_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    meta: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for x [M, K] (M >= 1, unit stride in K) and the planar int4 weight
    (`int4_gemv`'s arguments), summed in float32 with each group's sum scaled once and rounded
    once to x's dtype after the bias. `config` (BLOCK_M, BLOCK_N, warps, stages) overrides
    the table's for x's row class."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if m < 1:
        raise ValueError(f"x must have at least one row, got shape {tuple(x.shape)}")
    n, kb, groups = _check_planar(qweight, meta, group_size, k, x.device)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_same_dtype("bias", bias, "x", x)
        check_shape("bias", bias, (n,))
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, (m, n))
    bm, bn, warps, stages = config or PLANAR_CONFIGS[row_class(m)]
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _int4_planar_kernel[grid](
        x, qweight, meta, bias if bias is not None else x, out, m, n, k, kb, groups,
        x.stride(0), out.stride(0), MAGIC_BITS, GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn,
        HAS_BIAS=bias is not None, DOT_PREC=dot_precision(x.dtype), STAGES=stages,
        num_warps=warps, num_stages=1,
    )  # fmt: skip
    return out


def dequantize_int4_planar(
    qweight: torch.Tensor,
    meta: torch.Tensor,
    group_size: int,
    k: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The planar int4 weight as [N, k] in `dtype`: (code - zero) * scale in float32, rounded
    once to `dtype` (exact for the integers, a rounding of each weight for bfloat16)."""
    n, kb, groups = _check_planar(qweight, meta, group_size, k, qweight.device)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(dtype,), device=qweight.device)
        check_shape("out", out, (n, k))
        check_contiguous("out", out)
    block_n = 64
    grid = (triton.cdiv(n, block_n), kb)
    _dequantize_planar_kernel[grid](
        qweight, meta, out, n, k, kb, groups, MAGIC_BITS, GROUP=group_size, BLOCK_N=block_n,
        num_warps=4,
    )  # fmt: skip
    return out
