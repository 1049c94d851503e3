"""Strict weight loading from safetensors: every checkpoint key must be consumed and every
parameter (every shard of a fused one) filled exactly once; anything else is an error.

A quantized model (config.json's `quantization_config`, or `quantization` for a float
checkpoint) is built inside `quantization.base.building(method)`, its linear layers are bound
to their methods by name, loaded the same strict way, then repacked for the device's kernels
(`Linear.finish_loading`).

A GGUF directory (`quantization/gguf_file.py`: config.json's `quant_method: gguf`) holds raw
blocks: they go as they are to the layers that keep them (`GGUFLinearMethod`), and are
dequantized to float32 for every other parameter (the embedding, norms in a quantized type),
for types braid does not keep, and for all of them with `dequantize_gguf` or another
`quantization` (the file then loads as the float model it holds)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from braid.runtime.layers.linear import Linear
from braid.runtime.models import get_model_class
from braid.runtime.models.config import ModelConfig
from braid.runtime.quantization import select_quantization
from braid.runtime.quantization.base import QuantizationMethod, building
from braid.runtime.quantization.gguf import KEPT_TYPES, gguf_tensor_types

logger = logging.getLogger(__name__)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def _target(model: nn.Module, key: str) -> tuple[str, str | None]:
    """Map a checkpoint key to (braid parameter name, shard)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in model.stacked_params:
            fused, shard = model.stacked_params[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return key, None


def gguf_float(key: str, raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """A GGUF tensor (raw blocks uint8 [..., row bytes], or floats) as float32 [..., K]."""
    if qtype in ("F32", "F16", "BF16"):
        return raw
    from braid.kernels.gguf_reference import dequantize

    rows = raw.reshape(-1, raw.shape[-1])
    if qtype in KEPT_TYPES:
        w = dequantize(rows, qtype)
    else:
        import gguf

        try:
            w = torch.from_numpy(
                gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[qtype])
            )
        except (KeyError, NotImplementedError) as e:
            raise ValueError(
                f"checkpoint key {key}: GGUF type {qtype} cannot be read ({e})"
            ) from None
    return w.reshape(*raw.shape[:-1], w.shape[-1])


# vLLM's names for a layer's per-tensor fp8 KV-cache scales (what stored values are multiplied
# by when read): `self_attn.k_scale` and `v_scale`, or one `kv_scale` for both (AutoFP8).
_KV_SCALE_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)")


def _read_kv_scale(scales: dict[int, dict[str, float]], key: str, tensor: torch.Tensor) -> None:
    m = _KV_SCALE_KEY.fullmatch(key)
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint key {key}: a KV cache scale per head ({tuple(tensor.shape)}) is not "
            "supported, only one per layer"
        )
    value = float(tensor.float().reshape(()))
    if not 0 < value < float("inf"):
        raise ValueError(f"checkpoint key {key}: a KV cache scale must be positive, got {value}")
    layer = scales.setdefault(int(m[1]), {})
    for kind in ("k", "v") if m[2] == "kv_scale" else (m[2][0],):
        layer[kind] = value


def load_weights(
    model: nn.Module,
    model_dir: Path,
    *,
    progress: bool = True,
    gguf_types: dict[str, str] | None = None,
    gguf_head: bool = False,
) -> None:
    """Fill `model` from `model_dir`'s safetensors. `gguf_types`: a GGUF directory's tensor
    types (raw blocks go to parameters that take them, the rest are dequantized); with
    `gguf_head`, the LM head's weight in a type braid keeps also goes to a CPU model's head as
    blocks (`LMHead.keep_gguf_blocks`; a tied head's are the embedding's, dequantized too).
    A layer's fp8 KV-cache scales (`layers.N.self_attn.k_scale` / `v_scale` / `kv_scale`, one
    number each) are not parameters: they are left in `model.kv_cache_scales` ({layer: {"k":
    scale, "v": scale}}), for the KV pool."""
    gguf_types = gguf_types or {}
    params = dict(model.named_parameters())
    expected = {(name, s) for name, p in params.items() for s in p.shard_names}
    filled: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    files = _checkpoint_files(model_dir)
    tied = getattr(getattr(model, "lm_head", None), "tied", False)
    # A model whose checkpoints name its weights in more than one layout (a VLM saved by
    # transformers 4 or 5) maps each key to its own name first (None: a key with no weights).
    rename = getattr(model, "checkpoint_key", None)
    kv_scales: dict[int, dict[str, float]] = {}
    head = getattr(model, "lm_head", None)
    head_name = None
    if (
        gguf_head
        and hasattr(head, "keep_gguf_blocks")
        and getattr(head, "group", None) is None
        and head.weight.device.type == "cpu"
    ):
        head_name = next(n for n, p in params.items() if p is head.weight)
    head_blocks: tuple[torch.Tensor, str] | None = None
    with tqdm(desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for stored in f.keys():
                    bar.update(1)
                    key = rename(stored) if rename is not None else stored
                    if key is None or key.endswith(model.ignored_key_suffixes):
                        continue
                    if tied and key == "lm_head.weight":
                        # Some tied checkpoints store the head too; it is the embedding.
                        continue
                    if _KV_SCALE_KEY.fullmatch(key):
                        _read_kv_scale(kv_scales, key, f.get_tensor(stored))
                        continue
                    name, shard = _target(model, key)
                    param = params.get(name)
                    if param is None:
                        unexpected.append(key)
                        continue
                    if (name, shard) in filled:
                        raise ValueError(f"checkpoint key {key} fills {name} twice")
                    qtype = gguf_types.get(key)
                    if qtype is None and getattr(param, "reads_slices", False):
                        # A tensor-parallel layer reads only its block from the file.
                        tensor = f.get_slice(stored)
                    else:
                        tensor = f.get_tensor(stored)
                    if name == head_name and qtype in KEPT_TYPES:
                        head_blocks = (tensor, qtype)
                    if qtype is not None and not (
                        qtype in KEPT_TYPES and getattr(param, "takes_gguf_blocks", False)
                    ):
                        tensor = gguf_float(key, tensor, qtype)
                    try:
                        param.weight_loader(param, tensor, shard)
                    except ValueError as e:
                        raise ValueError(f"checkpoint key {key}: {e}") from None
                    filled.add((name, shard))
    model.kv_cache_scales = kv_scales
    if head_blocks is not None:
        head.keep_gguf_blocks(*head_blocks)
    if unexpected:
        raise ValueError(
            f"checkpoint keys that no parameter consumes: {sorted(unexpected)[:10]}"
            + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else "")
        )
    missing = sorted(expected - filled, key=str)
    if missing:
        shown = [f"{n}" + (f"[{s}]" if s else "") for n, s in missing[:10]]
        raise ValueError(f"parameters the checkpoint did not fill: {shown}")


def _checkpoint_names(model: nn.Module, name: str, layer: Linear) -> tuple[str, ...]:
    """The checkpoint's module names of a linear layer's shards: q_proj, k_proj and v_proj for
    a fused qkv_proj (through the model's `stacked_params`), else its own name."""
    parts: dict[str | None, str] = {}
    prefix, _, leaf = name.rpartition(".")
    for part, (fused, shard) in getattr(model, "stacked_params", {}).items():
        if fused == leaf:
            parts[shard] = part
    if set(parts) != set(layer.offsets):
        return (name,)
    return tuple(f"{prefix}.{parts[s]}" if prefix else parts[s] for s in layer.offsets)


def _bind_linears(model: nn.Module, method: QuantizationMethod, device: torch.device) -> None:
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            spec = module.spec(name, device)
            module.bind(method.linear_method(spec, _checkpoint_names(model, name, module)), device)


def _fill_random(model: nn.Module, device: torch.device) -> None:
    """Random weights drawn on the target device (an 8B model draws in seconds on a GPU). A
    weight quantized as it loads (a meta-device placeholder) is drawn in floats, shard by
    shard, and loaded through its quantizing loader."""
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.is_meta:
            for shard, (_, rows) in p.shard_slices.items():
                w = torch.empty(rows, p.shape[1], dtype=p.dtype, device=device)
                p.weight_loader(p, w.normal_(0.0, 0.02, generator=gen), shard)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def build_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    progress: bool = True,
    quantization: str | None = None,
    dequantize_gguf: bool = False,
) -> nn.Module:
    """Build the model for `cfg` and fill it from `model_dir` (or randomly with
    `load_format="dummy"`). Its linear layers are quantized as the checkpoint's
    `quantization_config` says, or with the method `quantization` names (a float checkpoint,
    or random weights, quantized as they load); `ValueError` for a method or config field
    braid does not support, naming it. A GGUF directory keeps its blocks, unless
    `dequantize_gguf` or a `quantization` other than "gguf" makes it a float checkpoint."""
    t0 = time.perf_counter()
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if load_format == "auto" and model_dir is None:
        raise ValueError("load_format='auto' needs a model directory")
    qconfig = cfg.quantization_config
    gguf_types = gguf_tensor_types(qconfig)
    if gguf_types is not None and (dequantize_gguf or quantization not in (None, "gguf")):
        qconfig = None  # every block is dequantized as it loads: a float checkpoint
    method = select_quantization(qconfig, quantization, dummy=load_format == "dummy")
    if method is not None and cfg.is_multimodal:
        # Their towers and projectors read their own weights' dtype and device, and which of
        # their layers a checkpoint quantizes is untested: refused rather than guessed.
        raise ValueError(
            f"quantization ({method.name}) of vision-language models ({cfg.architecture}) is "
            "not supported yet"
        )
    cls = get_model_class(cfg.architecture)
    # Parameters are created with torch.empty (no init cost); buffers such as the rotary tables
    # are computed on the target device.
    with torch.device(device), building(method):
        model = cls(cfg, dtype, max_positions)
        if method is not None:
            _bind_linears(model, method, device)
    if load_format == "dummy":
        _fill_random(model, device)
    else:
        keep_head = method is not None and method.name == "gguf"
        load_weights(
            model, model_dir, progress=progress, gguf_types=gguf_types, gguf_head=keep_head
        )
    for module in model.modules():
        if isinstance(module, Linear):
            module.finish_loading()
    for module in model.modules():  # a layer's own re-layout once its weights are in
        if hasattr(module, "after_weights_loaded"):
            module.after_weights_loaded()
    model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "model %s loaded: %.1f MB of weights%s in %.2f s",
        cfg.architecture,
        nbytes / 1e6,
        f" ({method.name})" if method is not None else "",
        time.perf_counter() - t0,
    )
    return model
