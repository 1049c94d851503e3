"""Dequantizing GEMMs for weight-only quantized linear layers (16-bit or float32 activations):
`int4_linear` (group-wise 4-bit, the layout AWQ and GPTQ checkpoints are converted into) and
`int8_linear` (per-channel 8-bit). Layouts: `braid.kernels.quant_reference`.

Each program owns BLOCK_N output columns (weight rows) for BLOCK_M rows of x and walks K in
BLOCK_K chunks, so every weight byte is read once per row block. The codes become floats
without an int-to-float conversion (a quarter-rate instruction on recent GPUs, which would cap
a 4-bit GEMV near half the memory rate): a code c < 2**22 OR'ed into the bits of 1.5 * 2**23
reads as the float 12582912 + c, and one subtraction of 12582912 + zero gives c - zero exactly.
The scale is applied once per group, to the sum over the group, not to every weight:

- one row (a batch-1 decode step, the memory-bound shape): a multiply-add over the weight tile
  (`sum(w * x)`), reduced across K once per group;
- more rows: `tl.dot` of x with the tile of exact small integers (c - zero) in x's dtype,
  accumulated over the group, then scaled. Rows are padded to BLOCK_M with masked loads.

Both sum in float32 and round once to x's dtype after the bias, so the result is the
dequantize-then-matmul reference up to the order of the float32 sums.

On CUDA the blocks, warps and stages are autotuned per (N, K, group size, row class): one row,
up to 16, up to 64, more (`_row_class`); the first call of each benchmarks (host-synchronising;
the choice is cached on disk), later ones launch without touching the host, so they can be
captured in a CUDA graph once each class has run eagerly. Under TRITON_INTERPRET=1 one small
fixed configuration runs instead.
"""

from __future__ import annotations

import math

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
from braid.kernels.quant_reference import (
    PACK,
    int4_linear_reference,
    int8_linear_reference,
)

__all__ = ["int4_linear", "int4_linear_reference", "int8_linear", "int8_linear_reference"]

# 1.5 * 2**23: integers below 2**22 added to its bit pattern read as this float plus them.
MAGIC_BITS = 0x4B400000
MAGIC = 12582912.0


@triton.jit
def _int4_minus_zero(packed, zero_f, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] int32 words -> [BLOCK_N, BLOCK_K] float32 `code - zero`, exact;
    `zero_f` is [BLOCK_N] float32 `MAGIC + zero`."""
    shifts = tl.arange(0, 8) * 4
    codes = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
    bits = tl.reshape(codes | 0x4B400000, (BLOCK_N, BLOCK_K))
    return bits.to(tl.float32, bitcast=True) - zero_f[:, None]


@triton.jit
def _int8_to_float(w):
    """int8 -> float32 exactly, through the magic bits rather than a conversion."""
    return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _store_rows(Out, Bias, acc, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# M varies with the batch; the row class (ROWS) is what the code and the tuning depend on.
@triton.jit(do_not_specialize=["M"])
def _int4_kernel(
    X,
    Q,
    Scales,
    Zeros,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FMA_STAGES: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    # 64-bit row offsets: a weight past 2**31 words still addresses correctly.
    q_rows = Q + offs_n.to(tl.int64)[:, None] * (K // 8)
    if ROWS == 1:
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=FMA_STAGES):
            g = k0 // GROUP_SIZE
            zero = tl.load(Zeros + g * N + offs_n, mask=mask_n, other=0)
            packed = tl.load(q_rows + (k0 // 8 + offs_w)[None, :], mask=mask_n[:, None], other=0)
            w = _int4_minus_zero(packed, zero.to(tl.float32) + 12582912.0, BLOCK_N, BLOCK_K)
            x = tl.load(X + k0 + offs_k).to(tl.float32)
            part += w * x[None, :]
            if (k0 + BLOCK_K) % GROUP_SIZE == 0:
                s = tl.load(Scales + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                acc += tl.sum(part, axis=1) * s
                part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        offs_m = tl.arange(0, 1)
        _store_rows(
            Out, Bias, acc[None, :], offs_m, offs_n, offs_m < 1, mask_n, stride_om, HAS_BIAS
        )
    else:
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_rows = X + offs_m[:, None] * stride_xm
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            g = k0 // GROUP_SIZE
            zero = tl.load(Zeros + g * N + offs_n, mask=mask_n, other=0)
            packed = tl.load(q_rows + (k0 // 8 + offs_w)[None, :], mask=mask_n[:, None], other=0)
            w = _int4_minus_zero(packed, zero.to(tl.float32) + 12582912.0, BLOCK_N, BLOCK_K)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
            part = tl.dot(x, tl.trans(w.to(x.dtype)), part, input_precision=DOT_PREC)
            if (k0 + BLOCK_K) % GROUP_SIZE == 0:
                s = tl.load(Scales + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                acc += part * s[None, :]
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        _store_rows(Out, Bias, acc, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _int8_kernel(
    X,
    W,
    Scales,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FMA_STAGES: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = W + offs_n.to(tl.int64)[:, None] * K
    if ROWS == 1:
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=FMA_STAGES):
            ks = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0)
                x = tl.load(X + ks)
            else:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0)
                x = tl.load(X + ks, mask=ks < K, other=0.0)
            part += _int8_to_float(w) * x.to(tl.float32)[None, :]
        # Loaded after the loop, so the scales hold no registers through it.
        s = tl.load(Scales + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = tl.sum(part, axis=1) * s
        offs_m = tl.arange(0, 1)
        _store_rows(
            Out, Bias, acc[None, :], offs_m, offs_n, offs_m < 1, mask_n, stride_om, HAS_BIAS
        )
    else:
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_rows = X + offs_m[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0)
                x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
            else:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0)
                x = tl.load(
                    x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0
                )
            # int8 converts exactly to any float dtype; here the conversion is not the bound.
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PREC)
        s = tl.load(Scales + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        _store_rows(
            Out, Bias, acc * s[None, :], offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS
        )


def _row_class(m: int) -> int:
    """The tuning class of an M-row input: 1 (the multiply-add form), else the BLOCK_M range
    its configurations come from (<= 16: decode batches; <= 64; more: prefill)."""
    if m == 1:
        return 1
    return 16 if m <= 16 else 64 if m <= 64 else 128


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per row class. One row: BLOCK_N down to 16
# so that N = 4096 still makes 256 programs for an H200's 132 SMs without splitting K. More
# rows: tl.dot tiles; int4's carry two float32 accumulators (the group's exact integer sums,
# then the scaled total), int8's hold their weight tile in registers to convert it, so both stay
# smaller than a 16-bit GEMM's. Every shape here compiles for sm_90 with 16-bit activations
# without spilling registers (ptxas -v; float32 activations, rare on a GPU, spill in the larger
# tiles and the tuner then prefers the smaller ones). Not yet tuned on hardware: the first
# H200 run (benchmarks/quantization.py) is the place to prune them.
INT4_SHAPES = {
    1: [
        (1, 16, 128, 4, 3),
        (1, 16, 256, 4, 3),
        (1, 32, 128, 4, 3),
        (1, 32, 256, 4, 3),
        (1, 32, 256, 8, 3),
        (1, 64, 128, 4, 3),
        (1, 64, 256, 8, 3),
        (1, 16, 512, 4, 2),
        (1, 32, 64, 4, 4),
    ],
    16: [
        (16, 32, 64, 4, 4),
        (16, 64, 64, 4, 3),
        (16, 64, 128, 4, 3),
        (16, 128, 64, 4, 3),
        (16, 128, 128, 8, 3),
    ],
    64: [(32, 64, 64, 4, 3), (64, 64, 64, 8, 3), (32, 128, 64, 4, 3), (64, 128, 64, 8, 3)],
    128: [
        (64, 64, 64, 8, 3),
        (128, 64, 64, 8, 3),
        (64, 128, 64, 8, 3),
        (128, 64, 32, 8, 3),
        (64, 128, 32, 8, 3),
    ],
}
INT8_SHAPES = {
    1: [
        (1, 16, 128, 4, 3),
        (1, 16, 256, 4, 3),
        (1, 32, 128, 4, 3),
        (1, 32, 256, 4, 3),
        (1, 32, 256, 8, 3),
        (1, 64, 128, 8, 3),
        (1, 16, 512, 4, 2),
        (1, 32, 64, 4, 4),
    ],
    16: [(16, 32, 64, 4, 4), (16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 8, 3)],
    64: [(32, 64, 64, 4, 3), (64, 64, 64, 8, 3), (64, 128, 64, 8, 3)],
    128: [(64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (128, 128, 32, 8, 3)],
}


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FMA_STAGES": stages}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def _configs(table: dict[int, list[tuple[int, ...]]]) -> list[triton.Config]:
    return [_config(*shape) for shapes in table.values() for shape in shapes]


def _pruner(table: dict[int, list[tuple[int, ...]]]):
    """Keeps the configurations of the call's row class (`ROWS`). With a group size (int4), a
    BLOCK_K that does not split a group evenly is cut to the largest power of two that does
    (the group size is a multiple of 16)."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        rows, group = kwargs["ROWS"], kwargs.get("GROUP_SIZE")
        shapes = set(table[rows])
        keep: dict[tuple[int, ...], triton.Config] = {}
        for cfg in configs:
            m = cfg.kwargs
            shape = (m["BLOCK_M"], m["BLOCK_N"], m["BLOCK_K"], cfg.num_warps, cfg.num_stages)
            if shape not in shapes:
                continue
            if group is not None and group % shape[2]:
                shape = (shape[0], shape[1], math.gcd(shape[2], group), *shape[3:])
                cfg = _config(*shape)
            keep.setdefault(shape, cfg)
        return list(keep.values())

    return prune


def _even_k(args: dict) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def _bench(kernel_call, quantiles):
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _interpret_meta(rows: int, block_k: int) -> dict[str, int]:
    return {
        "BLOCK_M": 1 if rows == 1 else 16,
        "BLOCK_N": 16,
        "BLOCK_K": block_k,
        "FMA_STAGES": 1,
        "num_warps": 4,
    }


_int8_heuristic = triton.heuristics({"EVEN_K": _even_k})(_int8_kernel)
if triton.knobs.runtime.interpret:
    _int4 = _int4_kernel
    _int8 = _int8_heuristic
else:
    _int4 = triton.autotune(
        _configs(INT4_SHAPES),
        key=["N", "K", "GROUP_SIZE", "ROWS"],
        prune_configs_by={"early_config_prune": _pruner(INT4_SHAPES)},
        do_bench=_bench,
        cache_results=True,
    )(_int4_kernel)
    _int8 = triton.autotune(
        _configs(INT8_SHAPES),
        key=["N", "K", "ROWS"],
        prune_configs_by={"early_config_prune": _pruner(INT8_SHAPES)},
        do_bench=_bench,
        cache_results=True,
    )(_int8_heuristic)


def _check_common(
    x: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor | None
) -> tuple[int, torch.Tensor]:
    m = x.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_same_dtype("bias", bias, "x", x)
        check_shape("bias", bias, (n,))
        check_contiguous("bias", bias)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, (m, n))
    return m, out


def _grid(m: int, n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for the group-wise int4 weight W[n, k] = (q[n, k] - zeros[g, n]) *
    scales[g, n], g = k // group_size (layout: `braid.kernels.quant_reference`), summed in
    float32 and rounded once to x's dtype after the bias.

    `x`: [M, K] float, M >= 1, unit stride in K; `qweight`: contiguous int32 [N, K / 8];
    `scales`: contiguous float [K / group_size, N] (any float dtype); `zeros`: contiguous uint8
    [K / group_size, N]; `group_size`: a multiple of 16 dividing K; `bias`: contiguous [N] of
    x's dtype, or None; `out`: [M, N] of x's dtype with unit stride in N (else a new tensor).
    All on x's device. Float32 x multiplies in full precision (no TF32). Never synchronises
    with the host once (N, K, group size, row class) has run once on CUDA.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if m < 1:
        raise ValueError(f"x must have at least one row, got shape {tuple(x.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16:
        raise ValueError(f"group_size must be an integer >= 16, got {group_size!r}")
    if group_size % 16 or k % group_size:
        raise ValueError(
            f"group_size {group_size} must be a multiple of 16 that divides K = {k} (x's columns)"
        )
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device)
    check_contiguous("qweight", qweight)
    n = qweight.shape[0]
    if n < 1:
        raise ValueError(f"qweight must have at least one row, got shape {tuple(qweight.shape)}")
    check_shape("qweight", qweight, (n, k // PACK))
    groups = k // group_size
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("scales", scales, (groups, n))
    check_contiguous("scales", scales)
    check_tensor("zeros", zeros, ndim=2, dtypes=(torch.uint8,), device=x.device)
    check_shape("zeros", zeros, (groups, n))
    check_contiguous("zeros", zeros)
    m, out = _check_common(x, n, bias, out)
    rows = _row_class(m)
    fixed = {}
    if triton.knobs.runtime.interpret:
        fixed = _interpret_meta(rows, 32 if group_size % 32 == 0 else 16)
    _int4[_grid(m, n)](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        ROWS=rows,
        HAS_BIAS=bias is not None,
        DOT_PREC=dot_precision(x.dtype),
        **fixed,
    )
    return out


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ (weight * scales[:, None]).T + bias` for a per-channel int8 weight, summed in
    float32 (the scale applied once per output, to the sum) and rounded once to x's dtype.

    `x`: [M, K] float, M >= 1, unit stride in K; `weight`: contiguous int8 [N, K]; `scales`:
    contiguous float [N] (any float dtype); `bias`, `out` as in `int4_linear`. Never
    synchronises with the host once (N, K, row class) has run once on CUDA.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if m < 1 or k < 1:
        raise ValueError(f"x must have at least one row and column, got shape {tuple(x.shape)}")
    check_tensor("weight", weight, ndim=2, dtypes=(torch.int8,), device=x.device)
    check_contiguous("weight", weight)
    n = weight.shape[0]
    if n < 1:
        raise ValueError(f"weight must have at least one row, got shape {tuple(weight.shape)}")
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has {k} (K must match)")
    check_tensor("scales", scales, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("scales", scales, (n,))
    check_contiguous("scales", scales)
    m, out = _check_common(x, n, bias, out)
    rows = _row_class(m)
    fixed = _interpret_meta(rows, 32) if triton.knobs.runtime.interpret else {}
    _int8[_grid(m, n)](
        x,
        weight,
        scales,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        ROWS=rows,
        HAS_BIAS=bias is not None,
        DOT_PREC=dot_precision(x.dtype),
        **fixed,
    )
    return out
