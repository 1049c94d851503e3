"""`x @ weight.T (+ bias)` for a few rows of x: the matrix-vector shape of small decode batches.

At M <= 16 a linear layer is bound by reading its weight once; the work is to keep enough of
it in flight. Each program owns BLOCK_N output columns for all M rows (padded to a 16-row block
with masked loads, the smallest `tl.dot` takes) and walks K in BLOCK_K chunks, so every weight
element is loaded once and shared by all rows, with no split of K and so no second reduce pass.
Accumulation is float32; the output is rounded once to x's dtype, after the bias.

On an H200 at batch 1 of Llama-3.1-8B, the plain kernel runs as fast as cuBLAS (`F.linear`) and
no faster (measured: docs/benchmarks.md, Figures behind design choices), so the runtime does not
route plain linears here. What it adds is fusion: with `activation="silu_and_mul"`, x is an
MLP's [gate | up] and each K chunk's `silu(gate) * up` is made in registers from the two loaded
halves, so the down projection of a decode step needs no separate activation kernel and no round
trip of the activation through memory. Each program makes the activation of the chunks it reads
again (x is small and stays in L2), N / BLOCK_N times over in all. A single row runs as a
multiply-add loop rather than `tl.dot`, which makes it about twice per program instead of 64
times (see `_row_times_w`). Several rows go through `tl.dot`, whose operand layout makes each
element 4 times per program (sm_90, 4 warps); not measured, but by count that is more exp and
divide work than the weight stream hides at down_proj's shape, so the runtime fuses only
single-row steps (runtime/layers/fusion.py).

With `norm_weight`, a single row's RMSNorm (after an optional residual add) is the prologue of
the projection that follows it (qkv after input_layernorm, gate_up after
post_attention_layernorm), replacing a separate `rmsnorm` launch per norm, which at batch 1 of
Llama-3.1-8B costs its launch latency, not its work (measured: docs/benchmarks.md, Figures
behind design choices). Every program first reads the whole row (and residual) once more to
make its sum of squares, then normalises each K chunk as it reads it; program 0 alone stores
the new residual. The rounding points are `rmsnorm`'s, but the sum of squares is reduced in
another order than that kernel's (its warps and blocks differ), so in float32 the result may
differ from `rmsnorm` then the projection in the last place of the inverse norm.

On CUDA the block sizes, warps and pipeline stages are autotuned per (N, K), dtype, activation,
norm (with or without residual) and (under an activation) whether there is a single row: the
first call for each in a process
benchmarks the configurations (host-synchronising; the choice is also kept in Triton's cache
directory, which later processes read instead), later calls look the choice up and launch
without touching the host, so they can be captured in a CUDA graph once a shape has run
eagerly. Under TRITON_INTERPRET=1 one small fixed configuration runs instead, chosen when the
module is first imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from braid.kernels import pdl
from braid.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    dot_precision,
    next_pow2,
    tuned_configs,
)
from braid.kernels.norm import rmsnorm_reference

MAX_ROWS = 16
# Widest load of the norm's sum-of-squares pass: Llama hidden sizes up to 4096 in one load,
# 32 float32 registers a thread at 4 warps.
NORM_BLOCK_MAX = 4096


@triton.jit
def _silu_and_mul_rounded(gate, up):
    """`silu(gate) * up` in float32 with braid.kernels.silu_and_mul's roundings: silu rounded
    to the inputs' dtype before the product, the product rounded to it after."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _load_row(ptr, ks, K, EVEN_K: tl.constexpr):
    """One row's elements at `ks`, zero past K."""
    if EVEN_K:
        return tl.load(ptr + ks)
    else:
        return tl.load(ptr + ks, mask=ks < K, other=0.0)


@triton.jit
def _rmsnorm_rstd(
    X, Residual, ResidualOut, K, eps, HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr
):
    """`1 / sqrt(mean(h * h) + eps)` of the row h = x (+ residual, rounded to x's dtype), as
    braid.kernels.rmsnorm computes it; program 0 also stores h to ResidualOut. Each program
    reads the whole row (from L2 after the first) in NORM_BLOCK-wide loads: one load per
    operand at K <= NORM_BLOCK, so the pass costs about one memory latency, not K / BLOCK_K."""
    offs = tl.arange(0, NORM_BLOCK)
    sum_sq = 0.0
    for k0 in range(0, K, NORM_BLOCK):
        ks = k0 + offs
        mask = ks < K
        x = tl.load(X + ks, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(Residual + ks, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            if tl.program_id(0) == 0:
                tl.store(ResidualOut + ks, x, mask=mask)
        h = x.to(tl.float32)
        sum_sq += tl.sum(h * h, 0)
    return tl.rsqrt(sum_sq / K + eps)


@triton.jit
def _row_times_w(
    X,
    NormW,
    Residual,
    ResidualOut,
    eps,
    w_rows,
    mask_n,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
):
    """One row's `f(x) @ w.T` for the BLOCK_N weight rows at `w_rows`, as [BLOCK_N] float32
    sums, where f(x) is `silu(gate) * up` (ACTIVATION) or `rmsnorm(x (+ residual))` (NORM),
    made chunk by chunk in registers with its standalone kernel's roundings. A multiply-add
    over the weight tile rather than `tl.dot`: in the dot's operand layout every padded row
    and every warp sharing the operand makes f(x) again (64 exps per element of the row, in
    sm_90 PTX with 4 warps), while here it is kept in the weight tile's column layout (2 per
    element: the tile's two rows of warps)."""
    if NORM:
        rstd = _rmsnorm_rstd(X, Residual, ResidualOut, K, eps, HAS_RESIDUAL, NORM_BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # A loop without tl.dot is software-pipelined (cp.async into shared memory) only if asked.
    for k0 in tl.range(0, K, BLOCK_K, num_stages=3):
        ks = k0 + offs_k
        if NORM:
            x = _load_row(X, ks, K, EVEN_K)
            if HAS_RESIDUAL:
                r = _load_row(Residual, ks, K, EVEN_K)
            nw = _load_row(NormW, ks, K, EVEN_K)
        else:
            gate = _load_row(X, ks, K, EVEN_K)
            up = _load_row(X + K, ks, K, EVEN_K)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            # RMSNorm's roundings: the normalised row to x's dtype, then times the weight and
            # rounded again (braid.kernels.norm).
            normed = (x.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32)
            h = (nw.to(tl.float32) * normed).to(X.dtype.element_ty).to(tl.float32)
        else:
            h = _silu_and_mul_rounded(gate, up).to(tl.float32)
        acc += w.to(tl.float32) * h[None, :]
    return tl.sum(acc, axis=1)


# M varies with the batch; specialising on M == 1 would compile every config twice. ONE_ROW (a
# single row under an activation or a norm) is the exception: see _row_times_w.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    X,
    W,
    Bias,
    Out,
    NormW,
    Residual,
    ResidualOut,
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ONE_ROW: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = (n0 + offs_n) < N
    # The block's first weight row as a 64-bit offset, so weights past 2**31 elements address
    # correctly; offsets inside the block stay 32-bit.
    w_rows = W + n0.to(tl.int64) * stride_wn + offs_n[:, None] * stride_wn
    if PDL:
        # Under PDL (`braid.kernels.pdl`): ask L2 for the first 4 lines of each weight row
        # (no kernel writes them), wait for the kernel before, then let the next one start.
        lines = tl.minimum(tl.arange(0, 4) * (1024 // W.dtype.element_ty.primitive_bitwidth), K - 1)
        rows = (n0 + tl.where(mask_n, offs_n, 0)).to(tl.int64)
        pdl.prefetch_l2(W + rows[:, None] * stride_wn + lines[None, :])
        pdl.wait(PDL)
        pdl.trigger(PDL)
    x_rows = X + offs_m[:, None] * stride_xm
    if ONE_ROW:
        row = _row_times_w(
            X,
            NormW,
            Residual,
            ResidualOut,
            eps,
            w_rows,
            mask_n,
            K,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            ACTIVATION,
            NORM,
            HAS_RESIDUAL,
            NORM_BLOCK,
        )
        # Copied into the padding rows, which are never stored, to share the epilogue.
        acc = tl.broadcast_to(row[None, :], (BLOCK_M, BLOCK_N))
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            if EVEN_K:
                x_mask = mask_m[:, None]
            else:
                mask_k = ks < K
                x_mask = mask_m[:, None] & mask_k[None, :]
            if ACTIVATION == "silu_and_mul":
                # x's row is [gate | up], each K wide: this K chunk's activation is made here
                # from its two halves, instead of by a separate kernel through memory.
                gate = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
                up = tl.load(x_rows + K + ks[None, :], mask=x_mask, other=0.0)
                x = _silu_and_mul_rounded(gate, up)
            else:
                x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0.0)
            else:
                w_mask = mask_n[:, None] & mask_k[None, :]
                w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(Bias + n0 + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = Out + offs_m[:, None] * stride_om + (n0 + offs_n)[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _configs() -> list[triton.Config]:
    """16-bit weight tiles of 8-32 KiB per stage, 3-4 stages: enough bytes in flight per SM to
    stream HBM; BLOCK_N down to 16 so that N = 4096 (o_proj, down_proj) still makes 256
    programs for an H200's 132 SMs. Shared memory stays under 150 KiB for 16-bit inputs."""
    shapes = [
        (16, 256, 4, 4),
        (16, 512, 4, 4),
        (16, 512, 8, 3),
        (16, 256, 8, 4),
        (32, 128, 4, 4),
        (32, 256, 4, 4),
        (32, 256, 8, 3),
        (32, 512, 4, 3),
        (32, 512, 8, 3),
        (64, 128, 4, 4),
        (64, 256, 4, 3),
        (64, 256, 8, 3),
    ]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in shapes
    ]


def _even_k(args: dict) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def _bench(kernel_call: Callable[[], None], quantiles: tuple[float, ...]) -> list[float]:
    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


# The autotuner's choices measured per GPU (benchmarks/skinny_choices.py writes them from a
# Triton cache): {device name: {tuned_key(...): [BLOCK_N, BLOCK_K, num_warps, num_stages]}}.
TUNED_CONFIGS = Path(__file__).parent / "configs" / "skinny_gemm.json"


def tuned_key(
    n: int, k: int, dtype: torch.dtype, activation: str | None, one_row: bool, norm: bool,
    residual: bool,
) -> str:  # fmt: skip
    """The key of one autotuned case in `TUNED_CONFIGS`."""
    flags = f"{activation or '-'}/{int(one_row)}{int(norm)}{int(residual)}"
    return f"{n}/{k}/{str(dtype).removeprefix('torch.')}/{flags}"


@functools.cache
def _tuned_table(device_name: str) -> dict[str, list[int]]:
    return tuned_configs(TUNED_CONFIGS, device_name)


def known_choice(configs: list, device_name: str, key: str) -> list:
    """Of the autotuner's `configs`, the one `TUNED_CONFIGS` names for this GPU and case (as a
    list of one), or all of them where it names none (or one no longer among them)."""
    choice = _tuned_table(device_name).get(key)
    if choice is None:
        return configs
    same = [
        c
        for c in configs
        if [c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages] == choice
    ]
    return same or configs


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's early prune: with a measured choice nothing is benchmarked, and a machine
    with an empty Triton cache compiles that one configuration instead of all of them."""
    x = named_args["X"]
    key = tuned_key(
        named_args["N"], named_args["K"], x.dtype, kwargs.get("ACTIVATION"),
        bool(kwargs.get("ONE_ROW")), bool(kwargs.get("NORM")), bool(kwargs.get("HAS_RESIDUAL")),
    )  # fmt: skip
    return known_choice(configs, torch.cuda.get_device_name(x.device), key)


_heuristic_kernel = triton.heuristics({"EVEN_K": _even_k})(_skinny_gemm_kernel)
if triton.knobs.runtime.interpret:
    # Chosen once, when the module is first imported (braid.kernels imports it lazily).
    _kernel = _heuristic_kernel
    _FIXED: dict[str, int] = {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}
else:
    _kernel = triton.autotune(
        _configs(),
        # The fused activation and norm (and the one-row form) are different loop bodies with
        # different best blocks, so each is tuned on its own.
        key=["N", "K", "ACTIVATION", "ONE_ROW", "NORM", "HAS_RESIDUAL"],
        # Each call is tens of microseconds (measured: docs/benchmarks.md, Figures behind design
        # choices): 25 ms per config is hundreds of samples, and keeps the first call per shape
        # (a model's handful of shapes, at start-up) well under a second each. The choice is
        # kept on disk, so later processes skip the benchmarking.
        do_bench=_bench,
        cache_results=True,
        prune_configs_by={"early_config_prune": _prune},
    )(_heuristic_kernel)
    _FIXED = {}

ACTIVATIONS = ("silu_and_mul",)


def _pdl(device: torch.device) -> dict:
    """The launch's PDL switches (`braid.kernels.pdl`)."""
    return {"PDL": True, "launch_pdl": True} if pdl.enabled(device, "skinny") else {"PDL": False}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The [first, last + 1) byte addresses `t`'s elements can occupy."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _check_norm(
    x: torch.Tensor,
    k: int,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    check_tensor("norm_weight", norm_weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("norm_weight", norm_weight, (k,))
    check_contiguous("norm_weight", norm_weight)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out must be None without residual")
        return
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual", residual, (1, k))
    if residual_out is None:
        raise ValueError("residual_out is required with residual (it receives x + residual)")
    check_tensor("residual_out", residual_out, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual_out", residual_out, (1, k))
    check_contiguous("residual_out", residual_out)
    # Program 0 writes residual_out while the others still read x and residual (and write out).
    for name, t in (("x", x), ("residual", residual), ("out", out)):
        if _overlap(residual_out, t):
            raise ValueError(f"residual_out must not overlap {name} in memory")


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    activation: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for `x` of 1..MAX_ROWS rows, as `F.linear` computes it (float32
    accumulation, one rounding to x's dtype after the bias).

    `x`: [M, K] float with 1 <= M <= MAX_ROWS and unit stride in K (any row stride);
    `weight`: contiguous [N, K] of x's dtype on x's device; `bias`: contiguous [N] of x's dtype,
    or None; `out`: [M, N] of x's dtype with unit stride in N, written and returned (else a new
    contiguous tensor is). Never synchronises with the host once (N, K, dtype, activation, and
    whether M == 1 under an activation) has run once on CUDA (the first call autotunes).
    Float32 multiplies in full precision, not TF32.

    `activation="silu_and_mul"`: `x` is [M, 2K] = [gate | up] and the result is
    `(silu(gate) * up) @ weight.T + bias`, with `silu(gate) * up` bit for bit what
    `braid.kernels.silu_and_mul` would have written (computed in float32, silu rounded to x's
    dtype before the product, the product rounded to it after) but never stored: the same
    numbers as `silu_and_mul` then `skinny_linear`, up to the order of the float32 sum.

    `norm_weight` ([K], x's dtype, contiguous): the matmul's input is
    `braid.kernels.rmsnorm(x, norm_weight, eps, residual)`'s first result (with `residual`:
    `x + residual` rounded to x's dtype, normalised in float32, rounded to x's dtype, times
    `norm_weight`, rounded again), never stored. Only for one row (x [1, K]) and no
    activation. `residual`: [1, K] of x's dtype, unit stride in K, or None; with it,
    `residual_out` (contiguous [1, K] of x's dtype, overlapping none of x, residual and out) is
    required and receives `x + residual` rounded, bit for bit `rmsnorm`'s second result;
    without it, `residual_out` must be None. The result equals `rmsnorm` then `skinny_linear`
    up to the order of the float32 sums, the GEMM's and the sum of squares' (float32 inputs:
    last-place differences in the inverse norm; 16-bit inputs: rarely a last-place flip of one
    normalised element). x and residual are not modified.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    m, x_cols = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1..{MAX_ROWS} rows, got shape {tuple(x.shape)}")
    if x_cols < 1:
        raise ValueError(f"x must have at least one column, got shape {tuple(x.shape)}")
    if norm_weight is not None and m != 1:
        raise ValueError(
            f"x must have exactly one row with norm_weight (the fused norm is a single-row "
            f"path), got shape {tuple(x.shape)}"
        )
    if norm_weight is not None and activation is not None:
        raise ValueError(f"activation must be None with norm_weight, got {activation!r}")
    check_tensor("weight", weight, ndim=2, device=x.device)
    check_same_dtype("weight", weight, "x", x)
    check_contiguous("weight", weight)
    n, k = weight.shape
    if activation is None and x_cols != k:
        raise ValueError(f"weight has {k} columns, x has {x_cols} (K must match)")
    if activation is not None and x_cols != 2 * k:
        raise ValueError(
            f"x must have 2 * K = {2 * k} columns ([gate | up] for weight's K = {k}) with "
            f"activation={activation!r}, got shape {tuple(x.shape)}"
        )
    if n < 1:
        raise ValueError(f"weight must have at least one row, got shape {tuple(weight.shape)}")
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
    norm = norm_weight is not None
    if norm:
        _check_norm(x, k, norm_weight, eps, residual, residual_out, out)
    elif residual is not None or residual_out is not None:
        raise ValueError("residual and residual_out need norm_weight (the fused norm)")
    _kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        norm_weight if norm else weight,
        residual if residual is not None else weight,
        residual_out if residual_out is not None else weight,
        float(eps),
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=MAX_ROWS,
        HAS_BIAS=bias is not None,
        DOT_PREC=dot_precision(x.dtype),
        ACTIVATION=activation,
        ONE_ROW=(activation is not None or norm) and m == 1,
        NORM=norm,
        HAS_RESIDUAL=residual is not None,
        # The norm's first pass loads up to this many elements of the row at once.
        NORM_BLOCK=min(next_pow2(k), NORM_BLOCK_MAX) if norm else 1,
        **_FIXED,
        **_pdl(x.device),
    )
    return out


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` in plain torch, float32 throughout, rounded once to x's dtype.
    With `activation="silu_and_mul"`, x is [gate | up] and the matmul's input is
    `silu(gate) * up` rounded as `braid.kernels.silu_and_mul` rounds it. With `norm_weight`,
    the matmul's input is `rmsnorm_reference(x, norm_weight, eps, residual)`'s first result
    and `residual_out`, if given, receives its second (x + residual)."""
    if norm_weight is not None:
        if residual is None:
            x = rmsnorm_reference(x, norm_weight, eps)
        else:
            x, new_residual = rmsnorm_reference(x, norm_weight, eps, residual)
            if residual_out is not None:
                residual_out.copy_(new_residual)
    if activation == "silu_and_mul":
        k = x.shape[-1] // 2
        gate, up = x[..., :k].float(), x[..., k:].float()
        x = (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    elif activation is not None:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
