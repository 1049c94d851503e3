"""One-row (batch-1 decode) matrix-vector products over quantized weights: `int8_gemv`
(per-channel int8) and `fp8_gemv` (e4m3 weights, the activation quantized per token inside
the kernel, W8A8 as `fp8_linear_reference` computes it), and what they share with
`int4_gemv.int4_gemv` (the planar int4 layout): `GemvConfig`, the measured tables, the split-K
workspace.

One row reads each weight once and does two FLOPs per weight, so the time is the weight bytes
over the memory rate, if the kernel issues few enough instructions per weight and keeps enough
bytes in flight. Per weight: int4 one LOP3 (mask one nibble and OR in a float exponent: the
planar layout puts nibble p of every word at the same bits, so a constant mask per plane
replaces a shift per code), one FADD (remove the exponent's offset and the zero: exact
`code - zero`) and one FFMA; int8 the same through the 1.5 * 2**23 bits (no int-to-float
conversion, a quarter-rate instruction); fp8 two e4m3 -> f16 per conversion instruction, one
f16 -> f32 and one FFMA. Scales are applied once per group (int4) or once per output.

Parallelism: each program owns BLOCK_N outputs and a slice of K; SPLIT_K slices run as
separate programs so that small layers still fill the GPU with loads. A split writes its
partial sums to a float32 workspace, and the last of a row block's splits to arrive (an
atomic counter) adds them in split order, scales, adds the bias and stores: one launch, and
the same bits whatever order the programs ran in. The counters return to zero after each
call, so one workspace serves any number of sequential calls (CUDA graphs included) but not
two kernels running at once.

Configurations (BLOCK_N, BLOCK_K or SUBS, SPLIT_K, warps, stages; fp8's tensor-core form)
come from the GPU's entry in `configs/quant_gemv.json` (`benchmarks/quant_kernels.py
--write-config`), else from the `*_CONFIGS` tables keyed by (N, K), written from that
benchmark's measurements on an H200; other shapes take a rule of thumb. No autotuning at run
time: a launch never synchronises with the host. Under TRITON_INTERPRET=1 the same kernels run
on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    cuda_device_name,
    next_pow2,
    tuned_configs,
)
from braid.kernels.fp8_quant import _round_to_e4m3, _row_scale
from braid.kernels.gemv_split import _block_and_split, _finish, grid, split_length
from braid.kernels.quant_gemm import _int8_to_float
from braid.kernels.quant_reference import FP8_DTYPE, FP8_MIN_SCALE

__all__ = ["GemvConfig", "GemvWorkspace", "fp8_gemv", "int8_gemv"]


@dataclass(frozen=True)
class GemvConfig:
    """A launch shape: `block_n` outputs per program; `block_k` inputs per loop step (int4:
    a multiple of 128, as `subs` = block_k / 128 blocks unrolled); `split_k` programs along
    K; `warps`; `stages` (software pipelining of the loop's loads); `splits_first`: the
    splits of one row block launch next to each other (`gemv_split.grid`)."""

    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 2
    dot: bool = False  # fp8: the products on the tensor cores (`_fp8_gemv_kernel`'s DOT)
    # int4, for 16-bit x and groups of whole 128s (`int4_gemv`): 0 the float32 form; float16
    # pairs with 1 the zero taken off each code, 2 the codes as subnormals, the zero after.
    packed: int = 0
    splits_first: bool = False

    def __post_init__(self) -> None:
        if self.packed not in (0, 1, 2):
            raise ValueError(f"GemvConfig.packed must be 0, 1 or 2, got {self.packed!r}")


# Best measured on an H200 per (N, K) (benchmarks/quant_kernels.py writes these; run of
# 2026-12-02, benchmarks/results/quant_kernels_cuda.json); other shapes take `default_config`.
INT4_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (4096, 4096): GemvConfig(256, 128, 8, 4, 3),
    (4096, 14336): GemvConfig(256, 128, 8, 4, 3),
    (6144, 4096): GemvConfig(256, 128, 8, 4, 3),
    (28672, 4096): GemvConfig(64, 256, 4, 2, 2),
}
INT8_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (4096, 4096): GemvConfig(16, 512, 1, 4, 3),
    (4096, 14336): GemvConfig(64, 256, 4, 4, 3),
    (6144, 4096): GemvConfig(16, 512, 1, 4, 3),
}
FP8_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (4096, 4096): GemvConfig(16, 512, 1, 4, 3),
    (4096, 14336): GemvConfig(64, 256, 4, 4, 3),
    (6144, 4096): GemvConfig(16, 512, 1, 4, 3),
    (28672, 4096): GemvConfig(16, 512, 1, 4, 3),
}


def default_config(kind: str, n: int, k: int) -> GemvConfig:
    """A rule of thumb (the predictions the first H200 run checks): tiles that give each
    thread 4 (int4, int8) or 8 (fp8, whose activation is quantized once per thread and used
    for each of its rows) output rows, and K split until there are about 4 programs per SM of
    a 132-SM GPU."""
    block_n, block_k = {"int4": (128, 256), "int8": (16, 512), "fp8": (32, 512)}[kind]
    blocks = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1
    while blocks * split < 512 and split * 2 <= steps and split < 8:
        split *= 2
    return GemvConfig(block_n, block_k, split, 4, 2)


# Configurations measured per GPU that override the tables above on that GPU
# (`benchmarks/quant_kernels.py --write-config`): {device name: {"kind/N/K": [block_n,
# block_k, split_k, warps, stages, dot, packed, splits_first]}} (the flags may be left out:
# false).
TUNED_CONFIGS = Path(__file__).parent / "configs" / "quant_gemv.json"


def tuned_key(kind: str, n: int, k: int) -> str:
    """The key of one case in `TUNED_CONFIGS`."""
    return f"{kind}/{n}/{k}"


@functools.cache
def _tuned_table(device_name: str) -> dict[str, GemvConfig]:
    table = tuned_configs(TUNED_CONFIGS, device_name)
    return {key: table_config(c) for key, c in table.items()}


def table_config(c: list[int | bool] | tuple[int | bool, ...]) -> GemvConfig:
    """A `TUNED_CONFIGS` entry: five numbers, then the flags dot, packed (int; true in files
    written before the second packed form: 1) and splits_first, each false where left out."""
    given = list(c[5:8])
    dot, packed, splits_first = given + [False, 0, False][len(given) :]
    return GemvConfig(*c[:5], dot=bool(dot), packed=int(packed), splits_first=bool(splits_first))


def config_for(kind: str, n: int, k: int, device: torch.device | None = None) -> GemvConfig:
    """The launch shape for an [n, k] weight of `kind` ("int4", "int8", "fp8"): the one
    measured on this GPU (`TUNED_CONFIGS`), else the tables', else `default_config`.
    "int4_ahead", "fp8_ahead": the GEMV over inputs made before it, measured on this GPU,
    else its kind's."""
    if device is not None and device.type == "cuda":
        tuned = _tuned_table(cuda_device_name(device.index)).get(tuned_key(kind, n, k))
        if tuned is not None:
            return tuned
    if kind.endswith("_ahead"):
        return config_for(kind.removesuffix("_ahead"), n, k, device)
    table = {"int4": INT4_CONFIGS, "int8": INT8_CONFIGS, "fp8": FP8_CONFIGS}[kind]
    return table.get((n, k)) or default_config(kind, n, k)


class GemvWorkspace:
    """Split-K scratch on one device: float32 partial sums and one int32 counter per output
    block, zero between calls. A layer that owns one sized for its launches (`for_launch`)
    never reallocates, so CUDA graphs that captured it stay valid; the shared one of
    `for_device` grows when a larger launch needs it and keeps what it outgrew alive (a graph
    may hold it)."""

    _by_device: dict[torch.device, GemvWorkspace] = {}

    def __init__(self, device: torch.device, partials: int = 0, counters: int = 0) -> None:
        self.device = device
        self.partials = torch.empty(partials, dtype=torch.float32, device=device)
        self.counters = torch.zeros(counters, dtype=torch.int32, device=device)
        self._outgrown: list[torch.Tensor] = []

    @classmethod
    def for_device(cls, device: torch.device) -> GemvWorkspace:
        if device not in cls._by_device:
            cls._by_device[device] = cls(device)
        return cls._by_device[device]

    @classmethod
    def for_launch(cls, kind: str, n: int, k: int, device: torch.device) -> GemvWorkspace:
        """Scratch for the launches of an [n, k] weight of `kind` ("int4", "int8", "fp8")."""
        cfg = config_for(kind, n, k, device)
        return cls(device, cfg.split_k * n, triton.cdiv(n, cfg.block_n))

    def take(self, partials: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials.numel() < partials:
            self._outgrown.append(self.partials)
            self.partials = torch.empty(partials, dtype=torch.float32, device=self.device)
        if self.counters.numel() < counters:
            self._outgrown.append(self.counters)
            self.counters = torch.zeros(counters, dtype=torch.int32, device=self.device)
        return self.partials, self.counters


@triton.jit
def _weights_then_wait(W, rows, rmask, K, first, SPLIT_LEN, PDL: tl.constexpr,
                       LINES: tl.constexpr):  # fmt: skip
    """Under PDL (`braid.kernels.pdl`): ask L2 for the first LINES lines of this program's
    split of each of its rows (weights: no kernel writes them), then wait for the kernel
    before to end. x, the outputs and the split-K counters are touched only after."""
    if PDL:
        last = tl.maximum(tl.minimum(first + SPLIT_LEN, K) - 1, 0)
        cols = tl.minimum(first + 128 * tl.arange(0, LINES), last)
        safe = tl.where(rmask, rows, 0).to(tl.int64)
        pdl.prefetch_l2(W + safe[:, None] * K + cols[None, :])
        pdl.wait(PDL)


@triton.jit
def _int8_gemv_kernel(
    X,
    W,
    Scales,
    Bias,
    Out,
    Partials,
    Counters,
    N,
    K,
    SPLIT_LEN,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    SPLITS_FIRST: tl.constexpr,
):
    block, split = _block_and_split(SPLITS_FIRST)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    offs = tl.arange(0, BLOCK_K)
    w_rows = W + rows.to(tl.int64)[:, None] * K
    first = split * SPLIT_LEN
    _weights_then_wait(W, rows, rmask, K, first, SPLIT_LEN, PDL, PREFETCH_LINES)
    end = tl.minimum(first + SPLIT_LEN, K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(first, end, BLOCK_K, num_stages=STAGES):
        ks = k0 + offs
        kmask = ks < end
        w = tl.load(w_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0)
        x = tl.load(X + ks, mask=kmask, other=0.0).to(tl.float32)
        acc += _int8_to_float(w) * x[None, :]
    _finish(
        tl.sum(acc, axis=1), block, split, rows, rmask, Out, Bias, Scales, 1.0, Partials,
        Counters, N, SPLIT_K, HAS_BIAS, True,
    )  # fmt: skip


# The columns of the activation block in `_fp8_gemv_kernel`'s tensor-core products.
DOT_COLS: tl.constexpr = tl.constexpr(16)
# The products one e4m3 tensor-core instruction sums along K (sm_90): the most a sum runs in
# the tensor cores' own precision before it moves to float32. BLOCK_K is a multiple of it.
DOT_STEP: tl.constexpr = tl.constexpr(32)


@triton.jit
def _fp8_gemv_kernel(
    X,
    W,
    Scales,
    Bias,
    Out,
    Partials,
    Counters,
    N,
    K,
    SPLIT_LEN,
    min_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    SPLITS_FIRST: tl.constexpr,
    XQ,
    XS,
    X_AHEAD: tl.constexpr,
):
    """DOT: each block's products on the tensor cores, as an e4m3 matmul of the weight tile
    [BLOCK_N, BLOCK_K] by the activation's codes repeated in DOT_COLS columns (the narrowest
    a tensor-core product takes; every column the same, one kept): no conversion of the
    weights, and one matmul instruction per many products instead of a conversion and an FMA
    per weight. Otherwise each weight is converted and multiplied on the CUDA cores."""
    block, split = _block_and_split(SPLITS_FIRST)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    first = split * SPLIT_LEN
    _weights_then_wait(W, rows, rmask, K, first, SPLIT_LEN, PDL, PREFETCH_LINES)
    if X_AHEAD:  # the codes and scale per_token_quant_fp8 made before the launch
        x_scale = tl.load(XS)
    else:
        # The row's scale, as per_token_quant_fp8 makes it (every program reads the row, from
        # L2).
        xo = tl.arange(0, X_BLOCK)
        amax = tl.zeros([X_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, X_BLOCK):
            xa = tl.load(X + k0 + xo, mask=k0 + xo < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xa))
        x_scale, inverse = _row_scale(tl.max(amax, axis=0), 448.0, min_scale)
    offs = tl.arange(0, BLOCK_K)
    w_rows = W + rows.to(tl.int64)[:, None] * K
    end = tl.minimum(first + SPLIT_LEN, K)
    if DOT:
        acc = tl.zeros([BLOCK_N, DOT_COLS], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(first, end, BLOCK_K, num_stages=STAGES):
        ks = k0 + offs
        kmask = ks < end
        w = tl.load(w_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if X_AHEAD:
            xc = tl.load(XQ + ks, mask=kmask, other=0.0)
            xq = xc.to(tl.float32)
        else:
            x = tl.load(X + ks, mask=kmask, other=0.0).to(tl.float32)
            # The activation's e4m3 code, as a float32 (exact): e4m3 products are exact in
            # float32, so on the CUDA cores the sum differs from _scaled_mm's only in its order.
            xq = _round_to_e4m3(tl.minimum(tl.maximum(x * inverse, -448.0), 448.0))
        if DOT:
            if X_AHEAD:  # the codes as loaded
                xt = tl.broadcast_to(xc[:, None], [BLOCK_K, DOT_COLS])
            else:
                xt = tl.broadcast_to(xq[:, None], [BLOCK_K, DOT_COLS]).to(W.dtype.element_ty)
            # Sums moved into float32 after every tensor-core step of 32 products (Hopper's
            # e4m3 products accumulate in fewer bits: Triton's default for sm_90 kept them
            # there for the whole block and moved outputs by ~1e-3, measured on an H200).
            acc = tl.dot(w, xt, acc, max_num_imprecise_acc=DOT_STEP, out_dtype=tl.float32)
        else:
            acc += w.to(tl.float32) * xq[None, :]
    if DOT:
        y = tl.max(acc, axis=1)  # the columns are equal
    else:
        y = tl.sum(acc, axis=1)
    _finish(
        y, block, split, rows, rmask, Out, Bias, Scales, x_scale, Partials, Counters, N,
        SPLIT_K, HAS_BIAS, True,
    )  # fmt: skip


# ---- launchers ---------------------------------------------------------------------------------


def _check_row(x: torch.Tensor, k: int) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"x must have shape (1, {k}) (one row), got {tuple(x.shape)}")


def _check_out(
    x: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor | None, dtype
) -> torch.Tensor:
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_same_dtype("bias", bias, "x", x)
        check_shape("bias", bias, (n,))
        check_contiguous("bias", bias)
    if out is None:
        return torch.empty(1, n, dtype=dtype, device=x.device)
    check_tensor("out", out, ndim=2, dtypes=(dtype,), device=x.device)
    check_shape("out", out, (1, n))
    return out


def _scratch(
    x: torch.Tensor, n: int, cfg: GemvConfig, workspace: GemvWorkspace | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.split_k == 1:
        return x, x  # unused
    ws = workspace or GemvWorkspace.for_device(x.device)
    return ws.take(cfg.split_k * n, triton.cdiv(n, cfg.block_n))


def _byte_split(
    x: torch.Tensor, n: int, k: int, cfg: GemvConfig, workspace: GemvWorkspace | None
) -> tuple[int, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """A one-byte weight's split of K (each split a whole number of BLOCK_K), its scratch and
    the launch grid."""
    split_len = split_length(k, cfg.split_k, cfg.block_k)
    partials, counters = _scratch(x, n, cfg, workspace)
    return (
        split_len,
        partials,
        counters,
        grid(triton.cdiv(n, cfg.block_n), cfg.split_k, cfg.splits_first),
    )


# Lines of 128 bytes per weight row a program asks L2 for before it waits under PDL
# (`braid.kernels.pdl`): its whole split where that is short, 4 a row at most.
MAX_PREFETCH_LINES = 4


def _launch_meta(cfg: GemvConfig, kind: str, device: torch.device, row_bytes: int) -> dict:
    """The launch's warps, stages and grid order (SPLITS_FIRST), and PDL's switches for a GEMV
    of `kind`: with it, each program prefetches the first `row_bytes` of its split of each
    row (up to MAX_PREFETCH_LINES lines)."""
    on = pdl.enabled(device, kind)
    lines = min(triton.next_power_of_2(triton.cdiv(row_bytes, 128)), MAX_PREFETCH_LINES)
    meta = {"num_warps": cfg.warps, "num_stages": 1, "STAGES": cfg.stages, "PDL": on}
    meta["SPLITS_FIRST"] = cfg.splits_first
    meta["PREFETCH_LINES"] = lines if on else 1
    if on:
        meta["launch_pdl"] = True
    return meta


def _check_byte_weight(x, weight, scales, dtype) -> tuple[int, int]:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    k = x.shape[1]
    _check_row(x, k)
    check_tensor("weight", weight, ndim=2, dtypes=(dtype,), device=x.device)
    check_contiguous("weight", weight)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has {k} (K must match)")
    check_tensor("scales", scales, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("scales", scales, (n,))
    check_contiguous("scales", scales)
    return n, k


def int8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    workspace: GemvWorkspace | None = None,
) -> torch.Tensor:
    """`x @ (weight * scales[:, None]).T + bias` for one row x [1, K] and a per-channel int8
    weight [N, K] (contiguous): the float32 sum times the scale, plus the bias, rounded once
    to x's dtype, as `int8_linear`."""
    n, k = _check_byte_weight(x, weight, scales, torch.int8)
    out = _check_out(x, n, bias, out, x.dtype)
    cfg = config or config_for("int8", n, k, x.device)
    split_len, partials, counters, launch = _byte_split(x, n, k, cfg, workspace)
    _int8_gemv_kernel[launch](
        x, weight, scales, bias if bias is not None else scales, out, partials, counters, n, k,
        split_len, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        HAS_BIAS=bias is not None, **_launch_meta(cfg, "int8", x.device, split_len),
    )  # fmt: skip
    return out


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    workspace: GemvWorkspace | None = None,
    x_codes: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 fp8 for one row: x [1, K] quantized per token inside the kernel (the codes and
    scale of `per_token_quant_fp8`), times the e4m3 weight [N, K] (contiguous) summed in
    float32, times x's scale then `scales` [N] (float32), plus the bias (x's dtype), rounded
    once to `out_dtype`: `fp8_linear_reference(x, weight, scales, bias, out_dtype)` up to the
    order of the float32 sum (with `dot`, also the rounding of sums of 32 products in the
    tensor cores), in one launch.

    `x_codes`, `x_scale`: `per_token_quant_fp8(x)`'s results, made before the launch; the
    kernel then loads the codes instead of reading the row for its scale in every program and
    rounding each input (the same bits)."""
    n, k = _check_byte_weight(x, weight, scales, FP8_DTYPE)
    if (x_codes is None) != (x_scale is None):
        raise ValueError("x_codes and x_scale go together (per_token_quant_fp8(x)'s results)")
    if x_codes is not None:
        check_tensor("x_codes", x_codes, ndim=2, dtypes=(FP8_DTYPE,), device=x.device)
        check_shape("x_codes", x_codes, (1, k))
        check_contiguous("x_codes", x_codes)
        check_tensor("x_scale", x_scale, ndim=2, dtypes=(torch.float32,), device=x.device)
        check_shape("x_scale", x_scale, (1, 1))
    out = _check_out(x, n, bias, out, out_dtype)
    cfg = config or config_for("fp8", n, k, x.device)
    if cfg.dot and (cfg.block_k % DOT_STEP.value or cfg.block_n < 16):
        raise ValueError(
            f"fp8_gemv: a tensor-core config needs block_k a multiple of {DOT_STEP.value} and "
            f"block_n >= 16, got {cfg}"
        )
    split_len, partials, counters, launch = _byte_split(x, n, k, cfg, workspace)
    _fp8_gemv_kernel[launch](
        x, weight, scales, bias if bias is not None else scales, out, partials, counters, n, k,
        split_len, FP8_MIN_SCALE, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        X_BLOCK=min(next_pow2(k), 4096), SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None,
        DOT=cfg.dot, **_launch_meta(cfg, "fp8", x.device, split_len),
        XQ=x_codes if x_codes is not None else weight,
        XS=x_scale if x_scale is not None else scales, X_AHEAD=x_codes is not None,
    )  # fmt: skip
    return out
