"""Which fused kernels a decoder layer runs, chosen once at construction from its weights'
device and dtype. Model files ask here rather than choosing themselves, so every family with
the same layer shape (`PreNormDecoderLayer`: Llama, Mistral, Qwen2, Qwen3, ...) gets the same
fusions and the same rounding points.

- `select_silu_mul_down`: a gated MLP's activation and down projection, in one kernel for a
  one-row input on CUDA in 16 bits.
- `select_one_row_forward`: a whole pre-norm decoder layer for one token on CUDA in 16 bits,
  each RMSNorm inside the projection after it.
- `select_prepared_one_row_forward`: the same layer with quantized projections whose one-row
  GEMVs take their input made before them (`quantization.base.PreparedInputs`), each norm and
  the activation making it in their own launch (o_proj keeps its own path).

Both read the projections' float `.weight`, so a model built for quantized weights
(`quantization.base.building` with a method) gets neither: its layers run their own path, each
projection through its quantization method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from braid.runtime.layers.activation import silu_and_mul
from braid.runtime.layers.linear import Linear
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.parallel import RowParallelLinear
from braid.runtime.quantization.base import building_quantized, inputs_ahead

SiluMulDown = Callable[[torch.Tensor, RowParallelLinear], torch.Tensor]

# Rows up to which the MLP fuses its activation into the down projection on CUDA (a batch-1
# decode step). More rows run the fused kernel's tl.dot form, which repeats the activation per
# output block and per warp: correct, but not measured to pay; raise this after measuring
# (benchmarks/kernel_timings.py has a down_proj M=16 fused row).
FUSED_MLP_MAX_ROWS = 1

# Whether a one-token forward on CUDA (batch-1 decode) runs each layer's norms, projections and
# activation in fused kernels (`select_one_row_forward`); tests switch it off to compare.
FUSE_ONE_ROW = True


class GatedMLP(Protocol):
    """`down(silu(gate) * up)` over a fused gate-up projection; `silu_mul_down` holds
    `select_silu_mul_down`'s choice."""

    gate_up_proj: Linear
    down_proj: RowParallelLinear
    silu_mul_down: SiluMulDown


class PreNormAttention(Protocol):
    """Self-attention with a fused QKV projection; `attend` maps that projection's output to
    the attention output before `o_proj` (rotary, q/k norms and the backend call included)."""

    qkv_proj: Linear
    o_proj: RowParallelLinear

    def attend(self, qkv: torch.Tensor, cos_sin: Any, batch: Any, attn: Any) -> torch.Tensor: ...


class PreNormDecoderLayer(Protocol):
    """The layer `select_one_row_forward` fuses: `h = attn(input_layernorm(x))`, then
    `mlp(post_attention_layernorm(h))`, each norm adding the residual first."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    self_attn: PreNormAttention
    mlp: GatedMLP


OneRowForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def silu_mul_down(gate_up: torch.Tensor, down: RowParallelLinear) -> torch.Tensor:
    """`down(silu(gate) * up)`: the activation, then the projection (two kernels on CUDA)."""
    return down(silu_and_mul(gate_up))


def select_silu_mul_down(device: torch.device, dtype: torch.dtype) -> SiluMulDown:
    """The MLP's activation and down projection for weights on `device` in `dtype`.

    On CUDA in bfloat16 / float16, a 2-D input of 1..FUSED_MLP_MAX_ROWS rows (a batch-1 decode
    step) runs both in one kernel (`skinny_linear(..., activation="silu_and_mul")`), with the
    activation rounded exactly as `silu_and_mul` rounds it: one launch fewer per layer, for
    outputs equal to the two-kernel path's up to the order of the float32 sum. Other inputs,
    and every input elsewhere, run `silu_mul_down`. The kernel's first call autotunes
    (host-synchronising), which the CUDA-graph runner's eager warm-up does before capture.
    In a model built for quantized weights, always `silu_mul_down`.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return silu_mul_down
    if building_quantized() is not None:
        return silu_mul_down
    from braid.kernels.skinny_gemm import skinny_linear

    def fused(gate_up: torch.Tensor, down: RowParallelLinear) -> torch.Tensor:
        if gate_up.dim() == 2 and 1 <= gate_up.shape[0] <= FUSED_MLP_MAX_ROWS:
            out = skinny_linear(gate_up, down.weight, down.bias, activation="silu_and_mul")
            return down.reduce(out)
        return down(silu_and_mul(gate_up))

    return fused


def select_one_row_forward(device: torch.device, dtype: torch.dtype) -> OneRowForward | None:
    """A `PreNormDecoderLayer`'s forward for one token on CUDA in bfloat16 / float16, else
    None. The returned `forward(layer, x, residual, cos_sin, batch, attn)` takes the layer's
    own forward arguments (`x` of one row) and returns `(h, residual)` as it does.

    A batch-1 decode step of an 8B model is bound by reading the weights, and each small
    kernel between the projections costs a fixed launch and ramp time, far more than its work.
    This path runs each RMSNorm (with its residual add) inside the projection that follows it,
    the activation inside the down projection (the MLP's `silu_mul_down`), and o_proj in the
    same skinny kernel (`braid.kernels.skinny_linear`, no slower than cuBLAS for o_proj): four
    launches fewer per layer, with every rounding point of the unfused path (the sums in the
    projections may add in another order). Under tensor parallelism the row-parallel
    projections' partial sums are all-reduced after their kernels, as their own forward does.
    Both costs were measured on an H200 with `benchmarks/kernel_timings.py` and
    `benchmarks/gpu_step.py` (docs/benchmarks.md, Figures behind design choices). None in a
    model built for quantized weights.
    """
    if not FUSE_ONE_ROW or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if building_quantized() is not None:
        return None
    from braid.kernels.skinny_gemm import skinny_linear

    def norm_then(proj: Linear, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """`proj(norm(x + residual))` and the new residual `x + residual`, in one kernel."""
        w = dict(norm_weight=norm.weight, eps=norm.eps)
        if residual is None:
            return skinny_linear(x, proj.weight, proj.bias, **w), x
        new = torch.empty_like(x)
        out = skinny_linear(x, proj.weight, proj.bias, **w, residual=residual, residual_out=new)
        return out, new

    def forward(layer: PreNormDecoderLayer, x, residual, cos_sin, batch, attn):
        sa, mlp = layer.self_attn, layer.mlp
        qkv, residual = norm_then(sa.qkv_proj, layer.input_layernorm, x, residual)
        h = sa.attend(qkv, cos_sin, batch, attn)
        h = sa.o_proj.reduce(skinny_linear(h, sa.o_proj.weight, sa.o_proj.bias))
        gate_up, residual = norm_then(mlp.gate_up_proj, layer.post_attention_layernorm, h, residual)
        return mlp.silu_mul_down(gate_up, mlp.down_proj), residual

    return forward


def select_prepared_one_row_forward(layer: PreNormDecoderLayer) -> OneRowForward | None:
    """For a loaded `PreNormDecoderLayer` whose qkv, gate_up and down projections are quantized
    with a `prepared` form (`BRAID_GEMV_INPUTS_AHEAD=fused`; only then), a forward for one
    token in which each RMSNorm (with its residual add) and the activation make the input of
    the projection after them in their own launch, in the form its GEMV loads
    (`pack_int4_inputs`, `per_token_quant_fp8` with the producer's arguments): no launch is
    added, and those GEMVs prepare no x. o_proj, whose input attention makes, runs its own
    path. Else None. Its outputs are the layer's own forward's (the norms' sums of squares add
    in `rmsnorm`'s order where the hidden size is at most 4096)."""
    sa, mlp = layer.self_attn, layer.mlp
    projections = (sa.qkv_proj, mlp.gate_up_proj, mlp.down_proj)
    if not FUSE_ONE_ROW or any(p.method is None or p.method.prepared is None for p in projections):
        return None
    if inputs_ahead() != "fused":
        return None

    def norm_then(proj: Linear, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """`proj(norm(x + residual))` and the new residual `x + residual`: two launches."""
        prepared = proj.method.prepared
        w = dict(norm_weight=norm.weight, eps=norm.eps)
        if residual is None:
            return prepared.apply(x, prepared.prepare(x, **w), proj.bias), x
        new = torch.empty_like(x)
        made = prepared.prepare(x, **w, residual=residual, residual_out=new)
        return prepared.apply(x, made, proj.bias), new

    def forward(layer: PreNormDecoderLayer, x, residual, cos_sin, batch, attn):
        sa, mlp = layer.self_attn, layer.mlp
        qkv, residual = norm_then(sa.qkv_proj, layer.input_layernorm, x, residual)
        h = sa.o_proj(sa.attend(qkv, cos_sin, batch, attn))
        gate_up, residual = norm_then(mlp.gate_up_proj, layer.post_attention_layernorm, h, residual)
        down = mlp.down_proj.method.prepared
        made = down.prepare(gate_up, activation="silu_and_mul")
        like = gate_up[:, : gate_up.shape[1] // 2]
        return mlp.down_proj.reduce(down.apply(like, made, mlp.down_proj.bias)), residual

    return forward
