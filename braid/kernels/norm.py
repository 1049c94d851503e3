"""RMSNorm fused with the residual add, with `RMSNorm`'s rounding (`rmsnorm_reference`).

One program normalises one row held whole in registers. The rounding points are the module's:
`x + residual` is rounded to x's dtype (that sum is also the new residual), the normalised row
is rounded to x's dtype, and only then multiplied by the weight, so float32 results match the
module to float rounding and 16-bit ones to one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import FLOAT_DTYPES, check_contiguous, check_tensor, next_pow2
from braid.kernels.reference import rmsnorm_reference as rmsnorm_reference

MAX_HIDDEN = 65536


def norm_warps(block: int) -> int:
    """The warps `rmsnorm` launches with for a row of `block` (its hidden size's power of two);
    a kernel that makes the norm in its place with as many sums its squares in the same order
    (the same layout, the same reduction) where its load is as wide."""
    return min(max(block // 256, 1), 16)


@triton.jit
def _rmsnorm_kernel(
    X,
    Residual,
    W,
    Out,
    NewResidual,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    pdl.trigger(TRIGGER)  # the projection after may start loading its weights (`pdl`)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(NewResidual + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, w * normed, mask=mask)


def _rows(name: str, t: torch.Tensor, hidden: int) -> torch.Tensor:
    try:
        return t.view(-1, hidden)
    except RuntimeError as e:
        raise ValueError(
            f"{name} must be viewable as [rows, {hidden}] (got strides {t.stride()})"
        ) from e


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without `residual`: `norm(x)`. With it: `(norm(x + residual), x + residual)`, as
    `RMSNorm.forward`. Inputs are not modified; results are new contiguous tensors.

    `x`: [..., hidden] float, viewable as [rows, hidden] (unit stride in hidden), hidden <=
    65536; `weight`: contiguous [hidden] float; `residual`: x's shape and dtype. The output's
    dtype is the promotion of x's and weight's (as `weight * h` in torch); the new residual
    has x's dtype.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x's last dimension must be in [1, {MAX_HIDDEN}], got {hidden}")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_contiguous("weight", weight)
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements, x's hidden size is {hidden}")
    x2 = _rows("x", x, hidden)
    r2 = None
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows("residual", residual, hidden)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) if r2 is not None else None
    rows = x2.shape[0]
    if rows:
        block = next_pow2(hidden)
        o2 = out.view(-1, hidden)
        nr2 = new_res.view(-1, hidden) if new_res is not None else o2
        _rmsnorm_kernel[(rows,)](
            x2,
            r2 if r2 is not None else x2,
            weight,
            o2,
            nr2,
            x2.stride(0),
            r2.stride(0) if r2 is not None else 0,
            o2.stride(0),
            nr2.stride(0),
            float(eps),
            N=hidden,
            BLOCK=block,
            HAS_RESIDUAL=r2 is not None,
            TRIGGER=pdl.enabled(x.device),
            num_warps=norm_warps(block),
        )
    return out if new_res is None else (out, new_res)
