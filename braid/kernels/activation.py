"""`silu(gate) * up` over `[gate | up]`, with `silu_and_mul_reference`'s rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import FLOAT_DTYPES, check_tensor, next_pow2
from braid.kernels.reference import silu_and_mul_reference as silu_and_mul_reference


@triton.jit
def _silu_and_mul_kernel(
    X, Out, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr
):
    pdl.trigger(TRIGGER)  # the down projection after may start loading its weights (`pdl`)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the output dtype before the product, as in torch's F.silu(g) * u.
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for `x` of shape [..., 2d] (float, viewable as
    [rows, 2d] with unit stride in the last dimension). Returns a new contiguous [..., d]
    tensor of x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    try:
        x2 = x.view(-1, 2 * d)
    except RuntimeError as e:
        raise ValueError(f"x must be viewable as [rows, {2 * d}], got strides {x.stride()}") from e
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and d:
        block = min(next_pow2(d), 1024)
        o2 = out.view(-1, d)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, o2, x2.stride(0), o2.stride(0), D=d, BLOCK=block,
            TRIGGER=pdl.enabled(x.device), num_warps=4,
        )  # fmt: skip
    return out
