"""Qwen2.5-VL's gated vision MLP, widened on CUDA for Hopper's GEMMs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from braid.runtime.layers.activation import silu_and_mul
from braid.runtime.layers.linear import Linear

# On CUDA the gated MLP's intermediate size is widened to a multiple of this (zero weights).
MLP_PAD = 64


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: `down(act(gate(x)) * up(x))`, gate and up fused, all with bias."""

    def __init__(self, dim: int, inter: int, act: Callable, silu: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(dim, {"gate": inter, "up": inter}, bias=True, dtype=dtype)
        self.down_proj = Linear(inter, {None: dim}, bias=True, dtype=dtype)
        self.act = act
        self.silu = silu  # act is silu: one fused kernel on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.silu and h.is_cuda:
            return self.down_proj(silu_and_mul(h))  # one kernel, the torch form's rounding
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    @torch.no_grad()
    def after_weights_loaded(self) -> None:
        """On CUDA, widen the intermediate size to a multiple of `MLP_PAD` with zero rows of
        gate and up (and their bias) and zero columns of down: the product is unchanged (the
        padding's activations are act(0) * 0 = 0), but Qwen2.5-VL's 3420 makes each activation
        row 6840 bytes, not a multiple of 16, so cuBLAS could not use Hopper's kernels for the
        down projection (an sm80 one took about 1 ms a block at 23 images on the H200)."""
        if self.gate_up_proj.weight.is_cuda:
            self.widen(MLP_PAD)

    @torch.no_grad()
    def widen(self, multiple: int) -> None:
        """Pad the intermediate size to a multiple of `multiple` with zero weights (float
        layers only; nothing to do when it already is one)."""
        gu, down = self.gate_up_proj, self.down_proj
        inter = down.in_features
        if gu.method is not None or down.method is not None or inter % multiple == 0:
            return
        wide = -(-inter // multiple) * multiple
        w = gu.weight.new_zeros(2 * wide, gu.in_features)
        w[:inter], w[wide : wide + inter] = gu.weight[:inter], gu.weight[inter:]
        b = gu.bias.new_zeros(2 * wide)
        b[:inter], b[wide : wide + inter] = gu.bias[:inter], gu.bias[inter:]
        gu.weight, gu.bias = nn.Parameter(w, False), nn.Parameter(b, False)
        gu.offsets, gu.out_features = {"gate": (0, wide), "up": (wide, wide)}, 2 * wide
        d = down.weight.new_zeros(down.out_features, wide)
        d[:, :inter] = down.weight
        down.weight, down.in_features = nn.Parameter(d, False), wide
