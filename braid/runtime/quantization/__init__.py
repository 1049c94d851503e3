"""Quantized linear layers: how a method stores a layer's weights, loads them from a checkpoint
and multiplies by them, chosen once at load (`EngineConfig.quantization`, or the checkpoint's
`quantization_config`).

Methods sit in `QUANTIZATION_METHODS`, a registry of lazily imported factories, each called as
`factory(quantization_config or None, online=...)` and returning a `base.QuantizationMethod`:

- `awq`, `gptq`: 4-bit weights in groups with zero points (W4A16), from AutoAWQ (GEMM) and
  AutoGPTQ / GPTQModel checkpoints (act-order included), or a float checkpoint quantized to
  nearest as it loads;
- `w8a16`: 8-bit weights, one scale per output channel, from a compressed-tensors INT8 W8A16
  checkpoint or a float checkpoint;
- `fp8`: e4m3 weights with per-channel or per-tensor scales and activations quantized per
  token (W8A8), from `fp8` or compressed-tensors FP8 checkpoints or a float checkpoint;
- `compressed-tensors`: the name of llm-compressor's checkpoints, which resolve to `fp8` or
  `w8a16` by their scheme;
- `gguf`: a GGUF file's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) kept as they are, read from the
  directory braid writes for a .gguf file (`gguf_file.py`).

`docs/quantization.md` has the formats, the kernels and the numbers they compute.
"""

from __future__ import annotations

from braid.runtime.registry import Registry

QUANTIZATION_METHODS: Registry = Registry(
    "quantization",
    {
        "awq": "braid.runtime.quantization.awq",
        "gptq": "braid.runtime.quantization.gptq",
        "fp8": "braid.runtime.quantization.fp8",
        "w8a16": "braid.runtime.quantization.int8",
        "compressed-tensors": "braid.runtime.quantization.compressed_tensors",
        "gguf": "braid.runtime.quantization.gguf",
    },
)

# The `quant_method`s of checkpoints braid reads (config.json's quantization_config).
CHECKPOINT_METHODS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq")


def quantization_method_names() -> list[str]:
    """The names `quantization` accepts, sorted; listing them imports no method."""
    return QUANTIZATION_METHODS.names()


def select_quantization(quantization_config: dict | None, requested: str | None, *, dummy: bool):
    """The model's `base.QuantizationMethod`, or None for a float model.

    `quantization_config`: config.json's (None: a float checkpoint); `requested`: the
    `quantization` setting (None: the checkpoint's). A float checkpoint with a requested method
    is quantized as it loads; so are random weights (`dummy`), with the checkpoint config's
    parameters. `ValueError` for a checkpoint method braid does not read, a request that
    names another method than the checkpoint's, or a config field the method does not support.
    """
    if quantization_config is None:
        if requested is None:
            return None
        return QUANTIZATION_METHODS.get(requested)(None, online=True)
    if not isinstance(quantization_config, dict):
        raise ValueError(
            f"config.json quantization_config must be an object, got {quantization_config!r}"
        )
    method = quantization_config.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"config.json quantization_config: quant_method {method!r} is not supported "
            f"(braid reads {', '.join(CHECKPOINT_METHODS)})"
        )
    chosen = QUANTIZATION_METHODS.get(method)(quantization_config, online=dummy)
    if requested is not None and requested not in (method, chosen.name):
        raise ValueError(
            f"quantization {requested!r} does not match the checkpoint, which is quantized "
            f"with {method!r} (leave quantization unset, or set it to {method!r})"
        )
    return chosen
