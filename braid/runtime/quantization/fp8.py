"""`fp8`: e4m3 weights with one scale per output channel (or per tensor), activations quantized
to e4m3 per token as they come (W8A8), products summed in float32 by `torch._scaled_mm`.

Checkpoints: `quant_method: "fp8"` (vLLM's / AutoFP8's: `weight` float8_e4m3fn [N, K],
`weight_scale` one float per tensor, `input_scale` with `activation_scheme: "static"`) and
compressed-tensors FP8 W8A8 (`compressed_tensors.py`: `weight_scale` per tensor or [N, 1]).
A static `input_scale` is read and checked but not used: braid always scales activations per
token, which is never coarser than one scale per tensor. A float checkpoint loaded with
`quantization="fp8"` is quantized as it loads, per channel: scale = max|row| / 448.

The shards of a fused layer keep their own scales (one per output row), so per-tensor and
per-channel checkpoints run the same row-wise `_scaled_mm`.

On CUDA (compute capability 8.9 and up: Ada, Hopper, ...), one row (batch-1 decode) runs
`braid.kernels.quant_gemv.fp8_gemv`, which quantizes the row itself and reads the e4m3
weights once; more rows run `braid.kernels.per_token_quant_fp8` then `torch._scaled_mm` with
row-wise scales. Both give bfloat16 (a float16 or float32 model's outputs pass through it, and
then get the bias), and compute the same numbers up to the order of the float32 sums.
Elsewhere (CPU), the same numbers through the torch reference (`fp8_linear_reference`): exact,
for tests and correctness, not speed.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from braid.kernels.quant_reference import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_linear_reference,
)
from braid.runtime.quantization import QUANTIZATION_METHODS
from braid.runtime.quantization.base import (
    LinearMethod,
    LinearSpec,
    PreparedInputs,
    QuantizationMethod,
    check_dtype,
    flat_rows,
    inputs_ahead,
    kept,
    loadable,
    online_placeholder,
    row_scale_loader,
    sliced_loader,
)

MIN_CAPABILITY = (8, 9)

# `_scaled_mm` of more than one row moves its tensor-core sums to float32 as it goes (its
# default). BRAID_FP8_FAST_ACCUM=1 (for measuring; read when a layer loads) keeps them in the
# tensor cores' own accumulator (`use_fast_accum`), as vLLM's and SGLang's CUTLASS fp8 GEMMs
# do: 7-17% faster at 8192 rows in the kernel run (docs/benchmarks.md), less exact sums.
FAST_ACCUM_ENV = "BRAID_FP8_FAST_ACCUM"


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of float rows: (codes float8_e4m3fn, scales float32)."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    codes = (wf / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def check_fp8_device(spec: LinearSpec) -> None:
    """`ValueError` naming the layer where `_scaled_mm` cannot run it on the layer's GPU."""
    if spec.device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(spec.device)
    if cap < MIN_CAPABILITY:
        raise ValueError(
            f"{spec.name}: fp8 needs a GPU of compute capability "
            f"{'.'.join(map(str, MIN_CAPABILITY))} or newer, this one is {cap[0]}.{cap[1]}"
        )
    for what, size in (("input size", spec.in_features), ("output size", spec.out_features)):
        if size % 16:
            raise ValueError(f"{spec.name}: fp8 needs its {what} ({size}) to be a multiple of 16")


class Fp8LinearMethod(LinearMethod):
    """A linear layer with e4m3 weights and per-row scales. `online`: quantize a float weight
    as it loads; else load `weight`, `weight_scale` and, if present, `input_scale`."""

    def __init__(self, spec: LinearSpec, *, online: bool) -> None:
        super().__init__(spec)
        check_fp8_device(spec)
        self.online = online
        # CPU: the reference in the model's dtype; CUDA: set by finish_loading.
        self.out_dtype: torch.dtype | None = None
        self.bias_in_kernel = True

    def create_weights(self) -> dict[str, nn.Parameter]:
        spec, shards = self.spec, tuple(self.spec.shards)
        n, k = spec.out_features, spec.in_features
        self.scales = torch.ones(n, dtype=torch.float32, device=spec.device)
        if self.online:
            self.weight = torch.zeros(n, k, dtype=FP8_DTYPE, device=spec.device)
            return {"weight": online_placeholder(spec, self._quantize_rows)}
        weight_loader = sliced_loader(spec, 0, dtypes=(FP8_DTYPE,))
        self.params = {
            "weight": loadable((n, k), FP8_DTYPE, weight_loader, shards),
            "weight_scale": loadable((n,), torch.float32, row_scale_loader(spec), shards, fill=1.0),
            "input_scale": loadable((len(shards),), torch.float32, self._load_input_scale, ()),
        }
        return self.params

    def _load_input_scale(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None
    ) -> None:
        self.spec.shard_range(shard)
        check_dtype(loaded, (torch.float32, torch.float16, torch.bfloat16), f"shard {shard!r}")
        if loaded.numel() != 1 or not bool(torch.isfinite(loaded).all()) or float(loaded) <= 0:
            raise ValueError(f"shard {shard!r}: input_scale must be one finite positive number")

    def _quantize_rows(self, rows: torch.Tensor, start: int) -> None:
        codes, scales = quantize_fp8(rows)
        self.weight[start : start + rows.shape[0]] = codes
        self.scales[start : start + rows.shape[0]] = scales

    def finish_loading(self) -> dict[str, nn.Parameter]:
        if not self.online:
            self.weight = self.params["weight"].data
            self.scales = self.params["weight_scale"].data
            del self.params
        if self.spec.device.type == "cuda":
            self._use_cuda()
        return {"weight": kept(self.weight), "weight_scale": kept(self.scales)}

    def _use_cuda(self) -> None:
        from braid.kernels.fp8_quant import per_token_quant_fp8
        from braid.kernels.quant_gemv import GemvWorkspace, config_for, fp8_gemv

        self.out_dtype = torch.bfloat16
        self.bias_in_kernel = self.spec.dtype == torch.bfloat16
        weight = self.weight.contiguous()
        weight_t = weight.t()  # column-major [K, N], as _scaled_mm takes its second
        scales = self.scales.float().contiguous()
        row_scales = scales.reshape(1, -1)
        fused_bias = self.bias_in_kernel
        n, k = weight.shape
        workspace = GemvWorkspace.for_launch("fp8", n, k, self.spec.device)
        fast_accum = os.environ.get(FAST_ACCUM_ENV) == "1"
        # The row's codes made before the one-row GEMV (`INPUTS_AHEAD_ENV`, for measuring);
        # that GEMV has launch shapes of its own.
        mode = inputs_ahead()
        ahead_config = config_for("fp8_ahead", n, k, self.spec.device)
        ahead_workspace = (
            GemvWorkspace.for_launch("fp8_ahead", n, k, self.spec.device) if mode != "0" else None
        )

        def apply_codes(like: torch.Tensor, codes_and_scale, bias: torch.Tensor | None):
            codes, x_scale = codes_and_scale
            y = fp8_gemv(like, weight, scales, bias if fused_bias else None, config=ahead_config,
                         workspace=ahead_workspace, x_codes=codes,
                         x_scale=x_scale).to(like.dtype)  # fmt: skip
            return y if fused_bias or bias is None else y + bias

        if mode != "0":
            self.prepared = PreparedInputs(per_token_quant_fp8, apply_codes)
        ahead = mode == "1"

        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            inner = bias if fused_bias else None
            if x.shape[0] == 1 and ahead:
                return apply_codes(x, per_token_quant_fp8(x), bias)
            if x.shape[0] == 1:
                # One launch that quantizes the row as per_token_quant_fp8 does: _scaled_mm
                # is built for many rows, and the separate quantization costs a launch.
                y = fp8_gemv(x, weight, scales, inner, workspace=workspace)
            else:
                codes, x_scales = per_token_quant_fp8(x)
                y = torch._scaled_mm(
                    codes,
                    weight_t,
                    scale_a=x_scales,
                    scale_b=row_scales,
                    bias=inner,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast_accum,
                )
            y = y.to(x.dtype)
            return y if fused_bias or bias is None else y + bias

        self._kernel = run

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = flat_rows(x)
        inner = bias if self.bias_in_kernel else None
        y = fp8_linear_reference(x2, self.weight, self.scales, inner, self.out_dtype or x.dtype)
        y = y.to(x.dtype)
        if bias is not None and not self.bias_in_kernel:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.spec.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


@QUANTIZATION_METHODS.register
class FP8(QuantizationMethod):
    """`quant_method: "fp8"`: `activation_scheme` "dynamic" or "static", `ignored_layers`
    (modules left in floats); block-wise scales (`weight_block_size`) are not supported.
    compressed-tensors FP8 checkpoints come through `compressed_tensors.py` with `ignore`."""

    name = "fp8"

    def __init__(
        self, config: dict | None, *, online: bool, ignore: list[str] | None = None
    ) -> None:
        super().__init__(config, online=online)
        c = self.config
        if c.get("weight_block_size") is not None:
            raise ValueError(
                f"quantization_config weight_block_size: block-wise fp8 scales "
                f"({c['weight_block_size']}) are not supported (per tensor or per channel)"
            )
        scheme = c.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config activation_scheme must be 'dynamic' or 'static', got "
                f"{scheme!r}"
            )
        skip = ignore if ignore is not None else c.get("ignored_layers") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"the list of unquantized modules must hold names, got {skip!r}")
        self.ignore = skip

    def linear_method(self, spec: LinearSpec, checkpoint_names: tuple[str, ...]):
        if self.skips(spec, checkpoint_names, self.ignore):
            return None
        return Fp8LinearMethod(spec, online=self.online)
