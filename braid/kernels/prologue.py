"""The prologues of the one-row kernels that make their input in the place of the kernel
before them (the quantized GEMVs and the launches that prepare their inputs): the input at
some columns as that kernel would have stored it (`_input`), and the checks of the
prologue's arguments. `skinny_linear` holds the norm's sum of squares (`_rmsnorm_rstd`) and
the activation's rounding, which it shares with them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels.skinny_gemm import ACTIVATIONS, _check_norm, _silu_and_mul_rounded


@triton.jit
def _input(X, NormW, Residual, ks, mask, rstd, K, ACT: tl.constexpr, NORM: tl.constexpr,
           HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """The GEMV's inputs at `ks` as float32: x's, `silu(gate) * up` of x = [gate | up] (ACT),
    or `rmsnorm(x (+ residual))` (NORM, `rstd` its row's inverse norm), each rounded as its
    own kernel rounds it; zero where `mask` is off."""
    if ACT:
        gate = tl.load(X + ks, mask=mask, other=0.0)
        up = tl.load(X + K + ks, mask=mask, other=0.0)
        return _silu_and_mul_rounded(gate, up).to(tl.float32)
    x = tl.load(X + ks, mask=mask, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(Residual + ks, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        nw = tl.load(NormW + ks, mask=mask, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32)
        return (nw.to(tl.float32) * normed).to(X.dtype.element_ty).to(tl.float32)
    return x.to(tl.float32)


def _check_prologue(activation: str | None, norm_weight: torch.Tensor | None) -> None:
    """A one-row kernel's prologue: the activation, the norm, or neither."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if activation is not None and norm_weight is not None:
        raise ValueError(f"activation must be None with norm_weight, got {activation!r}")


def _check_norm_args(
    x: torch.Tensor,
    k: int,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    out: torch.Tensor,
) -> bool:
    """`_check_norm` where there is a norm; else no residual may be given. Whether there is."""
    if norm_weight is not None:
        _check_norm(x, k, norm_weight, eps, residual, residual_out, out)
        return True
    if residual is not None or residual_out is not None:
        raise ValueError("residual and residual_out need norm_weight (the fused norm)")
    return False
