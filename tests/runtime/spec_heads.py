"""Random-weight draft heads in the published checkpoint layouts, for the tiny test models
(hidden 64, vocabulary 512): Medusa (`medusa_lm_head.safetensors` or `.pt`), EAGLE-1
(`model.safetensors` / `pytorch_model.bin`, keys `fc.*`, `layers.0.*`) and EAGLE-3 (`fc`,
`midlayer.*`, `norm`, `lm_head` over a draft vocabulary, `d2t`, `t2d`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.conftest import TINY

H, V = TINY["hidden_size"], TINY["vocab_size"]
HEADS, KV_HEADS, INTER = TINY["num_attention_heads"], TINY["num_key_value_heads"], 128
HEAD_DIM = H // HEADS


def _rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape) * scale


def write_medusa(path: Path, heads: int = 3, layers: int = 1, pt: bool = False) -> Path:
    torch.manual_seed(11)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = _rand(H, H)
            state[f"{i}.{j}.linear.bias"] = _rand(H)
        state[f"{i}.{layers}.weight"] = _rand(V, H)
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers}
    (path / "config.json").write_text(json.dumps(cfg))
    if pt:
        torch.save(state, path / "medusa_lm_head.pt")
    else:
        save_file(state, str(path / "medusa_lm_head.safetensors"))
    return path


def _llama_config(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        **extra,
    }


def _layer(prefix: str, attn_in: int) -> dict[str, torch.Tensor]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(q, attn_in),
        f"{prefix}.self_attn.k_proj.weight": _rand(kv, attn_in),
        f"{prefix}.self_attn.v_proj.weight": _rand(kv, attn_in),
        f"{prefix}.self_attn.o_proj.weight": _rand(H, q),
        f"{prefix}.post_attention_layernorm.weight": 1 + _rand(H, scale=0.05),
        f"{prefix}.mlp.gate_proj.weight": _rand(INTER, H),
        f"{prefix}.mlp.up_proj.weight": _rand(INTER, H),
        f"{prefix}.mlp.down_proj.weight": _rand(H, INTER),
    }


def write_eagle(path: Path, pt: bool = False, embed: bool = False) -> Path:
    torch.manual_seed(12)
    path.mkdir(parents=True, exist_ok=True)
    state = {"fc.weight": _rand(H, 2 * H), "fc.bias": _rand(H), **_layer("layers.0", H)}
    if embed:
        state["embed_tokens.weight"] = _rand(V, H)
    (path / "config.json").write_text(json.dumps(_llama_config()))
    if pt:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"))
    return path


def write_eagle3(path: Path, draft_vocab: int = 256, layers: tuple = (0, 1, 1)) -> Path:
    """EAGLE-3 over a 2-layer target; draft id j stands for target id 2 j."""
    torch.manual_seed(13)
    path.mkdir(parents=True, exist_ok=True)
    hot = torch.arange(draft_vocab) * 2
    state = {
        "fc.weight": _rand(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + _rand(H, scale=0.05),
        "midlayer.hidden_norm.weight": 1 + _rand(H, scale=0.05),
        **_layer("midlayer", 2 * H),
        "norm.weight": 1 + _rand(H, scale=0.05),
        "lm_head.weight": _rand(draft_vocab, H),
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, hot, True),
    }
    cfg = _llama_config(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=draft_vocab,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(layers)},
    )
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))
    return path
