"""The interfaces of a quantization method and the scope a quantized model is built in.

A `QuantizationMethod` is a model's quantization, chosen once at load (from config.json's
`quantization_config`, or `EngineConfig.quantization` for a float checkpoint). It gives each
linear layer its `LinearMethod` (or leaves the layer in floats). A `LinearMethod` is one layer's
weights: it creates them as parameters that load their checkpoint shards strictly, repacks them
for the device's kernel once loading is done, and multiplies by them (`apply`).

While the model is built inside `building(method)`, `Linear` creates no weight of its own (a
placeholder on the meta device, so nothing is allocated) and the fused kernels of
`braid.runtime.layers.fusion`, which read float weights, are not chosen; the loader then binds
each layer to its method by name. A scoped context variable, not a module global: two loads in
one process (threads, tests) never see each other's method.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "str | None"], None]

# Activations of the quantized CPU kernels (torch's int8 and int4 weight-packed matmuls take
# bfloat16); a float32 model's quantized layers round their input and output through it.
CPU_COMPUTE_DTYPE = torch.bfloat16

# BRAID_GEMV_INPUTS_AHEAD (for measuring; read when a model loads): a one-row int4 or fp8 GEMV
# on CUDA gets its input prepared before its launch (`pack_int4_inputs`, `per_token_quant_fp8`)
# instead of in every program of the GEMV; the same bits. "1": by a launch of its own before
# each such GEMV; "fused": a decoder layer's norms and activation prepare the input of the
# projection after them in their own launch (`layers.fusion.select_prepared_one_row_forward`;
# o_proj keeps its own path). Those GEMVs then take their own launch shapes (`config_for`'s
# "int4_ahead", "fp8_ahead").
INPUTS_AHEAD_ENV = "BRAID_GEMV_INPUTS_AHEAD"


def inputs_ahead() -> str:
    """`INPUTS_AHEAD_ENV`'s value: "0" (off), "1" or "fused"; `ValueError` for another."""
    value = os.environ.get(INPUTS_AHEAD_ENV, "0")
    if value not in ("0", "1", "fused"):
        raise ValueError(f"{INPUTS_AHEAD_ENV} must be 0, 1 or fused, got {value!r}")
    return value


@dataclass(frozen=True)
class PreparedInputs:
    """How a layer's one-row GEMV takes its input made before its launch (a `LinearMethod`'s
    `prepared`, where its kernel has such a form): `prepare(x, **producer)` makes it from x
    [1, K], or in the place of the kernel before it with that kernel's arguments
    (`activation="silu_and_mul"` over [1, 2K]; `norm_weight`, `eps`, `residual`,
    `residual_out`: the RMSNorm); `apply(like, prepared, bias)` is the projection of it, `like`
    any [1, K] tensor of the input's dtype (its values are not read)."""

    prepare: Callable[..., Any]
    apply: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class LinearSpec:
    """What a method knows of the layer it serves: its name in the model (for errors), its
    input size, its output row shards in order (`{shard: (first row, rows)}`; a plain layer has
    the one shard None), the model's dtype (the activations') and the device."""

    name: str
    in_features: int
    shards: dict[str | None, tuple[int, int]]
    dtype: torch.dtype
    device: torch.device

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.shards.values())

    def shard_range(self, shard: str | None) -> tuple[int, int]:
        if shard not in self.shards:
            raise ValueError(f"unknown shard {shard!r} (have {list(self.shards)})")
        return self.shards[shard]


class LinearMethod(ABC):
    """How one linear layer stores its weight, loads it and multiplies by it (one instance per
    layer, holding that layer's tensors).

    The loader drives it once, in order: `create_weights()`, whose parameters each carry
    `weight_loader(param, tensor, shard)` (checks the tensor's shape and dtype, raises
    `ValueError` otherwise) and `shard_names` (the shards the checkpoint must fill, each once;
    empty: filled by another parameter's loader, or optional); the checkpoint's tensors; then
    `finish_loading()`, which repacks them for the device's kernel and returns the parameters
    the layer holds from then on. After that, `apply` and `reference` may be called.
    """

    def __init__(self, spec: LinearSpec) -> None:
        self.spec = spec
        # The kernel `finish_loading` chooses: (x [rows, in_features], bias) -> [rows, out].
        self._kernel: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] = (
            self._reference_kernel
        )
        # The one-row GEMV's form over an input made before it, where `finish_loading` chose
        # one (`INPUTS_AHEAD_ENV`).
        self.prepared: PreparedInputs | None = None

    @abstractmethod
    def create_weights(self) -> dict[str, nn.Parameter]:
        """The parameters to load (names as the checkpoint spells them)."""

    @abstractmethod
    def finish_loading(self) -> dict[str, nn.Parameter]:
        """Convert the loaded tensors to the kernel's layout and choose the kernel for the
        device (once). Returns the layer's parameters from now on; `ValueError` for loaded
        values the method cannot use (naming the layer)."""

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` for x [..., in_features], in x's dtype, through the kernel
        `finish_loading` chose."""
        if x.dim() == 2 and x.stride(-1) == 1 and x.shape[0]:
            # The common input (a batch's rows): straight to the kernel. The reshapes below
            # cost about 3 us a call on the CPU, a tenth of a one-row int4 kernel's time.
            return self._kernel(x, bias)
        x2 = flat_rows(x)
        n = self.spec.out_features
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], n)
        return self._kernel(x2, bias).reshape(*x.shape[:-1], n)

    def _reference_kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.reference(x, bias)

    @abstractmethod
    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What `apply` computes, in plain torch: the weight dequantized to float32 and
        multiplied in float32, with `apply`'s rounding points (its activation dtype, where the
        bias is added). Equal to `apply` up to the order of float32 sums. Where the kernel's
        layout is opaque (torch's CPU int4 kernel), `dequantize` reads the weight back through
        the kernel, and where a device has no kernel (fp8 on the CPU) this is what `apply`
        runs: neither is a check of the kernel, which tests make against the checkpoint."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 [out_features, in_features] weight `apply` multiplies by."""


class WeightOnlyMethod(LinearMethod):
    """A method that multiplies float activations by dequantized weights (W4A16, W8A16). Its
    kernel takes activations in `compute_dtype` (the model's dtype on CUDA, bfloat16 for
    torch's CPU kernels) and adds the bias inside (`bias_in_kernel`) or after rounding; both
    are set by `finish_loading`, and `reference` follows them."""

    compute_dtype: torch.dtype
    bias_in_kernel: bool = True

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = flat_rows(x)
        y = x2.to(self.compute_dtype).float() @ self.dequantize().T
        if bias is not None and self.bias_in_kernel:
            y = y + bias.float()
        y = y.to(self.compute_dtype).to(x.dtype)
        if bias is not None and not self.bias_in_kernel:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class QuantizationMethod(ABC):
    """A model's quantization: which linear layers are quantized and each one's method.

    `name` is the method's name in `QUANTIZATION_METHODS`. Built from the checkpoint's
    `quantization_config` (validated at construction: `ValueError` naming the field), or with
    `config=None` to quantize a float checkpoint's weights as they load (`online`); `online` is
    also set for random weights (`load_format="dummy"`), drawn in floats and quantized.
    """

    name: str

    def __init__(self, config: dict | None, *, online: bool) -> None:
        self.config = config or {}
        self.online = online or config is None

    @abstractmethod
    def linear_method(
        self, spec: LinearSpec, checkpoint_names: tuple[str, ...]
    ) -> LinearMethod | None:
        """The method of the layer `spec`, or None to keep it in floats (a layer the
        checkpoint left unquantized). `checkpoint_names`: the checkpoint's module names of the
        layer's shards (q_proj, k_proj, v_proj of a fused qkv_proj). `ValueError` if the
        checkpoint quantized some of a fused layer's shards and not the others, or the layer's
        shape does not fit the method (naming the layer and the value)."""

    def skips(
        self, spec: LinearSpec, checkpoint_names: tuple[str, ...], patterns: list[str]
    ) -> bool:
        """Whether the checkpoint leaves the layer unquantized: every one of its names matches
        one of `patterns` (`matches_module`); `ValueError` if only some do."""
        hit = [any(matches_module(n, p) for p in patterns) for n in checkpoint_names]
        if any(hit) and not all(hit):
            kept = [n for n, h in zip(checkpoint_names, hit) if not h]
            raise ValueError(
                f"{spec.name}: the checkpoint leaves some of this fused layer's parts in floats "
                f"and quantizes {kept}; braid needs all or none of them quantized"
            )
        return all(hit) and bool(hit)


def matches_module(name: str, pattern: str) -> bool:
    """Whether module `name` is named by `pattern` in a checkpoint's list of unquantized
    modules: `re:<regex>` matches from the start of the name (compressed-tensors); otherwise the
    name itself, a dotted suffix of it (`lm_head`, `mlp.gate`), or a dotted prefix of it
    (`model.visual`)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


_BUILDING: ContextVar[QuantizationMethod | None] = ContextVar("braid_quantization", default=None)


@contextmanager
def building(method: QuantizationMethod | None) -> Iterator[None]:
    """The scope a model is constructed in: inside it, with a method, `Linear` leaves its
    weight to be bound by the loader and the fused float kernels are not chosen."""
    token = _BUILDING.set(method)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def building_quantized() -> QuantizationMethod | None:
    """The quantization of the model being built in this context, if any."""
    return _BUILDING.get()


# ---- helpers the methods share ----------------------------------------------------------------


def loadable(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    loader: WeightLoader,
    shard_names: tuple[str | None, ...],
    *,
    device: torch.device | str | None = None,
    fill: float | None = None,
) -> nn.Parameter:
    """A parameter the strict loader fills: `loader` and `shard_names` attached."""
    data = torch.empty(shape, dtype=dtype, device=device)
    if fill is not None:
        data.fill_(fill)
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader
    p.shard_names = shard_names
    return p


def kept(t: torch.Tensor) -> nn.Parameter:
    """A loaded or derived tensor held as a parameter (counted in the model's weights)."""
    return nn.Parameter(t, requires_grad=False)


def check_dtype(loaded: torch.Tensor, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if loaded.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{what}: checkpoint dtype {loaded.dtype} is not one of ({names})")


def sliced_loader(
    spec: LinearSpec,
    dim: int,
    *,
    unit: int = 1,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> WeightLoader:
    """Loads a shard into its slice of the fused output dimension `dim` (rows of W, or the
    packed columns of a transposed layout: `unit` output rows per element), checking the
    tensor's shape and dtype."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        start, size = spec.shard_range(shard)
        expected = list(param.shape)
        expected[dim] = size // unit
        if tuple(loaded.shape) != tuple(expected):
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != expected "
                f"{tuple(expected)}"
            )
        if dtypes is not None:
            check_dtype(loaded, dtypes, f"shard {shard!r}")
        param.data.narrow(dim, start // unit, size // unit).copy_(loaded)

    return load


def row_scale_loader(spec: LinearSpec) -> WeightLoader:
    """Loads a per-output scale [out_features]: each shard's checkpoint tensor is one scale for
    all its rows (shape (), (1,) or (1, 1): per-tensor) or one per row ((rows,) or (rows, 1):
    per-channel). Scales must be finite and positive."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        start, size = spec.shard_range(shard)
        check_dtype(loaded, (torch.float32, torch.float16, torch.bfloat16), f"shard {shard!r}")
        if loaded.numel() == 1 and loaded.dim() <= 2:
            values = loaded.reshape(1).expand(size)
        elif tuple(loaded.shape) in ((size,), (size, 1)):
            values = loaded.reshape(size)
        else:
            raise ValueError(
                f"shard {shard!r}: scale shape {tuple(loaded.shape)} is neither one scale nor "
                f"one per row ({size},)"
            )
        if not bool(torch.isfinite(values).all()) or bool((values <= 0).any()):
            raise ValueError(f"shard {shard!r}: scales must be finite and positive")
        param.data[start : start + size].copy_(values)

    return load


def check_shard_multiple(spec: LinearSpec, multiple: int, why: str) -> None:
    """`ValueError` naming the layer unless every shard's rows (and so its offset) are a
    multiple of `multiple`."""
    for shard, (_, size) in spec.shards.items():
        if size % multiple:
            part = "" if shard is None else f" (shard {shard!r})"
            raise ValueError(
                f"{spec.name}: {size} output rows{part} are not a multiple of {multiple}, "
                f"which {why} needs"
            )


def online_placeholder(
    spec: LinearSpec, quantize_rows: Callable[[torch.Tensor, int], None]
) -> nn.Parameter:
    """The float weight a layer quantized online loads through: a meta-device parameter (no
    storage) of the float shape whose loader hands each shard's rows, on the layer's device,
    to `quantize_rows(rows, first_row)`. `shard_slices` lets a random fill draw per shard."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        start, size = spec.shard_range(shard)
        expected = (size, spec.in_features)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != expected {expected}"
            )
        if not loaded.is_floating_point():
            raise ValueError(f"shard {shard!r}: a float weight to quantize, got {loaded.dtype}")
        quantize_rows(loaded.to(spec.device), start)

    p = loadable(
        (spec.out_features, spec.in_features),
        spec.dtype,
        load,
        tuple(spec.shards),
        device="meta",
    )
    p.shard_slices = dict(spec.shards)
    return p


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] with unit stride in K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
