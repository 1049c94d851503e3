"""A GGUF file read into a directory braid loads with its tensors kept quantized.

The directory holds what a Hugging Face one does (config.json, tokenizer files,
generation_config.json, from transformers' GGUF readers) and `model.safetensors` with every
tensor under its Hugging Face name: float tensors (F32, F16, BF16) as they are, every other
type as its raw blocks, uint8 [rows, row bytes] (a 1-D tensor: [row bytes]), unconverted.
config.json's `quantization_config` is `{"quant_method": "gguf", "tensor_types": {name:
GGUF type}}` for every tensor, which `quantization/gguf.py` and the loader read.

llama.cpp's converter permutes the rows of a Llama-architecture model's Q and K projections
(from the rotate-half rotary layout to the interleaved one); their rows are permuted back here,
as transformers' GGUF loader does. Rows are whole blocks, so this is exact on blocks too.

Architectures: GGUF `llama` (Llama, Mistral, SmolLM), `qwen2` and `qwen3`; any other tensor
name in the file is an error naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Architectures whose Q and K rows llama.cpp's converter permutes.
PERMUTED = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors braid computes from the config instead (llama3's rotary frequency factors).
_SKIPPED = ("rope_freqs.weight",)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face checkpoint key of a GGUF tensor name; `ValueError` naming it if
    braid does not know it."""
    m = _BLOCK_RE.match(gguf_name)
    if m is not None and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name braid knows")


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: within each head, rows (i, j) of (dim, 2) go back
    to (j, i) (transformers' `_reverse_permute_weights`)."""
    rows = t.shape[0]
    dim = rows // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """The tensors of GGUF file `path` under their Hugging Face names (floats as floats,
    blocks raw), their GGUF types, and the file's architecture."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (braid reads "
            f"{', '.join(ARCHITECTURES)})"
        )
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        key = hf_name(t.name)
        qtype = GGMLQuantizationType(t.tensor_type).name
        data = np.array(t.data)  # a copy out of the memory map
        if qtype == "BF16":
            value = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        else:
            value = torch.from_numpy(data)
        if arch in PERMUTED and value.dim() == 2:
            if ".self_attn.q_proj." in key:
                value = unpermute_rows(value, heads)
            elif ".self_attn.k_proj." in key:
                value = unpermute_rows(value, kv_heads)
        tensors[key] = value.contiguous()
        types[key] = qtype
    return tensors, types, arch


def write_blocks_dir(path: Path, out: Path) -> None:
    """Write GGUF file `path` as a directory `out` braid loads kept quantized (module doc)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tensors, types, _ = read_tensors(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = has_tokenizer(path)
    cfg = config.to_dict()
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    cfg["dtype"] = "float32"
    cfg["quantization_config"] = {"quant_method": "gguf", "tensor_types": types}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(out))


def has_tokenizer(path: Path) -> bool:
    """Whether GGUF file `path` carries a tokenizer (test files written here do not)."""
    from gguf import GGUFReader

    return "tokenizer.ggml.model" in GGUFReader(str(path)).fields


def permute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (the inverse of `unpermute_rows`)."""
    rows = t.shape[0]
    dim = rows // heads // 2
    return t.reshape(heads, 2, dim, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def write_llama_gguf(
    path: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    types: dict[str, str],
    raw: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write a llama-architecture GGUF file (for tests and benchmarks): `config` a Hugging
    Face config dict (hidden_size, ...), `tensors` a float state dict under Hugging Face
    names, each written as `types[name]` (default F32) through gguf-py's quantizers, with Q
    and K rows permuted as llama.cpp's converter does; `raw`: tensors given as raw blocks of
    their `types` instead (for types gguf-py cannot quantize, the K-quants). No tokenizer."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    names = {v: k for k, v in _GLOBAL_NAMES.items()}
    blocks = {v: k for k, v in _BLOCK_NAMES.items()}
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    for key in [*tensors, *(raw or {})]:
        base, _, kind = key.rpartition(".")
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", base)
        gname = f"blk.{m.group(1)}.{blocks[m.group(2)]}" if m else names[base]
        qtype = types.get(key, "F32")
        t = raw[key] if raw and key in raw else tensors[key].float()
        if ".self_attn.q_proj." in key:
            t = permute_rows(t, heads)
        elif ".self_attn.k_proj." in key:
            t = permute_rows(t, kv)
        if (raw and key in raw) or qtype == "F32":
            data = t.numpy()
        else:
            data = quantize(t.numpy(), GGMLQuantizationType[qtype])
        w.add_tensor(f"{gname}.{kind}", data, raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
