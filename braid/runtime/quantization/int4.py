"""Group-wise 4-bit weights (W4A16), whatever checkpoint format they came in: one layout, one
method, three kernels.

A checkpoint format (`awq.py`, `gptq.py`) creates its tensors as parameters and, once they are
loaded, reads them into `Int4Weights`: the layout of `braid.kernels.int4_linear` (codes packed
along K, a float scale and a uint8 zero per group and output) plus, for GPTQ's act-order, the
permutation of the input that makes each group's rows contiguous. A float checkpoint is
quantized as it loads instead (round to nearest with a zero point, AutoAWQ's formula).

`finish_loading` then chooses the kernels once, from the device:
- CUDA: the weights repacked into the planar layout (`PlanarInt4`; scales in float16, the
  checkpoints' dtype, so the weights are exactly the checkpoint's in any model dtype), and by
  rows per call: one row, the split-K GEMV (`braid.kernels.int4_gemv.int4_gemv`); up to
  `quant_planar.DEQUANTIZE_MIN_ROWS`, the Triton GEMM (`int4_planar_linear`); more, the weight
  dequantized to the model's dtype (each weight rounded once) then cuBLAS;
- CPU: torch's int4 weight-packed matmul (`_weight_int4pack_mm_for_cpu`, bfloat16 in and
  out), whose weight is (q - 8) * s + offset per group: s is the scale rounded to bfloat16,
  and the offset (8 - zero) * s rounded to bfloat16 too, so its weights differ from the
  checkpoint's by up to 1/64 of a quantization step beside the scale's rounding. It needs
  N % 16 == 0 and groups of 32, 64, 128 or 256 rows (a larger group is split into equal ones);
- otherwise (shapes the CPU kernel refuses, other devices): the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from braid.kernels.quant_reference import (
    PACK,
    dequantize_int4,
    pack_int4,
    pack_int4_meta,
    pack_int4_planar,
    unpack_int4,
    unpack_int4_meta,
    unpack_int4_planar,
)
from braid.runtime.quantization.base import (
    CPU_COMPUTE_DTYPE,
    LinearSpec,
    PreparedInputs,
    WeightOnlyMethod,
    inputs_ahead,
    kept,
    online_placeholder,
)

CPU_GROUP_SIZES = (256, 128, 64, 32)
# Group sizes a float checkpoint is quantized with online: the first that divides the layer's
# input size (SmolLM2's 576 takes 64).
ONLINE_GROUP_SIZES = (128, 64, 32)


@dataclass
class Int4Weights:
    """`braid.kernels.quant_reference`'s int4 layout: `qweight` int32 [N, K / 8], `scales`
    float32 [K / G, N], `zeros` uint8 [K / G, N]; `perm` (int64 [K] or None): the kernel
    multiplies `x[:, perm]`, so W[:, perm] is the weight these hold."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


@dataclass
class PlanarInt4:
    """The same weights in the planar layout the CUDA kernels read
    (`braid.kernels.quant_reference`): `qweight` int32 [N, ceil(K / 128) * 16], `meta` int32
    [K / G, N] (each group's zero and float16 scale), `k` the input size, `perm` as in
    `Int4Weights`."""

    qweight: torch.Tensor
    meta: torch.Tensor
    group_size: int
    k: int
    perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        scales, zeros = unpack_int4_meta(self.meta)
        q = unpack_int4_planar(self.qweight, self.k).float()
        z = zeros.float().repeat_interleave(self.group_size, dim=0).T
        s = scales.float().repeat_interleave(self.group_size, dim=0).T
        w = (q - z) * s
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


class Int4Checkpoint(Protocol):
    """A checkpoint format's int4 tensors for one layer."""

    def parameters(self) -> dict[str, nn.Parameter]:
        """The tensors to load, as the checkpoint names them, with their loaders."""

    def read(self) -> Int4Weights:
        """The loaded tensors in braid's layout; `ValueError` for values it cannot hold."""


def check_group_size(spec: LinearSpec, group_size: int) -> None:
    """`ValueError` naming the layer unless `group_size` splits its input into whole groups
    the kernels take."""
    k = spec.in_features
    if k % group_size:
        raise ValueError(f"{spec.name}: group_size {group_size} does not divide its input size {k}")
    if group_size % 16:
        raise ValueError(
            f"{spec.name}: group_size {group_size} is not a multiple of 16 (the int4 kernels' "
            "smallest block of K)"
        )


def online_group_size(spec: LinearSpec) -> int:
    for g in ONLINE_GROUP_SIZES:
        if spec.in_features % g == 0:
            return g
    raise ValueError(
        f"{spec.name}: no int4 group size of {list(ONLINE_GROUP_SIZES)} divides its input size "
        f"{spec.in_features}"
    )


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest 4-bit quantization of float rows w [R, K] in groups of `group_size`
    along K, with a zero point per group (AutoAWQ's formula): scale = (max - min) / 15, zero =
    round(-min / scale), code = clamp(round(w / scale) + zero, 0, 15), the scale rounded to a
    float16 value first. Returns (codes uint8 [R, K], scales float32 [R, K / G], zeros uint8
    [R, K / G])."""
    r, k = w.shape
    g = w.float().reshape(r, k // group_size, group_size)
    hi, lo = g.amax(-1), g.amin(-1)
    # Scales held as float16 values (AWQ's and GPTQ's scale dtype, kept by the CUDA kernel).
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    codes = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return codes.reshape(r, k).to(torch.uint8), scales, zeros.to(torch.uint8)


class Int4LinearMethod(WeightOnlyMethod):
    """A linear layer with group-wise int4 weights. `checkpoint`: the format its tensors load
    in, or None to quantize a float weight as it loads (round to nearest, `quantize_int4`)."""

    def __init__(
        self, spec: LinearSpec, group_size: int, checkpoint: Int4Checkpoint | None
    ) -> None:
        super().__init__(spec)
        check_group_size(spec, group_size)
        self.group_size = group_size
        self.checkpoint = checkpoint
        self.weights: Int4Weights | PlanarInt4 | None = None

    # ---- loading ------------------------------------------------------------------------------

    def create_weights(self) -> dict[str, nn.Parameter]:
        if self.checkpoint is not None:
            return self.checkpoint.parameters()
        n, k, g = self.spec.out_features, self.spec.in_features, self.group_size
        dev = self.spec.device
        self.weights = Int4Weights(
            torch.zeros(n, k // PACK, dtype=torch.int32, device=dev),
            torch.zeros(k // g, n, dtype=torch.float32, device=dev),
            torch.zeros(k // g, n, dtype=torch.uint8, device=dev),
            g,
        )
        return {"weight": online_placeholder(self.spec, self._quantize_rows)}

    def _quantize_rows(self, rows: torch.Tensor, start: int) -> None:
        codes, scales, zeros = quantize_int4(rows, self.group_size)
        end = start + rows.shape[0]
        self.weights.qweight[start:end] = pack_int4(codes)
        self.weights.scales[:, start:end] = scales.T
        self.weights.zeros[:, start:end] = zeros.T

    def finish_loading(self) -> dict[str, nn.Parameter]:
        w = self.checkpoint.read() if self.checkpoint is not None else self.weights
        # The checkpoint's tensors as loaded are not kept: `w` (then the kernel's form) is.
        self.checkpoint = None
        self.weights = w
        dev, n = self.spec.device, self.spec.out_features
        if dev.type == "cuda":
            return self._use_triton(w)
        if dev.type == "cpu" and n % 16 == 0 and _cpu_group(w.group_size) is not None:
            return self._use_cpu(w)
        self.compute_dtype, self.bias_in_kernel = self.spec.dtype, True
        self._kernel = self._reference_kernel
        return _kept(qweight=w.qweight, scales=w.scales, zeros=w.zeros, perm=w.perm)

    def _use_triton(self, w: Int4Weights) -> dict[str, nn.Parameter]:
        from braid.kernels.int4_gemv import int4_gemv
        from braid.kernels.int4_pairs import pack_int4_inputs
        from braid.kernels.quant_gemv import GemvWorkspace, config_for
        from braid.kernels.quant_planar import (
            DEQUANTIZE_MIN_ROWS,
            dequantize_int4_planar,
            int4_planar_linear,
        )

        self.compute_dtype, self.bias_in_kernel = self.spec.dtype, True
        # Scales in float16, the checkpoints' own dtype: a bfloat16 model's weights stay
        # exactly the checkpoint's (bfloat16 would drop 3 bits of every scale).
        planar = PlanarInt4(
            pack_int4_planar(w.qweight).contiguous(),
            pack_int4_meta(w.scales.to(torch.float16), w.zeros),
            w.group_size,
            self.spec.in_features,
            w.perm,
        )
        self.weights = planar
        qweight, meta, group, k, perm = planar.qweight, planar.meta, w.group_size, planar.k, w.perm
        n = self.spec.out_features
        workspace = GemvWorkspace.for_launch("int4", n, k, self.spec.device)
        # The input's float16 pairs made before the one-row GEMV (`INPUTS_AHEAD_ENV`, for
        # measuring), where it runs a packed form; that GEMV has launch shapes of its own.
        mode = inputs_ahead()
        ahead_config = config_for("int4_ahead", n, k, self.spec.device)
        form = ahead_config.packed
        packable = form > 0 and group % 128 == 0 and mode != "0"
        packable = packable and self.spec.dtype in (torch.bfloat16, torch.float16)
        ahead_workspace = (
            GemvWorkspace.for_launch("int4_ahead", n, k, self.spec.device) if packable else None
        )

        def apply_packed(like: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
            return int4_gemv(like, qweight, meta, group, bias, config=ahead_config,
                             workspace=ahead_workspace, packed_inputs=packed)  # fmt: skip

        # The norm or the activation can make the input only where no permutation comes
        # between them and the GEMV (act-order).
        if packable and perm is None:
            self.prepared = PreparedInputs(
                lambda x, **producer: pack_int4_inputs(x, form, **producer), apply_packed
            )
        ahead = packable and mode == "1"

        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if perm is not None:
                x = x.index_select(1, perm)
            rows = x.shape[0]
            if rows == 1 and ahead:
                return apply_packed(x, pack_int4_inputs(x, form), bias)
            if rows == 1:
                return int4_gemv(x, qweight, meta, group, bias, workspace=workspace)
            if rows < DEQUANTIZE_MIN_ROWS:
                return int4_planar_linear(x, qweight, meta, group, bias)
            # Compute-bound: a pass over the weight into x's dtype, then cuBLAS.
            weight = dequantize_int4_planar(qweight, meta, group, k, x.dtype)
            return torch.nn.functional.linear(x, weight, bias)

        self._kernel = run
        return _kept(qweight=qweight, meta=meta, perm=perm)

    def _use_cpu(self, w: Int4Weights) -> dict[str, nn.Parameter]:
        self.compute_dtype, self.bias_in_kernel = CPU_COMPUTE_DTYPE, False
        group = _cpu_group(w.group_size)
        codes = unpack_int4(w.qweight).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales = w.scales.to(CPU_COMPUTE_DTYPE)
        offsets = ((8 - w.zeros.float()) * scales.float()).to(CPU_COMPUTE_DTYPE)
        repeat = w.group_size // group
        table = torch.stack([scales, offsets], dim=-1).repeat_interleave(repeat, dim=0)
        table = table.contiguous()
        perm = w.perm
        self._cpu = (packed, group, table, perm)

        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if perm is not None:
                x = x.index_select(1, perm)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(CPU_COMPUTE_DTYPE), packed, group, table
            ).to(x.dtype)
            return y if bias is None else y + bias

        self._kernel = run
        self.weights = None  # the packed form is what is kept
        return _kept(qweight=packed, scales_and_zeros=table, perm=perm)

    # ---- compute ------------------------------------------------------------------------------

    def dequantize(self) -> torch.Tensor:
        if self.weights is not None:
            return self.weights.dequantize()
        packed, group, table, perm = self._cpu
        # The CPU kernel's packing is opaque; its codes come back through the kernel itself,
        # with unit scales and zero offsets ((q - 8) * 1 + 0 is exact in bfloat16). So a CPU
        # layer's `reference` checks what is around the kernel, not the packing: the tests
        # check this weight against the checkpoint's own values.
        k = self.spec.in_features
        unit = torch.zeros_like(table)
        unit[..., 0] = 1
        eye = torch.eye(k, dtype=CPU_COMPUTE_DTYPE)
        centered = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, unit).T.float()
        scales = table[..., 0].float().repeat_interleave(group, dim=0).T
        offsets = table[..., 1].float().repeat_interleave(group, dim=0).T
        w = centered * scales + offsets
        if perm is None:
            return w
        out = torch.empty_like(w)
        out[:, perm] = w
        return out


def _cpu_group(group_size: int) -> int | None:
    """The group size torch's CPU int4 kernel takes that splits `group_size` evenly."""
    return next((g for g in CPU_GROUP_SIZES if group_size % g == 0), None)


def group_size_of(spec: LinearSpec, configured: int) -> int:
    """A checkpoint's group size for this layer: -1 (one group per output row) is the input
    size."""
    if configured == -1:
        return spec.in_features
    if isinstance(configured, bool) or not isinstance(configured, int) or configured < 1:
        raise ValueError(
            f"quantization_config group_size must be -1 or positive, got {configured!r}"
        )
    return configured


def _kept(**tensors: torch.Tensor | None) -> dict[str, nn.Parameter]:
    return {name: kept(t) for name, t in tensors.items() if t is not None}
