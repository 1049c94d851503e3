"""Plain-torch forms of the quantized linear kernels: the layouts they read, packing helpers,
and dequantize-then-matmul references. Torch alone (no Triton): the kernels re-export them as
their `*_reference`, and `braid.runtime.quantization` builds its layouts and CPU references
from them.

Layouts (the kernels' own, which every checkpoint format is converted into at load):

- int4, group-wise (W4A16): `qweight` int32 [N, K / 8], nibble i (bits 4i..4i+3) of word j of
  row n holding the code q[n, 8j + i] in 0..15; `scales` float [K / G, N]; `zeros` uint8
  [K / G, N]. The weight is W[n, k] = (q[n, k] - zeros[k // G, n]) * scales[k // G, n].
- int8, per output channel (W8A16): `weight` int8 [N, K]; `scales` float [N]; W = q * scales.
- int4, planar (the GEMV and small-batch kernels' form of the same weights, made once at load
  by `pack_int4_planar` and `pack_int4_meta`): K padded to a multiple of 128 with zero codes,
  then per row and per block b of 128 inputs, word 16 b + w holds in nibble p the code of input
  128 b + 16 p + w. Each of a word's 8 nibbles multiplies its own contiguous run of 16 inputs,
  so a kernel turns a tile of words into 8 tiles of codes with a mask each (no shuffle of codes
  or inputs). `meta` int32 [K / G, N] holds each group's zero and float16 scale.
- fp8 e4m3 (W8A8): `weight` float8_e4m3fn [N, K] with `scales` float32 [N]; activations are
  scaled per token (row) by max|x| / 448 and rounded to e4m3 before the product.
"""

from __future__ import annotations

import torch

PACK = 8  # int4 codes per int32 word
PLANAR_BLOCK = 128  # inputs per block of the planar int4 layout: 16 words of 8 planes
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A row of zeros still gets a positive scale (its codes are all zero whatever the scale).
FP8_MIN_SCALE = 1e-12

_SHIFTS = tuple(4 * i for i in range(PACK))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] integer codes in 0..15 (C a multiple of 8) -> int32 [R, C / 8], eight codes a
    word along the last dimension, the first in the lowest nibble."""
    r, c = codes.shape
    if c % PACK:
        raise ValueError(f"codes must have a multiple of {PACK} columns, got shape {(r, c)}")
    nibbles = codes.to(torch.int64).reshape(r, c // PACK, PACK)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=codes.device)
    words = (nibbles << shifts).sum(-1)
    # Reinterpret as two's complement: bit 31 set means negative in int32.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 codes [R, 8 C], the inverse of `pack_int4`."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(words.shape[0], -1).to(torch.uint8)


def pack_int4_planar(qweight: torch.Tensor) -> torch.Tensor:
    """The int4 layout's `qweight` int32 [N, K / 8] -> the planar layout's int32
    [N, ceil(K / 128) * 16] (see the module docstring)."""
    n = qweight.shape[0]
    codes = unpack_int4(qweight)
    k = codes.shape[1]
    padded = -(-k // PLANAR_BLOCK) * PLANAR_BLOCK
    codes = torch.nn.functional.pad(codes, (0, padded - k))
    blocks = codes.reshape(n, padded // PLANAR_BLOCK, PACK, PLANAR_BLOCK // PACK)
    return pack_int4(blocks.transpose(2, 3).reshape(n, padded))


def pack_int4_meta(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The int4 layout's `scales` [G', N] (values a float16 holds) and `zeros` uint8 [G', N]
    -> int32 [G', N]: `(zero << 16) | float16 bits of the scale`, what the planar kernels
    read (one load for both)."""
    bits = scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (zeros.to(torch.int32) << 16) | bits


def unpack_int4_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4_meta`: (scales float16, zeros uint8)."""
    scales = (meta & 0xFFFF).to(torch.int16).view(torch.float16)
    return scales, (meta >> 16).to(torch.uint8)


def unpack_int4_planar(words: torch.Tensor, k: int) -> torch.Tensor:
    """The planar layout's int32 [N, Kp / 8] -> uint8 codes [N, k], the inverse of
    `pack_int4_planar` for an input size k."""
    n, width = words.shape
    codes = unpack_int4(words).reshape(n, width // 16, PLANAR_BLOCK // PACK, PACK)
    return codes.transpose(2, 3).reshape(n, width * PACK)[:, :k]


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 [N, K] weight the int4 layout holds."""
    q = unpack_int4(qweight).float()
    z = zeros.float().repeat_interleave(group_size, dim=0).T
    s = scales.float().repeat_interleave(group_size, dim=0).T
    return (q - z) * s


def int4_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for the int4 layout's W, in float32, rounded once to x's dtype."""
    y = x.float() @ dequantize_int4(qweight, scales, zeros, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ (weight * scales[:, None]).T + bias` in float32, rounded once to x's dtype."""
    y = x.float() @ (weight.float() * scales.float()[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def per_token_quant_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], float32 scales [M, 1]) with x ~= codes * scales: each
    row's scale is max|row| / 448 (at least FP8_MIN_SCALE), its codes x * (1 / scale) rounded
    to nearest even.

    Every step is one IEEE-rounded float32 operation on tensors, so the CPU and a GPU give the
    same bits, and so do the kernels: a division by a Python number would not do (on CUDA,
    torch multiplies by its float32 reciprocal instead, which can differ in the last bit), and
    the reciprocal is taken once per row so the kernels multiply each element."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scales = torch.div(amax, torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    inverse = torch.div(torch.ones_like(scales), scales)
    codes = (xf * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W8A8 fp8: x quantized per token (`per_token_quant_fp8_reference`), the e4m3 products
    summed in float32, times both scales, plus bias, rounded once to `out_dtype` (x's dtype by
    default)."""
    codes, x_scales = per_token_quant_fp8_reference(x)
    y = (codes.float() @ weight.float().T) * x_scales * scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
