"""`gguf_linear`: the dequantizing GEMM of GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K) kept in their codes and per-group scales, the layout of
`braid.kernels.gguf_reference.KernelPlanes`: W[n, k] = code[n, k] * scale[g, n] +
offset[g, n], g = k // G (G = 32, or 16 for Q6_K), codes 4-bit packed eight a word or 8-bit
one a byte. The planes are the blocks' own values, exact (float16 where that is exact, else
float32), so the product is the dequantized model's up to the order of float32 sums.

Each program owns BLOCK_N outputs for BLOCK_M rows and walks K; every weight byte is read
once per row block. Codes become floats through the bits of 1.5 * 2**23 (as in
`quant_gemm.py`: no int-to-float conversion).

- one row (a batch-1 decode step): each weight is rebuilt in float32 (c * s + o, exact) and
  multiplied into a [BLOCK_N, BLOCK_K] tile, reduced once at the end;
- more rows: per group, `tl.dot` of x with the exact integer codes in x's dtype, then
  `acc += dot * scale + rowsum(x) * offset` (the offset term needs the group's sum of x).

Both sum in float32 and round once to x's dtype after the bias. Autotuned per (N, K, G,
code width, row class) on CUDA, cached on disk; under TRITON_INTERPRET=1 one small fixed
configuration runs instead. Not yet tuned on hardware: the H200 run of
`benchmarks/quantization.py --gguf-gpu` is the place to prune the configurations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_shape,
    check_tensor,
    dot_precision,
)
from braid.kernels.gguf_reference import KernelPlanes, gguf_linear_reference
from braid.kernels.quant_gemm import _bench, _check_common, _row_class

__all__ = ["gguf_linear", "gguf_linear_reference"]


@triton.jit
def _codes(Q, offs_n, mask_n, k0, K, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr):
    """[BLOCK_N, BK] float32 codes of the columns k0..k0 + BK (0 past K), exactly."""
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
    return bits.to(tl.float32, bitcast=True) - 12582912.0


@triton.jit(do_not_specialize=["M"])
def _gguf_kernel(
    X,
    Q,
    Scale,
    Offset,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    G: tl.constexpr,
    BITS: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if ROWS == 1:
        GROUPS: tl.constexpr = BLOCK_K // G
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = _codes(Q, offs_n, mask_n, k0, K, BITS, BLOCK_N, BLOCK_K)
            offs_g = k0 // G + tl.arange(0, GROUPS)
            gmask = mask_n[:, None] & (offs_g < K // G)[None, :]
            sp = offs_g[None, :] * N + offs_n[:, None]
            s = tl.load(Scale + sp, mask=gmask, other=0.0).to(tl.float32)
            w = tl.reshape(c, (BLOCK_N, GROUPS, G)) * s[:, :, None]
            if HAS_OFFSET:
                o = tl.load(Offset + sp, mask=gmask, other=0.0).to(tl.float32)
                w += o[:, :, None]
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            part += tl.reshape(w, (BLOCK_N, BLOCK_K)) * x[None, :]
        acc = tl.sum(part, axis=1)[None, :]
        offs_m = tl.arange(0, 1)
        mask_m = offs_m < 1
    else:
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_rows = X + offs_m[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, G):
            c = _codes(Q, offs_n, mask_n, k0, K, BITS, BLOCK_N, G)
            x = tl.load(x_rows + (k0 + tl.arange(0, G))[None, :], mask=mask_m[:, None], other=0.0)
            part = tl.dot(x, tl.trans(c.to(x.dtype)), input_precision=DOT_PREC)
            g = k0 // G
            s = tl.load(Scale + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += part * s[None, :]
            if HAS_OFFSET:
                o = tl.load(Offset + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * o[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per row class; BLOCK_K is the group
# size on the tl.dot path (the 0 here), a multiple of it on the one-row path.
SHAPES = {
    1: [
        (1, 16, 128, 4, 3),
        (1, 32, 128, 4, 3),
        (1, 16, 256, 4, 3),
        (1, 32, 256, 8, 3),
        (1, 64, 128, 4, 3),
    ],
    16: [(16, 32, 0, 4, 3), (16, 64, 0, 4, 3), (16, 128, 0, 4, 4)],
    64: [(32, 64, 0, 4, 3), (64, 64, 0, 4, 3), (64, 128, 0, 8, 3)],
    128: [(64, 64, 0, 4, 3), (128, 64, 0, 8, 3), (64, 128, 0, 8, 3), (128, 128, 0, 8, 3)],
}


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages
    )


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The configurations of the call's row class, with BLOCK_K set for its group size."""
    rows, group = kwargs["ROWS"], kwargs["G"]
    keep = []
    for m, bn, bk, warps, stages in SHAPES[rows]:
        keep.append(_config(m, bn, bk if rows == 1 else group, warps, stages))
    return keep


if triton.knobs.runtime.interpret:
    _kernel = _gguf_kernel
else:
    _kernel = triton.autotune(
        [_config(*s) for s in SHAPES[1]],
        key=["N", "K", "G", "BITS", "ROWS"],
        prune_configs_by={"early_config_prune": _prune},
        do_bench=_bench,
        cache_results=True,
    )(_gguf_kernel)


def gguf_linear(
    x: torch.Tensor,
    planes: KernelPlanes,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for the GGUF weight `planes` hold (`KernelPlanes`), summed in float32
    and rounded once to x's dtype after the bias.

    `x`: [M, K] float, M >= 1, unit stride in K; `planes.codes`: contiguous int32 [N, K / 8]
    (bits 4) or int8 / uint8 [N, K] (bits 8); `planes.scale` (and `planes.offset`, or None):
    contiguous float16 or float32 [K / G, N]; G 16 or 32 dividing K; `bias`: contiguous [N]
    of x's dtype, or None; `out`: [M, N] of x's dtype with unit stride in N (else a new
    tensor). All on x's device. Float32 x multiplies in full precision (no TF32). Never
    synchronises with the host once (N, K, G, bits, row class) has run once on CUDA.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if m < 1:
        raise ValueError(f"x must have at least one row, got shape {tuple(x.shape)}")
    g, bits = planes.group_size, planes.bits
    if g not in (16, 32) or k % g:
        raise ValueError(f"planes.group_size must be 16 or 32 and divide K = {k}, got {g}")
    codes = planes.codes
    if bits == 4:
        check_tensor("planes.codes", codes, ndim=2, dtypes=(torch.int32,), device=x.device)
        n = codes.shape[0]
        check_shape("planes.codes", codes, (n, k // 8))
    elif bits == 8:
        dtypes = (torch.int8, torch.uint8)
        check_tensor("planes.codes", codes, ndim=2, dtypes=dtypes, device=x.device)
        n = codes.shape[0]
        check_shape("planes.codes", codes, (n, k))
    else:
        raise ValueError(f"planes.bits must be 4 or 8, got {bits!r}")
    check_contiguous("planes.codes", codes)
    if n < 1:
        raise ValueError(f"planes.codes must have at least one row, got {tuple(codes.shape)}")
    plane_dtypes = (torch.float16, torch.float32)
    for name, t in (("planes.scale", planes.scale), ("planes.offset", planes.offset)):
        if t is None and name == "planes.offset":
            continue
        check_tensor(name, t, ndim=2, dtypes=plane_dtypes, device=x.device)
        check_shape(name, t, (k // g, n))
        check_contiguous(name, t)
    m, out = _check_common(x, n, bias, out)
    rows = _row_class(m)
    fixed = {}
    if triton.knobs.runtime.interpret:
        fixed = {
            "BLOCK_M": 1 if rows == 1 else 16,
            "BLOCK_N": 16,
            "BLOCK_K": 64 if rows == 1 else g,
        }
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
    _kernel[grid](
        x,
        codes,
        planes.scale,
        planes.offset if planes.offset is not None else planes.scale,
        bias if bias is not None else planes.scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        G=g,
        BITS=bits,
        HAS_OFFSET=planes.offset is not None,
        HAS_BIAS=bias is not None,
        ROWS=rows,
        DOT_PREC=dot_precision(x.dtype),
        **fixed,
    )
    return out
