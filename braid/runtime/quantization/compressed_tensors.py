"""compressed-tensors checkpoints (llm-compressor, `quant_method: "compressed-tensors"`): the
config's scheme picks one of braid's methods.

- FP8 W8A8: weights {num_bits 8, type float, strategy tensor | channel}, input activations
  {num_bits 8, type float, strategy token | tensor, dynamic or static} -> `fp8`;
- INT8 W8A16: weights {num_bits 8, type int, symmetric, strategy channel | tensor}, no input
  activations, format int-quantized / naive-quantized (an int8 `weight`) or pack-quantized
  (`weight_packed`) -> `w8a16`.

Every group of `config_groups` must target `Linear` with the same scheme; `ignore` lists the
modules left in floats (names, or `re:` regexes). A `kv_cache_scheme` of static per-tensor fp8
(num_bits 8, type float, strategy tensor) is accepted: its scales are the checkpoint's
`self_attn.k_scale` / `v_scale`, which the loader hands to an fp8 KV cache
(`kv_cache_dtype="fp8"`; unused otherwise). Anything else (4-bit pack-quantized, sparsity,
another KV-cache scheme, block or group strategies, asymmetric int8) is refused with the field
that asks for it.
"""

from __future__ import annotations

from typing import Any

from braid.runtime.quantization import QUANTIZATION_METHODS
from braid.runtime.quantization.base import QuantizationMethod
from braid.runtime.quantization.fp8 import FP8
from braid.runtime.quantization.int8 import W8A16

INT_FORMATS = {"int-quantized": "int", "naive-quantized": "int", "pack-quantized": "packed"}
FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def _scheme(config: dict[str, Any]) -> tuple[dict, dict | None]:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config config_groups: a compressed-tensors config needs one")
    schemes = []
    for name, group in groups.items():
        targets = group.get("targets") or []
        if "Linear" not in targets:
            raise ValueError(
                f"quantization_config config_groups.{name}.targets: {targets!r} (braid "
                "quantizes Linear layers)"
            )
        if group.get("output_activations"):
            raise ValueError(
                f"quantization_config config_groups.{name}.output_activations: not supported"
            )
        schemes.append((group.get("weights") or {}, group.get("input_activations")))
    if any(s != schemes[0] for s in schemes[1:]):
        raise ValueError(
            "quantization_config config_groups: groups with different schemes are not supported"
        )
    return schemes[0]


def _describe(weights: dict, acts: dict | None) -> str:
    def short(d: dict | None) -> str:
        if d is None:
            return "none"
        keys = ("num_bits", "type", "strategy", "symmetric", "dynamic")
        return "{" + ", ".join(f"{k}={d.get(k)!r}" for k in keys if k in d) + "}"

    return f"weights {short(weights)}, input activations {short(acts)}"


@QUANTIZATION_METHODS.register
def compressed_tensors(config: dict | None, *, online: bool) -> QuantizationMethod:
    """The braid method for a compressed-tensors `quantization_config`."""
    if config is None:
        raise ValueError(
            "compressed-tensors reads checkpoints made by llm-compressor; to quantize a float "
            "checkpoint as it loads, use quantization 'fp8' or 'w8a16'"
        )
    if config.get("sparsity_config"):
        raise ValueError("quantization_config sparsity_config: not supported")
    kv = config.get("kv_cache_scheme")
    if kv and not (
        kv.get("num_bits") == 8
        and kv.get("type") == "float"
        and kv.get("strategy") == "tensor"
        and not kv.get("dynamic")
        and kv.get("symmetric", True)
    ):
        raise ValueError(
            "quantization_config kv_cache_scheme: only static per-tensor fp8 (num_bits 8, type "
            f"float, strategy tensor) is supported, got {kv!r}"
        )
    fmt = config.get("format")
    ignore = config.get("ignore") or []
    weights, acts = _scheme(config)
    strategy = weights.get("strategy")
    if weights.get("num_bits") == 8 and weights.get("type") == "float" and acts is not None:
        if (
            fmt in FLOAT_FORMATS
            and strategy in ("tensor", "channel")
            and acts.get("num_bits") == 8
            and acts.get("type") == "float"
            and acts.get("strategy") in ("token", "tensor")
        ):
            return FP8(config, online=online, ignore=ignore)
    if weights.get("num_bits") == 8 and weights.get("type") == "int" and acts is None:
        if fmt in INT_FORMATS and strategy in ("channel", "tensor") and weights.get("symmetric"):
            return W8A16(config, online=online, checkpoint_format=INT_FORMATS[fmt], ignore=ignore)
    raise ValueError(
        f"quantization_config: compressed-tensors format {fmt!r} with "
        f"{_describe(weights, acts)} is not supported (braid reads FP8 W8A8 and INT8 W8A16)"
    )
