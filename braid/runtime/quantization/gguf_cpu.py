"""GGUF blocks on the CPU: torch's int4 weight-packed matmul (`_weight_int4pack_mm_for_cpu`,
bfloat16 activations, groups of 32 along K, each with a bfloat16 scale and offset: w = (u - 8)
* scale + offset for a 4-bit code u), which part 1 measured fastest for 4-bit weights on the
development CPU. Every supported type maps onto it with its codes exact; what is not exact is
named per type:

- Q4_0, Q4_1, Q4_K (4-bit codes, a scale s and offset o per 32): the table holds (s, o + 8 s),
  rounded to bfloat16. Q4_0's offset -8 s makes the table offset exactly 0, so its weights are
  q * bf16(s); Q4_1's and Q4_K's offsets are rounded too (within 1/64 of a step, plus the
  scale's rounding).
- Q8_0 (signed 8-bit codes q, a scale per 32): q = 16 h + l (h in -8..7, l in 0..15) as two
  4-bit halves of a doubled K: the first K columns hold h + 8 with scale 16 s, the next K hold
  l with scale s and offset 8 s, and x is fed twice. Exact but for s rounded to bfloat16.
- Q6_K (6-bit codes u, w = (u - 32) s per 16): u = 16 h + l (h in 0..3) in groups of 32 of a
  doubled K, each sub-block's 16 codes 2 h + 5 beside its 16 codes l, one scale s, offset 0,
  with x fed as 8 x beside x: 8 (2 h + 5 - 8) + (l - 8) = u - 32. Exact but for s rounded to
  bfloat16 (8 x is exact).

The doubled K costs Q8_0 and Q6_K about twice a 4-bit layer's time. torch's kernel needs N a
multiple of 16; other shapes run the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from braid.kernels.gguf_reference import Planes

CPU_GROUP = 32
BF16 = torch.bfloat16


@dataclass
class CpuInt4Weight:
    """One weight in torch's CPU int4 form: `packed` (opaque, from
    `_convert_weight_to_int4pack_for_cpu`), `table` bfloat16 [K' / 32, N, 2] of (scale,
    offset), and `feed`: how x [M, K] becomes the kernel's [M, K'] ("same": K' = K; "twice":
    x beside x; "q6_k": each 16 columns as 8 x beside x)."""

    packed: torch.Tensor
    table: torch.Tensor
    feed: str
    in_features: int

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """x (bfloat16) [M, K] -> the kernel's input [M, K']."""
        if self.feed == "same":
            return x
        if self.feed == "twice":
            return torch.cat([x, x], dim=1)
        m, k = x.shape
        mult = torch.tensor([8.0, 1.0], dtype=x.dtype, device=x.device).view(1, 1, 2, 1)
        return (x.view(m, k // 16, 1, 16) * mult).reshape(m, 2 * k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] of any float dtype -> bfloat16 [M, N]."""
        xk = self.expand(x.to(BF16))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.packed, CPU_GROUP, self.table)

    def linear_fn(self) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """`(x [M, K], bias) -> x @ W.T + bias` in x's dtype, the kernel's output rounded to
        bfloat16 first: one call with nothing between it and the kernel but the dtype
        changes (a one-row layer's kernel takes 10-40 us here, and each Python call on the
        way to it about 1 us)."""
        mm, packed, table = torch.ops.aten._weight_int4pack_mm_for_cpu, self.packed, self.table
        if self.feed != "same":

            def expanded(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                y = self(x).to(x.dtype)
                return y if bias is None else y + bias

            return expanded

        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y = mm(x.to(BF16), packed, CPU_GROUP, table).to(x.dtype)
            return y if bias is None else y + bias

        return run

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight the kernel multiplies by: its codes come back through
        the kernel itself with unit scales and zero offsets ((u - 8) * 1 + 0 is exact)."""
        kk = self.table.shape[0] * CPU_GROUP
        unit = torch.zeros_like(self.table)
        unit[..., 0] = 1
        eye = torch.eye(kk, dtype=BF16)
        centered = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, CPU_GROUP, unit)
        scale = self.table[..., 0].float().repeat_interleave(CPU_GROUP, dim=0).T
        offset = self.table[..., 1].float().repeat_interleave(CPU_GROUP, dim=0).T
        w = centered.T.float() * scale + offset  # [N, K']
        k = self.in_features
        if self.feed == "same":
            return w
        if self.feed == "twice":
            return w[:, :k] + w[:, k:]
        w = w.view(w.shape[0], k // 16, 2, 16)
        return (8 * w[:, :, 0] + w[:, :, 1]).reshape(-1, k)


def fits_cpu(n: int) -> bool:
    return n % 16 == 0


def to_cpu_int4(planes: Planes, qtype: str) -> CpuInt4Weight:
    """`planes` of `qtype` (on the CPU) in torch's int4 form (see the module doc)."""
    codes, s, o = planes.codes, planes.scale, planes.offset
    n, k = codes.shape
    if qtype in ("Q4_0", "Q4_1", "Q4_K"):
        u = codes.to(torch.int32)
        scale, offset = s, o + 8 * s
        feed = "same"
    elif qtype == "Q8_0":
        q = codes.to(torch.int32)
        hi, lo = (q >> 4) + 8, q & 15
        u = torch.cat([hi, lo], dim=1)
        scale = torch.cat([16 * s, s], dim=1)
        offset = torch.cat([torch.zeros_like(s), 8 * s], dim=1)
        feed = "twice"
    elif qtype == "Q6_K":
        if not torch.equal(o, -32 * s):
            raise ValueError("Q6_K planes must have offset -32 * scale")
        q = codes.to(torch.int32).view(n, k // 16, 1, 16)
        u = torch.cat([2 * (q >> 4) + 5, q & 15], dim=2).reshape(n, 2 * k)
        scale, offset = s, torch.zeros_like(s)
        feed = "q6_k"
    else:
        raise ValueError(f"no CPU int4 form for GGUF type {qtype}")
    table = torch.stack([scale.T, offset.T], dim=-1).to(BF16).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
    return CpuInt4Weight(packed, table, feed, k)
