"""`w8a16`: 8-bit integer weights with one scale per output channel, float activations.

Checkpoints: compressed-tensors' INT8 W8A16 (`compressed_tensors.py` reads the config), as
`weight` int8 [N, K] (formats int-quantized, naive-quantized) or `weight_packed` int32
[N, K / 4] (pack-quantized: four codes a word, byte i holding input 4j + i as code + 128) with
`weight_shape`; `weight_scale` [N, 1] (or one per tensor). W = code * scale. A float
checkpoint loaded with `quantization="w8a16"` is quantized as it loads: scale = max|row| / 127,
code = round(w / scale).

Kernels, chosen once per layer: CUDA, the split-K GEMV for one row
(`braid.kernels.quant_gemv.int8_gemv`) and the Triton dequantizing GEMM
(`braid.kernels.int8_linear`) for more; CPU, torch's int8 weight-packed matmul
(`_weight_int8pack_mm`, bfloat16 in and out, bfloat16 scales; K a multiple of 16); else the
torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from braid.runtime.quantization import QUANTIZATION_METHODS
from braid.runtime.quantization.base import (
    CPU_COMPUTE_DTYPE,
    LinearSpec,
    QuantizationMethod,
    WeightOnlyMethod,
    kept,
    loadable,
    online_placeholder,
    row_scale_loader,
    sliced_loader,
)

INT8_MAX = 127


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row 8-bit quantization of float rows: (codes int8, scales float32)."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
    codes = torch.round(wf / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def unpack_int8_words(words: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized 8-bit words [R, ceil(K / 4)] -> int8 codes [R, K]."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
    unsigned = (words.unsqueeze(-1) >> shifts) & 0xFF
    return (unsigned.reshape(words.shape[0], -1)[:, :k] - 128).to(torch.int8)


class Int8LinearMethod(WeightOnlyMethod):
    """A linear layer with per-channel int8 weights. `checkpoint`: "int" (an int8 `weight`),
    "packed" (`weight_packed` and `weight_shape`), or None to quantize a float weight."""

    def __init__(self, spec: LinearSpec, checkpoint: str | None) -> None:
        super().__init__(spec)
        self.checkpoint = checkpoint

    def create_weights(self) -> dict[str, nn.Parameter]:
        spec, shards = self.spec, tuple(self.spec.shards)
        n, k = spec.out_features, spec.in_features
        if self.checkpoint is None:
            self.weight = torch.zeros(n, k, dtype=torch.int8, device=spec.device)
            self.scales = torch.ones(n, dtype=torch.float32, device=spec.device)
            return {"weight": online_placeholder(spec, self._quantize_rows)}
        scale = loadable((n,), torch.float32, row_scale_loader(spec), shards, fill=1.0)
        self.scale_param = scale
        if self.checkpoint == "int":
            weight = loadable(
                (n, k), torch.int8, sliced_loader(spec, 0, dtypes=(torch.int8,)), shards
            )
            self.weight_param = weight
            return {"weight": weight, "weight_scale": scale}
        words = loadable(
            (n, -(-k // 4)), torch.int32, sliced_loader(spec, 0, dtypes=(torch.int32,)), shards
        )
        self.weight_param = words
        shape = loadable((len(shards), 2), torch.int64, self._load_shape, shards)
        return {"weight_packed": words, "weight_shape": shape, "weight_scale": scale}

    def _load_shape(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        _, size = self.spec.shard_range(shard)
        if loaded.numel() != 2 or loaded.reshape(2).tolist() != [size, self.spec.in_features]:
            raise ValueError(
                f"shard {shard!r}: weight_shape {loaded.tolist()} != "
                f"[{size}, {self.spec.in_features}]"
            )

    def _quantize_rows(self, rows: torch.Tensor, start: int) -> None:
        codes, scales = quantize_int8(rows)
        self.weight[start : start + rows.shape[0]] = codes
        self.scales[start : start + rows.shape[0]] = scales

    def finish_loading(self) -> dict[str, nn.Parameter]:
        if self.checkpoint == "int":
            self.weight = self.weight_param.data
        elif self.checkpoint == "packed":
            self.weight = unpack_int8_words(self.weight_param.data, self.spec.in_features)
        if self.checkpoint is not None:
            self.scales = self.scale_param.data
            del self.weight_param, self.scale_param  # the packed words are not kept
        dev = self.spec.device
        if dev.type == "cuda":
            self._use_triton()
        elif dev.type == "cpu" and self.spec.in_features % 16 == 0:
            self.compute_dtype, self.bias_in_kernel = CPU_COMPUTE_DTYPE, False
            # The kernel takes its scales in the activations' dtype.
            self.scales = self.scales.to(CPU_COMPUTE_DTYPE)
            weight, scales = self.weight.contiguous(), self.scales

            def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                y = torch.ops.aten._weight_int8pack_mm(x.to(CPU_COMPUTE_DTYPE), weight, scales)
                y = y.to(x.dtype)
                return y if bias is None else y + bias

            self._kernel = run
        else:
            self.compute_dtype, self.bias_in_kernel = self.spec.dtype, True
            self._kernel = self._reference_kernel
        return {"weight": kept(self.weight), "weight_scale": kept(self.scales)}

    def _use_triton(self) -> None:
        from braid.kernels.quant_gemm import int8_linear
        from braid.kernels.quant_gemv import GemvWorkspace, int8_gemv

        self.compute_dtype, self.bias_in_kernel = self.spec.dtype, True
        weight, scales = self.weight.contiguous(), self.scales.contiguous()
        n, k = weight.shape
        workspace = GemvWorkspace.for_launch("int8", n, k, self.spec.device)

        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if x.shape[0] == 1:
                return int8_gemv(x, weight, scales, bias, workspace=workspace)
            return int8_linear(x, weight, scales, bias)

        self._kernel = run

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


@QUANTIZATION_METHODS.register
class W8A16(QuantizationMethod):
    """Per-channel int8 weights. Without a checkpoint config: quantize a float checkpoint as it
    loads. From compressed-tensors (`compressed_tensors.py`): `checkpoint_format` "int" or
    "packed", and the `ignore` list of modules left in floats."""

    name = "w8a16"

    def __init__(
        self,
        config: dict | None,
        *,
        online: bool,
        checkpoint_format: str | None = None,
        ignore: list[str] | None = None,
    ) -> None:
        if config is not None and checkpoint_format is None:
            raise ValueError(
                "w8a16 names braid's online int8 quantization; an INT8 W8A16 checkpoint says "
                "quant_method 'compressed-tensors' in its quantization_config"
            )
        super().__init__(config, online=online)
        self.checkpoint_format, self.ignore = checkpoint_format, ignore or []

    def linear_method(self, spec: LinearSpec, checkpoint_names: tuple[str, ...]):
        if self.skips(spec, checkpoint_names, self.ignore):
            return None
        return Int8LinearMethod(spec, None if self.online else self.checkpoint_format)
