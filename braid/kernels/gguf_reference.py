"""GGUF's quantized blocks in plain torch: their byte layouts, what they decode to, and the
dequantize-then-matmul reference of `braid.kernels.gguf_linear`. Torch alone (no Triton), so
the runtime's loader and CPU paths import it without Triton.

A GGUF tensor of R rows and K columns is stored as R rows of K / B blocks, each block
`block_bytes` bytes (ggml's `block_q*` structs, little-endian; gguf-py's
`gguf.quants.*.dequantize_blocks` and llama.cpp's `dequantize_row_q*` are the references):

| type | B | bytes | a block | element i |
| --- | --- | --- | --- | --- |
| Q4_0 | 32 | 18 | d f16, qs[16] | (q - 8) d; q = qs[i] & 15 (i < 16), qs[i - 16] >> 4 |
| Q4_1 | 32 | 20 | d f16, m f16, qs[16] | q d + m, q as Q4_0 |
| Q8_0 | 32 | 34 | d f16, qs[32] int8 | qs[i] d |
| Q4_K | 256 | 144 | d f16, dmin f16, scales[12], qs[128] | q (d sc[j]) - dmin mn[j], j = i / 32 |
| Q6_K | 256 | 210 | ql[128], qh[64], scales[16] int8, d f16 | (q - 32) (d sc[j]), j = i / 16 |

Q4_K: sub-block j's 6-bit scale and min are packed in `scales` (j < 4: the low 6 bits of bytes
j and j + 4; j >= 4: the nibbles of byte j + 4 with the top 2 bits of bytes j - 4 and j);
its codes are the nibbles of qs[32 c .. 32 c + 31] (low: sub-block 2c, high: 2c + 1).
Q6_K: element i of 128-element half h, at 64 n + t (n = 0, 1; t < 64), is the nibble n of
ql[64 h + t] with bits 4..5 from qh[32 h + t % 32] >> 2 (2 n + t / 32).

Every type decodes to one form, `Planes`: integer codes c [R, K] (4-bit unsigned for the
Q4 types, signed 8-bit for Q8_0, unsigned 6-bit for Q6_K), and per group of G elements
(32, or 16 for Q6_K) a float32 `scale` and `offset`, with W = c * scale + offset. Every
value in the planes is exact in float32 (the products of a float16 and small integers), and
so is c * scale + offset: the planes reproduce gguf-py's float32 dequantization bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from braid.kernels._checks import check_contiguous, check_shape, check_tensor

# type name -> (elements per block, bytes per block)
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
# Elements that share one scale and offset in the planes.
GROUP_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 32, "Q6_K": 16}
# Code width in the planes (4: packed two a byte by the kernels; 8: one a byte).
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q4_K": 4, "Q6_K": 8}
# Types whose planes are exact in float16 (the kernel then reads half the bytes of them).
FP16_PLANES = ("Q4_0", "Q4_1", "Q8_0")
# Codes' zero points in the kernel planes, W = (code - zero) * scale + offset: Q4_0's offset
# -8 * scale and Q6_K's -32 * scale taken into the codes, so no offset plane is held or read
# (the kernels subtract the zero point with the constant that turns a code into a float).
ZERO_POINTS = {"Q4_0": 8, "Q6_K": 32}
# Types whose kernel planes have no offset plane (the kernel then skips it).
NO_OFFSET = ("Q4_0", "Q8_0", "Q6_K")


# Elements of a K-quant's super-block, whose float16 d (and dmin) scale its groups' integers.
SUPER_BLOCK = 256


@dataclass
class Planes:
    """A quantized tensor decoded: W[r, k] = codes[r, k] * scale[r, k // G] + offset[r, k // G].
    `codes`: uint8 (unsigned types) or int8 (Q8_0) [R, K]; `scale`, `offset`: float32
    [R, K / G]. The K-quants also keep the factors of those: `factors` = (sub-block scales
    (uint8 Q4_K, int8 Q6_K) [R, K / G], their super-blocks' d float16 [R, K / 256], and for
    Q4_K the mins uint8 [R, K / G] and -dmin float16 [R, K / 256]): scale = sc * d[g // (256
    / G)], offset = mn * (-dmin)[g // (256 / G)]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int
    factors: tuple[torch.Tensor, ...] | None = None

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        r, k = self.codes.shape
        c = self.codes.float().reshape(r, k // g, g)
        return (c * self.scale[..., None] + self.offset[..., None]).reshape(r, k)


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of K elements of `qtype`; `ValueError` if K is not whole blocks."""
    block, size = BLOCK_LAYOUTS[qtype]
    if k % block:
        raise ValueError(f"{qtype} rows hold whole blocks of {block} elements, got {k}")
    return k // block * size


def row_elements(qtype: str, nbytes: int) -> int:
    """Elements of one row of `nbytes` bytes of `qtype`."""
    block, size = BLOCK_LAYOUTS[qtype]
    if nbytes % size:
        raise ValueError(f"{qtype} rows are whole blocks of {size} bytes, got {nbytes}")
    return nbytes // size * block


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float32, read as little-endian float16."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2 n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [R, row bytes] -> [R, blocks, block bytes]."""
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"{qtype} blocks must be uint8 [rows, bytes], got {raw.dtype} {raw.shape}")
    _, size = BLOCK_LAYOUTS[qtype]
    row_elements(qtype, raw.shape[1])
    return raw.reshape(raw.shape[0], -1, size)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes [..., 12] -> (scales, mins) [..., 8], 6 bits each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def decode(raw: torch.Tensor, qtype: str) -> Planes:
    """Raw blocks uint8 [R, row bytes] of `qtype` -> their `Planes` (on raw's device)."""
    b = _blocks(raw, qtype)
    r, nb = b.shape[:2]
    factors = None
    if qtype in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., -16:])
        offset = -8 * d if qtype == "Q4_0" else _f16(b[..., 2:4])
        scale = d
    elif qtype == "Q8_0":
        scale = _f16(b[..., 0:2])
        codes = b[..., 2:].contiguous().view(torch.int8)
        offset = torch.zeros_like(scale)
    elif qtype == "Q4_K":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        scale = (d[..., None] * sc.float()).reshape(r, nb * 8)
        offset = -(dmin[..., None] * mn.float()).reshape(r, nb * 8)
        qs = b[..., 16:].reshape(r, nb, 4, 32)
        codes = _nibbles(qs)
        factors = (sc.reshape(r, nb * 8), d.half(), mn.reshape(r, nb * 8), (-dmin).half())
    elif qtype == "Q6_K":
        ql = b[..., 0:128].reshape(r, nb, 2, 64)
        qh = b[..., 128:192].reshape(r, nb, 2, 1, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[..., 208:210])
        low = _nibbles(ql)  # [r, nb, 2, 128]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)
        high = ((qh >> shifts[:, None]) & 3).reshape(r, nb, 2, 128)
        codes = low | (high << 4)
        scale = (d[..., None] * sc).reshape(r, nb * 16)
        offset = -32 * scale
        factors = (sc.to(torch.int8).reshape(r, nb * 16), d.half())
    else:
        raise ValueError(f"no block layout for GGUF type {qtype}")
    codes = codes.reshape(r, -1)
    g = GROUP_SIZES[qtype]
    return Planes(codes, scale.reshape(r, -1), offset.reshape(r, -1), g, factors)


def dequantize(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """Raw blocks uint8 [R, row bytes] -> the float32 [R, K] tensor they hold."""
    return decode(raw, qtype).dequantize()


# ---- the kernel's layout ------------------------------------------------------------------


@dataclass
class KernelPlanes:
    """`braid.kernels.gguf_linear`'s operands for one weight of N rows, K columns:
    `codes`: int32 [N, K / 8] (4-bit codes packed along K, the first in the lowest nibble) or
    int8 / uint8 [N, K]; `scale`, `offset`: [K / G, N] float16 (Q4_0, Q4_1, Q8_0: the
    blocks' own d and m); `offset` None where there is none (`NO_OFFSET`); `zero`: the
    codes' zero point, W[n, k] = (code - zero) * scale + offset (`ZERO_POINTS`). The K-quants
    hold their scales as the file does: `scale` (and `offset`) are the sub-blocks' integers
    (uint8 or int8) and `super_scale` (`super_offset`) float16 [K / 256, N] their
    super-blocks' factors, scale = scale * super_scale[g // (256 / G)] (exact in float32).
    Bits a weight: Q4_0 4.5, Q4_1 5, Q8_0 8.5, Q4_K 4.625, Q6_K 8.5625 (its 6-bit codes as
    bytes)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    bits: int
    zero: int = 0
    super_scale: torch.Tensor | None = None
    super_offset: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The planes held, by name (the layer's parameters)."""
        names = ("codes", "scale", "offset", "super_scale", "super_offset")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(self, device: torch.device | str) -> KernelPlanes:
        """A copy with every plane on `device`."""
        return replace(self, **{n: t.to(device) for n, t in self.tensors().items()})

    def check(self, k: int, device: torch.device) -> int:
        """N, once the planes are checked as `gguf_linear`'s for K inputs on `device`
        (`ValueError` naming the first wrong one)."""
        g, bits, codes = self.group_size, self.bits, self.codes
        if g not in (16, 32) or k % g:
            raise ValueError(f"planes.group_size must be 16 or 32 and divide K = {k}, got {g}")
        if bits not in (4, 8):
            raise ValueError(f"planes.bits must be 4 or 8, got {bits!r}")
        dtypes = (torch.int32,) if bits == 4 else (torch.int8, torch.uint8)
        check_tensor("planes.codes", codes, ndim=2, dtypes=dtypes, device=device)
        n = codes.shape[0]
        check_shape("planes.codes", codes, (n, k // 8 if bits == 4 else k))
        check_contiguous("planes.codes", codes)
        if n < 1:
            raise ValueError(f"planes.codes must have at least one row, got {tuple(codes.shape)}")
        factored = self.super_scale is not None
        if factored and k % SUPER_BLOCK:
            raise ValueError(f"planes with super-block factors need K a multiple of 256, got {k}")
        if (self.super_offset is not None) != (factored and self.offset is not None):
            raise ValueError(
                "planes.super_offset must be given exactly when planes.offset and "
                "planes.super_scale both are"
            )
        groups = (torch.int8, torch.uint8) if factored else (torch.float16,)
        for name, shape, dtypes in (
            ("scale", (k // g, n), groups),
            ("offset", (k // g, n), groups),
            ("super_scale", (k // SUPER_BLOCK, n), (torch.float16,)),
            ("super_offset", (k // SUPER_BLOCK, n), (torch.float16,)),
        ):
            t = getattr(self, name)
            if t is None and name != "scale":
                continue
            check_tensor(f"planes.{name}", t, ndim=2, dtypes=dtypes, device=device)
            check_shape(f"planes.{name}", t, shape)
            check_contiguous(f"planes.{name}", t)
        return n


def kernel_planes(planes: Planes, qtype: str) -> KernelPlanes:
    from braid.kernels.quant_reference import pack_int4

    bits = CODE_BITS[qtype]
    codes = pack_int4(planes.codes) if bits == 4 else planes.codes.contiguous()
    zero = ZERO_POINTS.get(qtype, 0)
    if qtype in NO_OFFSET:
        # The offset is -zero * scale (zero for Q8_0): held in the zero point instead. A
        # non-finite scale (a broken block) still loads, its weights inf or NaN.
        same = (planes.offset == -zero * planes.scale) | ~torch.isfinite(planes.scale)
        if not bool(same.all()):
            raise ValueError(f"{qtype} planes must have offset {-zero} * scale")

    def plane(t: torch.Tensor) -> torch.Tensor:
        return t.T.contiguous()

    if planes.factors is not None:
        sc, d, *mins = planes.factors
        offset, super_offset = (plane(mins[0]), plane(mins[1])) if mins else (None, None)
        return KernelPlanes(
            codes, plane(sc), offset, planes.group_size, bits, zero, plane(d), super_offset
        )
    if qtype not in FP16_PLANES:
        raise ValueError(f"{qtype} planes need their K-quant factors (decode keeps them)")
    scale = plane(planes.scale).half()
    offset = None if qtype in NO_OFFSET else plane(planes.offset).half()
    return KernelPlanes(codes, scale, offset, planes.group_size, bits, zero)


def dequantize_kernel_planes(p: KernelPlanes) -> torch.Tensor:
    """The float32 [N, K] weight `KernelPlanes` hold."""
    from braid.kernels.quant_reference import unpack_int4

    codes = unpack_int4(p.codes) if p.bits == 4 else p.codes
    codes = codes.to(torch.int16) - p.zero if p.zero else codes
    sub = SUPER_BLOCK // p.group_size

    def factor(t: torch.Tensor, per_super: torch.Tensor | None) -> torch.Tensor:
        t = t.float()
        return t if per_super is None else t * per_super.float().repeat_interleave(sub, dim=0)

    scale = factor(p.scale, p.super_scale).T
    offset = torch.zeros_like(scale) if p.offset is None else factor(p.offset, p.super_offset).T
    return Planes(codes, scale, offset, p.group_size).dequantize()


def gguf_linear_reference(
    x: torch.Tensor,
    planes: KernelPlanes,
    bias: torch.Tensor | None = None,
    *,
    as_kernel: bool = True,
) -> torch.Tensor:
    """`x @ W.T + bias` for the weight `planes` hold, in float32, rounded once to x's dtype.
    `as_kernel`: with `gguf_linear`'s rounding points, which from two rows of x rounds the
    weight to x's dtype first (exact for float32); False: the exact weight at any row count."""
    w = dequantize_kernel_planes(planes)
    if as_kernel and x.numel() > x.shape[-1]:
        w = w.to(x.dtype).float()
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def random_blocks(
    qtype: str, rows: int, k: int, generator: torch.Generator, *, scale: float = 0.02
) -> torch.Tensor:
    """Valid random blocks uint8 [rows, row bytes] of `qtype` (for tests and benchmarks):
    random codes and sub-block scales, the float16 fields set to finite values near
    `scale` / 16 (so the weights are about `scale` in size)."""
    block, size = BLOCK_LAYOUTS[qtype]
    nb = k // block
    b = torch.randint(0, 256, (rows, row_bytes(qtype, k)), generator=generator, dtype=torch.uint8)
    b = b.reshape(rows, nb, size)

    def f16(n: int, sign: bool = False) -> torch.Tensor:
        v = (torch.rand(rows, nb, n, generator=generator) + 0.5) * (scale / 16)
        if sign:
            v = v * torch.where(torch.rand(rows, nb, n, generator=generator) < 0.5, -1, 1)
        return v.half().view(torch.uint8).reshape(rows, nb, 2 * n)

    if qtype in ("Q4_0", "Q8_0"):
        b[..., 0:2] = f16(1)
    elif qtype == "Q4_1":
        b[..., 0:2] = f16(1)
        b[..., 2:4] = f16(1, sign=True)
    elif qtype == "Q4_K":
        b[..., 0:4] = f16(2)
    elif qtype == "Q6_K":
        b[..., 208:210] = f16(1)
    return b.reshape(rows, -1)
