"""The model shape braid needs, read from a Hugging Face `config.json`.

braid reads the JSON itself rather than through a transformers config class, so the same code
works across transformers releases (4.x writes `rope_theta`/`rope_scaling`, 5.x writes
`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * element_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        from braid.runtime.models import supported_architectures

        if arch not in supported_architectures():
            raise ValueError(
                f"architecture {arch!r} is not supported (supported: {supported_architectures()})"
            )
        try:
            return cls._parse(arch, d)
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None

    @classmethod
    def _parse(cls, arch: str, d: dict[str, Any]) -> ModelConfig:
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = {}
        qkv_bias = o_bias = False
        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        elif arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"):
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        sliding_window = None
        if arch == "MistralForCausalLM":
            sliding_window = d.get("sliding_window")
        elif d.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_scaling=scaling or None,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            hidden_act=d.get("hidden_act", "silu"),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            raw=d,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return cls.from_dict(json.loads(p.read_text()))
