"""RMSNorm, computed in float32 as Hugging Face does, with an optional fused residual add.

On CUDA the norm runs as one Triton kernel (`braid.kernels.rmsnorm`, same rounding points).
On the CPU a float32 weight runs torch's own `rms_norm` (one call where the plain torch form,
`braid.kernels.reference.rmsnorm_reference`, makes seven: 8 against 13 us a row here; its
results equal the plain form's bit for bit with torch 2.13, which
`tests/runtime/test_cpu_step_path.py` checks);
other dtypes the plain form, whose rounding to the input dtype before the weight's product
`rms_norm` does not share. The choice is made once, from the weight's device and dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from braid.kernels.reference import rmsnorm_reference


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def rmsnorm_cpu_float32(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm_reference` for float32 on the CPU through torch's fused `rms_norm`."""
    if residual is not None:
        x = residual + x
    out = F.rms_norm(x, weight.shape, weight, eps)
    return out if residual is None else (out, x)


def _select_rmsnorm(
    device: torch.device, dtype: torch.dtype
) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    if device.type == "cpu" and dtype == torch.float32:
        return rmsnorm_cpu_float32
    if device.type != "cuda":
        return rmsnorm_reference
    from braid.kernels.norm import rmsnorm

    def fused(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # The kernel reads whole rows with unit stride; per-head q/k norms get heads sliced
        # from the fused QKV output, which are not (a no-op for the contiguous hidden states).
        return rmsnorm(x.contiguous(), weight, eps, residual)

    return fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shard_names = (None,)
        self._norm = _select_rmsnorm(self.weight.device, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        return self._norm(x, self.weight, self.eps, residual)
