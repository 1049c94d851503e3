"""Linear layers whose weights know how to load their shards.

A fused projection (QKV, gate-up) is one weight made of named row blocks; each checkpoint
tensor names the block it fills, and loading checks the shape of every block. A quantized
layer's weights are its `braid.runtime.quantization` method's, bound by the loader.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.quantization.base import LinearMethod, LinearSpec, building_quantized

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


# oneDNN creates (and JIT-compiles) one primitive per distinct input shape, so every new
# token count a linear sees adds one per weight shape, about 1 MB each; torch keeps them in two
# LRU caches (oneDNN's and ideep's) of 1024 entries by default. On a server, where token counts
# vary without end, that is up to ~1 GB of native heap that grows for as long as new shapes come
# (the soak's scheduler RSS kept rising: docs/benchmarks.md, Soak). At 256 entries the caches
# stay near 120 MB on SmolLM2's shapes, the shapes used most (decode batches) stay cached, and
# an evicted one costs a few ms to rebuild. Set before the first oneDNN call, which reads them;
# the environment, where set, wins.
ONEDNN_CACHE_ENTRIES = 256


@functools.cache
def _onednn_works() -> bool:
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(var, str(ONEDNN_CACHE_ENTRIES))
    try:
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        return torch.allclose(_onednn_linear(x, w, None), F.linear(x, w), atol=1e-5)
    except (RuntimeError, AttributeError):
        return False


def select_linear_fn(device: torch.device, dtype: torch.dtype) -> LinearFn:
    """The matmul for a weight on `device` in `dtype`, chosen once per layer.

    On CPU in float32, oneDNN's linear is used where torch has it: on the 2-core development
    machine it runs the LM head (49152 x 576) clearly faster than the BLAS `F.linear` path at
    batch 1 and 16. Elsewhere, `F.linear`: a Triton GEMV (`braid.kernels.skinny_linear`) is no
    faster than cuBLAS at batch 1 on Llama-3.1-8B shapes on an H200, so plain linears stay on
    cuBLAS (both measured: docs/benchmarks.md, Figures behind design choices).
    """
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        if _onednn_works():
            return _onednn_linear
    return F.linear


class Linear(nn.Module):
    """`y = x @ W.T + b`, where W (and b) are stacked from named row shards.

    `shards` maps a shard name to its number of output rows, in order; a plain linear layer has
    the single shard `None`. Every parameter carries `weight_loader(param, tensor, shard)` and
    `shard_names`, which the strict weight loader uses to check that each shard is filled once.

    A layer constructed inside `quantization.base.building(method)` (a quantized model being
    loaded) holds only a placeholder `weight` on the meta device (no storage) until the loader
    calls `bind`: then it gets its `LinearMethod`'s parameters (`method`), or a float weight for
    a layer the checkpoint leaves unquantized; once the checkpoint is in, the loader calls
    `finish_loading`. A float layer's `method` is None.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str | None, int],
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.dtype = dtype
        self.offsets: dict[str | None, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size
        self.out_features = start
        self.method: LinearMethod | None = None
        quantized = building_quantized() is not None
        self.weight = self._float_weight("meta" if quantized else None)
        self.bias = (
            nn.Parameter(torch.empty(start, dtype=dtype), requires_grad=False) if bias else None
        )
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard
            self.bias.shard_names = tuple(shards)
        if quantized:
            self._forward = self._unbound
        else:
            self._use_floats()

    def _float_weight(self, device: torch.device | str | None) -> nn.Parameter:
        w = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=self.dtype, device=device),
            requires_grad=False,
        )
        w.weight_loader = self._load_shard
        w.shard_names = tuple(self.offsets)
        return w

    def _use_floats(self) -> None:
        self._linear = select_linear_fn(self.weight.device, self.dtype)
        self._forward = self._float_forward

    def spec(self, name: str, device: torch.device) -> LinearSpec:
        """What a quantization method needs to know of this layer, named `name` in its model."""
        return LinearSpec(name, self.in_features, dict(self.offsets), self.dtype, device)

    def bind(self, method: LinearMethod | None, device: torch.device) -> None:
        """Give a layer built for a quantized model its weights on `device`: `method`'s
        parameters, or (None) a float weight, which keeps the attributes the model set on the
        placeholder (a wrapped loader)."""
        placeholder = self._parameters.pop("weight")
        if method is None:
            self.weight = self._float_weight(device)
            self.weight.__dict__.update(placeholder.__dict__)
            self._use_floats()
            return
        self.method = method
        for name, p in method.create_weights().items():
            self.register_parameter(name, p)
        self._forward = method.apply

    def finish_loading(self) -> None:
        """After the checkpoint is loaded: a quantized layer's method repacks its weights for
        the device's kernel, and they replace the loaded parameters (the bias stays)."""
        if self.method is None:
            return
        for name in [n for n in self._parameters if n != "bias"]:
            del self._parameters[name]
        for name, p in self.method.finish_loading().items():
            self.register_parameter(name, p)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        if shard not in self.offsets:
            raise ValueError(f"unknown shard {shard!r} (have {list(self.offsets)})")
        start, size = self.offsets[shard]
        expected = (size, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != expected {expected}"
            )
        param.data[start : start + size].copy_(loaded)

    def _float_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._linear(x, self.weight, bias)

    def _unbound(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("this Linear was built for a quantized model and never bound")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.bias)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` in plain torch: a quantized layer's method's `reference` (its weight
        dequantized, multiplied in float32 with the same rounding points); a float layer's
        forward itself."""
        if self.method is None:
            return self._float_forward(x, self.bias)
        return self.method.reference(x, self.bias)
