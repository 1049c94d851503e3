"""The one-row (batch-1 decode) int4 GEMV over the planar layout (`int4_gemv`), in two forms
chosen by the launch configuration (`GemvConfig.packed`), with `skinny_linear`'s prologues
(RMSNorm with its residual add, `silu_and_mul`) fused into the packed form. The runtime does
not use the prologues: on an H100 they ran slower than the separate kernels they replace
(gate_up 41.5 against 37.1 us, down 21.1 against 19.2, qkv 11.3 against 11.5: every program
makes the norm or the activation again, in front of its weight loads; `benchmarks/
kernel_timings.py --kernels int4_gemv`), where the bf16 skinny kernel's longer loops hide it.

**The float32 form** (`_int4_gemv_kernel`): per weight one LOP3 (mask one nibble and OR in a
float exponent: the planar layout puts nibble p of every word at the same bits, so a constant
mask per plane replaces a shift per code), one FADD (remove the exponent's offset and the zero:
exact `code - zero`) and one FFMA; the scale once per group. About 4.4 instructions per weight
on sm_90 (`benchmarks/sass_counts.py`), about what the SMs can issue while the weights stream
in at the copy rate. Yet the packed form below, at 2.6, ran within 6% of it at every
Llama-3.1-8B shape on an H100 (0.39-0.64 of the copy rate either way: bytes in flight, launch
and tail bound them, not issue) and 2-12% faster on an H200, whose memory is faster for the
same SMs, so the measured table (`configs/quant_gemv.json`) picks the form per shape and GPU
(docs/benchmarks.md).

**The packed form** (`_int4_gemv_f16x2_kernel`, bfloat16 and float16 activations, groups of
whole 128-input blocks as AWQ's and GPTQ's 128): two weights per instruction. Per 32-bit word
of the planar layout (8 codes, plane p at bits 4p, input 16p + w of its 128-input block):
- four LOP3 and one shift put the codes of planes (0, 4), (1, 5), (2, 6), (3, 7) into the
  mantissas of float16 pairs: 1024 + q for the nibbles at bits 0-3 of a half, 1024 + 16 q for
  those at bits 4-7 (the halves of a 32-bit word are planes p and p + 4);
- four HSUB2 remove 1024 + zero (or 1024 + 16 zero), exactly: code - zero, times 16 for the
  odd planes, whose inputs are divided by 16 ahead (a power of two, exact);
- four HFMA2 multiply by the inputs and add, in float16.
Two words (8 products per half) go to float32 together, and one FFMA per two words applies the
group's scale: about 2.6 instructions per weight in all.

**The second packed form** (`GemvConfig.packed` 2, `ZERO_LAST`): the nibbles are only masked,
not OR'ed into 1024: a half whose exponent bits are zero is the subnormal q * 2**-24 (bits 0-3)
or 16 q * 2**-24 (bits 4-7), exactly, with no offset to remove. So the HSUB2s go: per word four
LOP3, one shift and four HFMA2 (9 instructions for 8 weights against 13), and the zero is
applied once per group and output after the sums: sum (q - z) x = 2**24 sum (q 2**-24) x -
z sum x, with each block's sum of inputs made once per program. The inputs are scaled into
[2**14, 2**15) instead (the products are 2**24 times smaller; no float16 sum can come near
overflow). Each product and each sum of 8 is still rounded to float16, but products of inputs
below about 2**-7 of their block's largest are subnormal, rounded to a fixed step rather than
to 11 bits: up to about 1.5 times the first form's error (measured on the CPU: 4.5-9e-4 of
the output's norm in float16 outputs against 4.1-6.2e-4). The float32 sums hold 2**-24 of the
result until the end, so inputs near 1e-36 lose bits (no activation is that small).
`benchmarks/sass_counts.py` counts 2.00 instructions per weight at 512 x 128 (2.58 for the
first form) and 2.54 at 256 x 128 (3.09), with more registers (166 and 113 against 128 and 96).

Range: each program scales its 128 inputs of a block by a power of two so that the largest
lies in [128, 256): then |code - zero| <= 16 keeps every half's sum of 8 products below 2**15,
far from float16's overflow, and small inputs keep their bits; the power of two is undone in
the group's scale. So the result is the dequantized product with each product and each sum of
8 rounded to float16 (11 bits) before the float32 sums: within bfloat16's rounding of the
output, a little over float16's. Float32 activations take the float32 form.

The packing uses inline PTX (`lop3`, `sub/fma.rn.f16x2`, `cvt.rn.f16x2.f32`); under
TRITON_INTERPRET=1 the same bits go through Triton's integer and float16 operations (`PTX`
False), so the CPU tests cover the pairing of planes, halves and inputs.

Both forms split K over SPLIT_K programs and reduce in `gemv_split._finish` (the same bits
whatever order the programs ran in); launch shapes come from `quant_gemv.config_for`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import check_contiguous, check_shape, check_tensor
from braid.kernels.gemv_split import _block_and_split, _finish, grid, split_length
from braid.kernels.int4_pairs import (
    PACKED_WORDS,
    PackedInputs,
    _block_inputs,
    _packed_block_inputs,
    _words_sum,
)
from braid.kernels.prologue import _check_norm_args, _check_prologue
from braid.kernels.quant_gemm import MAGIC_BITS
from braid.kernels.quant_gemv import (
    GemvConfig,
    GemvWorkspace,
    _check_out,
    _check_row,
    _launch_meta,
    _scratch,
    config_for,
)
from braid.kernels.quant_reference import PLANAR_BLOCK
from braid.kernels.skinny_gemm import NORM_BLOCK_MAX, _rmsnorm_rstd

__all__ = ["int4_gemv"]


@triton.jit
def _plane(words, hi, P: tl.constexpr, zero, magic):
    """Nibble P of each word as float32 `code - zero`, exactly: the nibble, left in place
    (bits 4j..4j+3 of the word or of its upper half, j = P % 4), OR'ed into the mantissa of
    1.5 * 2**(23 - 4j) reads as that float plus the code; subtracting the float plus the zero
    leaves code - zero. `magic` is the bits of 1.5 * 2**23 passed at run time: held in a
    register, the mask and the OR fold into one LOP3 (two immediates would take two)."""
    J: tl.constexpr = P % 4
    if P < 4:
        src = words
    else:
        src = hi
    bits = (src & (0xF << (4 * J))) | (magic - ((4 * J) << 23))
    offset = zero + 12582912.0 / (16.0**J)
    return bits.to(tl.float32, bitcast=True) - offset[:, None]


@triton.jit
def _weights_then_wait(Q, rows, rmask, KB, first, SPLIT_BLOCKS, PDL: tl.constexpr,
                       LINES: tl.constexpr):  # fmt: skip
    """Under PDL (`braid.kernels.pdl`): ask L2 for this program's first weights (LINES lines
    of 128 bytes, two 128-input blocks each, of every row of its split: words no kernel
    writes), then wait for the kernel before to end. x, the norm's residual and the split-K
    counters are touched only after."""
    if PDL:
        start = tl.minimum(first, KB - 1)
        last = start + tl.minimum(SPLIT_BLOCKS, KB - start) - 1
        blocks = tl.minimum(start + 2 * tl.arange(0, LINES), last)
        safe = tl.where(rmask, rows, 0).to(tl.int64)
        pdl.prefetch_l2(Q + safe[:, None] * (KB * 16) + blocks[None, :] * 16)
        pdl.wait(PDL)


@triton.jit
def _int4_gemv_kernel(
    X,
    Q,
    Meta,
    Bias,
    Out,
    Partials,
    Counters,
    N,
    K,
    KB,
    GROUPS,
    SPLIT_BLOCKS,
    magic,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    SPLITS_FIRST: tl.constexpr,
):
    # Planes per group segment: a group spans whole 128-input blocks, or whole planes of one.
    PPS: tl.constexpr = 8 if GROUP % 128 == 0 else (GROUP // 16 if 128 % GROUP == 0 else 1)
    block, split = _block_and_split(SPLITS_FIRST)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w16 = tl.arange(0, 16)
    q_rows = Q + rows.to(tl.int64)[:, None] * (KB * 16) + w16[None, :]
    first = split * SPLIT_BLOCKS
    _weights_then_wait(Q, rows, rmask, KB, first, SPLIT_BLOCKS, PDL, PREFETCH_LINES)
    end = tl.minimum(first + SPLIT_BLOCKS, KB)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for b0 in tl.range(first, end, SUBS, num_stages=STAGES):
        for sb in tl.static_range(SUBS):
            b = b0 + sb
            if EVEN_K:
                wmask = rmask[:, None] | EVEN_N
            else:
                # Past the split's end (SUBS does not divide it): masked off, as tensors.
                wmask = rmask[:, None] & ((w16 * 0 + b) < end)[None, :]
            wq = tl.load(q_rows + b * 16, mask=wmask, other=0)
            hi = wq >> 16
            for seg in tl.static_range(8 // PPS):
                g = rows * 0 + (b * 128 + seg * PPS * 16) // GROUP
                if EVEN_K:
                    gmask = rmask | EVEN_N
                else:
                    gmask = rmask & ((rows * 0 + b) < end) & (g < GROUPS)
                # (zero << 16) | float16 bits of the scale, one load for both.
                meta = tl.load(Meta + g * N + rows, mask=gmask, other=0)
                scale = (meta & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
                zero = ((meta >> 16) | magic).to(tl.float32, bitcast=True) - 12582912.0
                part = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
                for j in tl.static_range(PPS):
                    ks = b * 128 + (seg * PPS + j) * 16 + w16
                    if EVEN_K:
                        x = tl.load(X + ks)
                    else:
                        x = tl.load(X + ks, mask=ks < K, other=0.0)
                    part += _plane(wq, hi, seg * PPS + j, zero, magic) * x.to(tl.float32)[None, :]
                acc += part * scale.to(tl.float32)[:, None]
    _finish(
        tl.sum(acc, axis=1), block, split, rows, rmask, Out, Bias, Bias, 1.0, Partials, Counters, N,
        SPLIT_K, HAS_BIAS, False,
    )  # fmt: skip


@triton.jit
def _int4_gemv_f16x2_kernel(
    X,
    Q,
    Meta,
    Bias,
    Out,
    Partials,
    Counters,
    NormW,
    Residual,
    ResidualOut,
    eps,
    N,
    K,
    KB,
    SPLIT_BLOCKS,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
    ACT: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    SPLITS_FIRST: tl.constexpr,
    ZERO_LAST: tl.constexpr,
    XP,
    XG,
    X_PACKED: tl.constexpr,
):
    block, split = _block_and_split(SPLITS_FIRST)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w16 = tl.arange(0, 16)
    q_rows = Q + rows.to(tl.int64)[:, None] * (KB * 16) + w16[None, :]
    first = split * SPLIT_BLOCKS
    _weights_then_wait(Q, rows, rmask, KB, first, SPLIT_BLOCKS, PDL, PREFETCH_LINES)
    # ZERO_LAST: sum over groups of zero * scale * (the group's sum of inputs), taken off at the
    # end (the products are of the codes alone).
    zacc = tl.zeros([BLOCK_N], dtype=tl.float32)
    rstd = 1.0
    if NORM:
        rstd = _rmsnorm_rstd(X, Residual, ResidualOut, K, eps, HAS_RESIDUAL, NORM_BLOCK)
    end = tl.minimum(first + SPLIT_BLOCKS, KB)
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.float32)
    for b0 in tl.range(first, end, SUBS, num_stages=STAGES):
        for sb in tl.static_range(SUBS):
            b = b0 + sb
            if EVEN_K:
                wmask = rmask[:, None] | EVEN_N
                xmask = w16 >= 0
                gmask = rmask | EVEN_N
            else:
                # Past the split's end (SUBS does not divide it): masked off, scale 0.
                wmask = rmask[:, None] & ((w16 * 0 + b) < end)[None, :]
                xmask = (w16 * 0 + b) < end
                gmask = rmask & ((rows * 0 + b) < end)
            wq = tl.load(q_rows + b * 16, mask=wmask, other=0)
            we, wo = tl.split(tl.reshape(wq, [BLOCK_N, 8, 2]))
            if X_PACKED:
                ae, ao, be, bo, ce, co, de, do, g, xsum = _packed_block_inputs(XP, XG, b, end)
            else:
                ae, ao, be, bo, ce, co, de, do, g, xsum = _block_inputs(
                    X, NormW, Residual, b, xmask, rstd, K, ACT, NORM, HAS_RESIDUAL, PTX, ZERO_LAST
                )
            grp = rows * 0 + b // (GROUP // 128)
            # (zero << 16) | float16 bits of the scale, one load for both.
            meta = tl.load(Meta + grp * N + rows, mask=gmask, other=0)
            scale = (meta & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            zero = meta >> 16
            zlo = zero * 0x10001 + 0x64006400
            zhi = zero * 0x100010 + 0x64006400
            s = _words_sum(
                we, wo, (ae[None, :], be[None, :], ce[None, :], de[None, :]),
                (ao[None, :], bo[None, :], co[None, :], do[None, :]), zlo[:, None], zhi[:, None],
                PTX, ZERO_LAST,
            )  # fmt: skip
            acc += s * (scale * g)[:, None]
            if ZERO_LAST:
                zacc += zero.to(tl.float32) * scale * xsum
    y = tl.sum(acc, axis=1)
    if ZERO_LAST:
        # The products were of q * 2**-24: y is sum (q - zero) x = 2**24 * sum q x - zero sum x.
        y = y * 16777216.0 - zacc
    _finish(
        y, block, split, rows, rmask, Out, Bias, Bias, 1.0, Partials, Counters, N,
        SPLIT_K, HAS_BIAS, False,
    )  # fmt: skip


# ---- launcher -----------------------------------------------------------------------------------


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    meta: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    workspace: GemvWorkspace | None = None,
    packed_inputs: PackedInputs | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for one row x [1, K] and the int4 weight W[n, k] = (q - zero[g, n]) *
    scale[g, n], g = k // group_size, held in the planar layout: `qweight` int32
    [N, ceil(K / 128) * 16] (`quant_reference.pack_int4_planar`) and `meta` int32 [K / G, N]
    (`quant_reference.pack_int4_meta`: the zero and the float16 scale of each group and
    output). Summed in float32, each group's sum scaled once, rounded once to x's dtype after
    the bias; the bits do not depend on the order the programs run in. `config` overrides the
    table's launch shape (`quant_gemv.config_for`).

    A `packed` configuration, for bfloat16 or float16 x and groups of whole 128-input blocks,
    forms the products in float16 pairs (each product and each sum of 8 rounded to float16
    before the float32 sums; see the module docstring): `packed` 1 takes the zero off each
    code, 2 reads the codes as float16 subnormals and takes the zero off once per group.
    Elsewhere the float32 form runs.

    Prologues, as `skinny_linear`'s (they run the packed form, with the configuration's tile,
    and need what it needs): `activation="silu_and_mul"`: x is [1, 2K] = [gate | up] and the
    input is `silu_and_mul(x)`, rounded as that kernel rounds it, never stored.
    `norm_weight` ([K]): the input is `rmsnorm(x, norm_weight, eps, residual)`'s first result;
    with `residual` ([1, K]), `residual_out` ([1, K], overlapping none of x, residual, out)
    receives `x + residual` rounded to x's dtype, bit for bit `rmsnorm`'s second result.

    `packed_inputs` (`int4_pairs.pack_int4_inputs(x, config.packed)`, no prologue): the packed
    form loads x's float16 pairs from there instead of making them in every program; the
    same bits."""
    check_tensor("x", x, ndim=2)
    _check_prologue(activation, norm_weight)
    k = x.shape[1] // 2 if activation is not None else x.shape[1]
    if activation is not None and (x.shape[0] != 1 or x.shape[1] != 2 * k):
        raise ValueError(
            f"x must have shape (1, 2 * K) ([gate | up]) with activation={activation!r}, "
            f"got {tuple(x.shape)}"
        )
    _check_row(x[:, :k], k)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size % 16:
        raise ValueError(f"group_size must be a multiple of 16, got {group_size!r}")
    if group_size < 16 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide K = {k} (x's columns)")
    kb = triton.cdiv(k, PLANAR_BLOCK)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device)
    check_contiguous("qweight", qweight)
    n = qweight.shape[0]
    check_shape("qweight", qweight, (n, kb * 16))
    groups = k // group_size
    check_tensor("meta", meta, ndim=2, dtypes=(torch.int32,), device=x.device)
    check_shape("meta", meta, (groups, n))
    check_contiguous("meta", meta)
    out = _check_out(x, n, bias, out, x.dtype)
    norm = _check_norm_args(x, k, norm_weight, eps, residual, residual_out, out)
    packable = x.dtype != torch.float32 and group_size % PLANAR_BLOCK == 0
    fused = norm or activation is not None
    if fused and not packable:
        raise ValueError(
            "a fused prologue runs in float16 pairs: x must be bfloat16 or float16 and "
            f"group_size a multiple of {PLANAR_BLOCK}, got {x.dtype} and {group_size}"
        )
    cfg = config or config_for("int4", n, k, x.device)
    if packed_inputs is not None:
        if fused or not packable or cfg.packed == 0 or packed_inputs.form != cfg.packed:
            raise ValueError(
                "packed_inputs go to the packed form alone, without a prologue, packed for "
                f"its form: config.packed is {cfg.packed}, the inputs' form "
                f"{packed_inputs.form}, prologue {fused}, x {x.dtype}, group_size {group_size}"
            )
        for name, t, dtype, shape in (
            ("words", packed_inputs.words, torch.int32, (kb, PACKED_WORDS)),
            ("scales", packed_inputs.scales, torch.float32, (kb, 2)),
        ):
            check_tensor(f"packed_inputs.{name}", t, ndim=2, dtypes=(dtype,), device=x.device)
            check_shape(f"packed_inputs.{name}", t, shape)
            check_contiguous(f"packed_inputs.{name}", t)
    subs = cfg.block_k // PLANAR_BLOCK
    if subs < 1 or cfg.block_k % PLANAR_BLOCK:
        raise ValueError(f"config.block_k must be a multiple of 128, got {cfg.block_k}")
    split_blocks = split_length(kb, cfg.split_k, subs)
    partials, counters = _scratch(x, n, cfg, workspace)
    launch = grid(triton.cdiv(n, cfg.block_n), cfg.split_k, cfg.splits_first)
    even_k = k == kb * PLANAR_BLOCK and split_blocks * cfg.split_k == kb
    common = dict(
        GROUP=group_size, BLOCK_N=cfg.block_n, SUBS=subs, SPLIT_K=cfg.split_k,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=even_k, HAS_BIAS=bias is not None,
        **_launch_meta(cfg, "int4", x.device, split_blocks * 64),
    )  # fmt: skip
    if (cfg.packed or fused) and packable:
        _int4_gemv_f16x2_kernel[launch](
            x, qweight, meta, bias if bias is not None else x, out, partials, counters,
            norm_weight if norm else x, residual if residual is not None else x,
            residual_out if residual_out is not None else x, float(eps), n, k, kb,
            split_blocks, PTX=not triton.knobs.runtime.interpret, ACT=activation is not None,
            NORM=norm, HAS_RESIDUAL=residual is not None,
            NORM_BLOCK=min(triton.next_power_of_2(k), NORM_BLOCK_MAX) if norm else 1,
            ZERO_LAST=cfg.packed == 2,
            XP=packed_inputs.words if packed_inputs is not None else x,
            XG=packed_inputs.scales if packed_inputs is not None else x,
            X_PACKED=packed_inputs is not None, **common,
        )  # fmt: skip
        return out
    _int4_gemv_kernel[launch](
        x, qweight, meta, bias if bias is not None else x, out, partials, counters, n, k, kb,
        groups, split_blocks, MAGIC_BITS, **common,
    )  # fmt: skip
    return out
