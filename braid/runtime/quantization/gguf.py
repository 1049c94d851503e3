"""`gguf`: a GGUF file's quantized tensors kept in their blocks (Q4_0, Q4_1, Q8_0, Q4_K,
Q6_K) instead of converted to floats.

A GGUF model is read into a directory whose `config.json` says `quantization_config:
{"quant_method": "gguf", "tensor_types": {checkpoint key: GGUF type}}` and whose safetensors
hold each quantized tensor as its raw blocks, uint8 [rows, row bytes] (`gguf_file.py`). Each
linear layer whose shards are all float (F32, F16, BF16) stays a float layer; any other gets a
`GGUFLinearMethod`: its shards may differ in type (a Q4_K_M file has Q6_K `attn_v` beside
Q4_K `attn_q`), so consecutive shards of one type form a segment, each with its own kernel,
and the outputs are concatenated. Tensors of a type braid does not keep (Q5_K, IQ4_NL, ...)
are dequantized to floats by the loader (one log line names the types), and so are quantized
tensors outside linear layers (the embedding). On the CPU the LM head keeps the file's blocks
too (a `GGUFLinearMethod` of its own, `LMHead.keep_gguf_blocks`; without tensor parallelism)
for steps of few rows, beside the float weight (its tied embedding's table).

Kernels, chosen once per segment in `finish_loading`:
- CUDA: `braid.kernels.gguf_linear` over the blocks decoded into exact codes and the blocks'
  own scales (`gguf_reference.KernelPlanes`: per group, and the K-quants' per super-block),
  in the model's dtype;
- CPU: torch's int4 weight-packed matmul (`gguf_cpu.py`: bfloat16 activations, codes exact,
  scales rounded to bfloat16), when N is a multiple of 16;
- otherwise: the torch reference over the decoded planes (weights still quantized in memory).

A segment of float shards in a quantized layer multiplies in the model's dtype.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from braid.kernels.gguf_reference import (
    BLOCK_LAYOUTS,
    KernelPlanes,
    decode,
    dequantize_kernel_planes,
    gguf_linear_reference,
    kernel_planes,
    row_bytes,
)
from braid.runtime.quantization import QUANTIZATION_METHODS
from braid.runtime.quantization.base import (
    CPU_COMPUTE_DTYPE,
    LinearMethod,
    LinearSpec,
    QuantizationMethod,
    flat_rows,
    kept,
    loadable,
)
from braid.runtime.quantization.gguf_cpu import CpuInt4Weight, fits_cpu, to_cpu_int4

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")
KEPT_TYPES = tuple(BLOCK_LAYOUTS)


def gguf_tensor_types(quantization_config: dict | None) -> dict[str, str] | None:
    """A GGUF directory's {checkpoint key: GGUF type}, or None for any other checkpoint."""
    if not quantization_config or quantization_config.get("quant_method") != "gguf":
        return None
    types = quantization_config.get("tensor_types")
    if not isinstance(types, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in types.items()
    ):
        raise ValueError(
            "config.json quantization_config.tensor_types must map checkpoint keys to GGUF "
            f"type names, got {type(types).__name__}"
        )
    return types


class _Segment(ABC):
    """Consecutive output rows (`start`, `rows`) of one kind, with the kernel chosen for them:
    called on x [M, K] with the rows' bias slice, it returns [M, rows] in x's dtype."""

    def __init__(self, start: int, rows: int) -> None:
        self.start, self.rows = start, rows

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def kernel(self) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """The call itself, or a function that computes it with fewer steps on the way."""
        return self

    @abstractmethod
    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What the call computes, in plain torch with the same rounding points."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, K] weight the call multiplies by."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor | None]:
        """What the segment holds, by name (the layer's parameters)."""


class _FloatSegment(_Segment):
    def __init__(self, start: int, weight: torch.Tensor) -> None:
        super().__init__(start, weight.shape[0])
        self.weight = weight

    def __call__(self, x, bias):
        return F.linear(x, self.weight, bias)

    reference = __call__

    def dequantize(self):
        return self.weight.float()

    def tensors(self):
        return {"weight": self.weight}


class _TritonSegment(_Segment):
    def __init__(self, start: int, planes: KernelPlanes) -> None:
        super().__init__(start, planes.codes.shape[0])
        self.planes = planes

    def __call__(self, x, bias):
        from braid.kernels.gguf_gemm import gguf_linear

        return gguf_linear(x, self.planes, bias)

    def reference(self, x, bias):
        return gguf_linear_reference(x, self.planes, bias)

    def dequantize(self):
        return dequantize_kernel_planes(self.planes)

    def tensors(self):
        return self.planes.tensors()


class _CpuSegment(_Segment):
    """torch's CPU int4 kernel: bfloat16 in and out, the bias added after, in x's dtype."""

    def __init__(self, start: int, weight: CpuInt4Weight, rows: int) -> None:
        super().__init__(start, rows)
        self.weight = weight
        self._dequantized: torch.Tensor | None = None
        self._run = weight.linear_fn()

    def __call__(self, x, bias):
        return self._run(x, bias)

    def kernel(self):
        return self._run

    def reference(self, x, bias):
        # Unpacking goes through the kernel (an identity matrix's worth of it): done once, on
        # the first reference call (tests), and kept. So this checks what is around the
        # kernel, not the packing: the tests check that against the file's blocks.
        if self._dequantized is None:
            self._dequantized = self.weight.dequantize()
        y = (x.to(CPU_COMPUTE_DTYPE).float() @ self._dequantized.T).to(CPU_COMPUTE_DTYPE)
        y = y.to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self):
        return self.weight.dequantize()

    def tensors(self):
        return {"qweight": self.weight.packed, "scales_and_offsets": self.weight.table}


class _ReferenceSegment(_Segment):
    """The blocks' planes kept as they are and dequantized at every call (shapes no kernel
    takes): in float32, rounded once to x's dtype."""

    def __init__(self, start: int, planes: KernelPlanes) -> None:
        super().__init__(start, planes.codes.shape[0])
        self.planes = planes

    def __call__(self, x, bias):
        return gguf_linear_reference(x, self.planes, bias, as_kernel=False)

    reference = __call__

    def dequantize(self):
        return dequantize_kernel_planes(self.planes)

    def tensors(self):
        return self.planes.tensors()


class GGUFLinearMethod(LinearMethod):
    """A linear layer whose shards are GGUF tensors: `shard_types` gives each shard's GGUF
    type (one of `KEPT_TYPES`), or "float" for a float tensor (or one the loader
    dequantized). The checkpoint fills `weight` shard by shard with raw blocks (uint8 [rows,
    row bytes]) or floats [rows, in_features]."""

    def __init__(self, spec: LinearSpec, shard_types: dict[str | None, str]) -> None:
        super().__init__(spec)
        self.shard_types = shard_types
        for shard, qtype in shard_types.items():
            if qtype == "float":
                continue
            block = BLOCK_LAYOUTS[qtype][0]
            if spec.in_features % block:
                part = "" if shard is None else f" (shard {shard!r})"
                raise ValueError(
                    f"{spec.name}{part}: {qtype} blocks of {block} do not divide its input "
                    f"size {spec.in_features}"
                )
        self.loaded: dict[str | None, torch.Tensor] = {}
        self.segments: list[_Segment] = []

    def create_weights(self) -> dict[str, nn.Parameter]:
        spec = self.spec
        p = loadable(
            (spec.out_features, spec.in_features),
            torch.uint8,
            self._load,
            tuple(spec.shards),
            device="meta",
        )
        # The loader hands this parameter raw blocks rather than dequantizing them.
        p.takes_gguf_blocks = True
        return {"weight": p}

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        self.load_shard(loaded, shard)

    def load_shard(self, loaded: torch.Tensor, shard: str | None) -> None:
        """Take shard `shard`'s tensor: raw blocks of its type, or floats [rows, in]."""
        _, size = self.spec.shard_range(shard)
        qtype, k = self.shard_types[shard], self.spec.in_features
        if qtype == "float":
            if not loaded.is_floating_point() or tuple(loaded.shape) != (size, k):
                raise ValueError(
                    f"shard {shard!r}: a float tensor of shape {(size, k)} expected, got "
                    f"{loaded.dtype} {tuple(loaded.shape)}"
                )
        else:
            expected = (size, row_bytes(qtype, k))
            if loaded.dtype != torch.uint8 or tuple(loaded.shape) != expected:
                raise ValueError(
                    f"shard {shard!r}: {qtype} blocks uint8 {expected} expected, got "
                    f"{loaded.dtype} {tuple(loaded.shape)}"
                )
        self.loaded[shard] = loaded

    def finish_loading(self) -> dict[str, nn.Parameter]:
        spec = self.spec
        runs: list[tuple[str, int, list[torch.Tensor]]] = []
        for shard, (start, _) in spec.shards.items():
            qtype = self.shard_types[shard]
            if runs and runs[-1][0] == qtype:
                runs[-1][2].append(self.loaded[shard])
            else:
                runs.append((qtype, start, [self.loaded[shard]]))
        self.loaded = {}
        self.segments = [self._segment(q, start, torch.cat(ts)) for q, start, ts in runs]
        segments = self.segments
        if len(segments) == 1:
            self._kernel = segments[0].kernel()
        else:

            def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                return torch.cat([s(x, _part(bias, s)) for s in segments], dim=-1)

            self._kernel = run
        params: dict[str, nn.Parameter] = {}
        for i, s in enumerate(segments):
            for name, t in s.tensors().items():
                if t is not None:
                    params[f"{name}_{i}" if len(segments) > 1 else name] = kept(t)
        return params

    def _segment(self, qtype: str, start: int, data: torch.Tensor) -> _Segment:
        spec, dev = self.spec, self.spec.device
        if qtype == "float":
            return _FloatSegment(start, data.to(device=dev, dtype=spec.dtype))
        planes = decode(data.to(dev), qtype)
        if dev.type == "cuda":
            return _TritonSegment(start, kernel_planes(planes, qtype))
        if dev.type == "cpu" and fits_cpu(data.shape[0]):
            return _CpuSegment(start, to_cpu_int4(planes, qtype), data.shape[0])
        return _ReferenceSegment(start, kernel_planes(planes, qtype))

    def cpu_int4_weights(self) -> list[CpuInt4Weight] | None:
        """Each segment's weight in torch's CPU int4 form, in output order, when every
        segment has one (the native CPU decode multiplies by them); else None."""
        if not all(isinstance(s, _CpuSegment) for s in self.segments):
            return None
        return [s.weight for s in self.segments]

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = flat_rows(x)
        y = torch.cat([s.reference(x2, _part(bias, s)) for s in self.segments], dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([s.dequantize() for s in self.segments])


def _part(bias: torch.Tensor | None, s: _Segment) -> torch.Tensor | None:
    return None if bias is None else bias[s.start : s.start + s.rows]


@QUANTIZATION_METHODS.register
class GGUF(QuantizationMethod):
    """A GGUF file's blocks, from the `tensor_types` its directory's config declares."""

    name = "gguf"

    def __init__(self, config: dict | None, *, online: bool) -> None:
        if config is None:
            raise ValueError(
                "quantization 'gguf' keeps a GGUF file's own blocks: pass the .gguf file as the "
                "model (braid does not quantize a float checkpoint into GGUF blocks)"
            )
        if online:
            raise ValueError(
                "a GGUF model's blocks come from its file: random weights (load_format="
                "'dummy') cannot be drawn in them; load the .gguf file"
            )
        super().__init__(config, online=False)
        self.tensor_types = gguf_tensor_types(config)
        other = Counter(t for t in self.tensor_types.values() if t not in KEPT_TYPES + FLOAT_TYPES)
        if other:
            listed = ", ".join(f"{t} ({n})" for t, n in sorted(other.items()))
            logger.info(
                "GGUF tensors of types %s are dequantized to floats at load (braid keeps %s "
                "quantized)",
                listed,
                ", ".join(KEPT_TYPES),
            )

    def linear_method(
        self, spec: LinearSpec, checkpoint_names: tuple[str, ...]
    ) -> LinearMethod | None:
        types: dict[str | None, str] = {}
        for shard, name in zip(spec.shards, checkpoint_names):
            qtype = self.tensor_types.get(f"{name}.weight")
            if qtype is None:
                raise ValueError(
                    f"{spec.name}: the GGUF directory declares no type for {name}.weight"
                )
            types[shard] = qtype if qtype in KEPT_TYPES else "float"
        if all(t == "float" for t in types.values()):
            return None
        return GGUFLinearMethod(spec, types)
