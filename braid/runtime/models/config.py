"""The model shape braid needs, read from a Hugging Face `config.json`.

braid reads the JSON itself rather than through a transformers config class, so the same code
works across transformers releases (4.x writes `rope_theta`/`rope_scaling`, 5.x writes
`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from braid.runtime.distributed.split import even_block, head_shard

if TYPE_CHECKING:
    from braid.runtime.config import EngineConfig

# Vision-language architectures (their language model is one of the text families).
QWEN2_VL_ARCHS = frozenset(
    {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
)
QWEN3_VL = "Qwen3VLForConditionalGeneration"
# The Qwen-VL families braid serves: M-RoPE positions, a Qwen2-VL image processor.
QWEN_VL_ARCHS = QWEN2_VL_ARCHS | {QWEN3_VL}
LLAVA_ARCHS = frozenset({"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"})
VLM_ARCHS = QWEN_VL_ARCHS | LLAVA_ARCHS
# Decoder bodies saved without an LM head (embedding models), by the causal LM whose fields
# they share (`models/llama_embedding.py` serves them).
BASE_MODEL_ARCHS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


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
    # Vision-language models: the token that stands for one image embedding in the prompt,
    # the vision tower's config (its own keys, as in config.json), and M-RoPE's split of the
    # rotary frequencies into (temporal, height, width) sections (Qwen2-VL family).
    image_token_id: int | None = None
    vision_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: the sections' frequencies interleave (t, h, w, t, h, w, ...) instead of
    # following one another.
    mrope_interleaved: bool = False
    # How the checkpoint's linear weights are quantized (config.json's `quantization_config`,
    # or `compression_config` in older compressed-tensors checkpoints), as written; None: floats.
    # braid.runtime.quantization reads it.
    quantization_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)
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
    def is_multimodal(self) -> bool:
        return self.vision_config is not None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * element_size

    def check_engine(self, config: EngineConfig) -> None:
        """This model under the engine settings `config`: the context length, and what tensor
        parallelism cannot split or carry (`ValueError` naming the first problem). Run where
        the front end has read config.json (`LLM`, `braid serve`), before any process starts,
        and by each model runner."""
        ctx = config.context_length
        if ctx and ctx > self.max_position_embeddings:
            raise ValueError(
                f"context_length {ctx} exceeds the model's max_position_embeddings "
                f"({self.max_position_embeddings})"
            )
        size = config.tp_size
        if size == 1:
            return
        if self.is_multimodal:
            raise ValueError(
                f"tensor parallelism of vision-language models ({self.architecture}) is not "
                "supported yet"
            )
        qc = self.quantization_config
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        # A GGUF file loaded with dequantize_gguf is a float checkpoint (`build_model`).
        if qc and not (method == "gguf" and config.dequantize_gguf):
            hint = "; dequantize_gguf loads a GGUF file as floats" if method == "gguf" else ""
            raise ValueError(
                f"tensor parallelism of quantized checkpoints (quant_method {method!r}) is not "
                f"supported yet{hint}"
            )
        # The splits every rank makes at load: its attention heads, its block of the MLP.
        head_shard(self.num_heads, self.num_kv_heads, 0, size)
        even_block(self.intermediate_size, 0, size, "intermediate_size")

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
    def _parse(cls, served: str, top: dict[str, Any]) -> ModelConfig:
        arch = BASE_MODEL_ARCHS.get(served, served)  # a body alone reads as its causal LM
        # A vision-language config nests its language model's fields in `text_config`
        # (transformers 5 always; older Qwen2-VL configs keep them at the top level).
        d = {**top, **(top.get("text_config") or {})}
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
        text_type = (top.get("text_config") or {}).get("model_type", "")
        if arch in QWEN2_VL_ARCHS or arch == "Qwen2ForCausalLM" or text_type == "qwen2":
            qkv_bias = True
        elif arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM") or (
            arch in VLM_ARCHS
        ):
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        mrope = rope.get("mrope_section") or (d.get("rope_scaling") or {}).get("mrope_section")
        if mrope and arch not in QWEN_VL_ARCHS:
            raise ValueError(f"{arch} with mrope_section is not supported")
        if arch in QWEN_VL_ARCHS:
            if not mrope:
                raise ValueError(f"{arch}: the config has no mrope_section")
            scaling = {}  # "mrope" marks the 3-D positions, not a frequency scaling
        vision = top.get("vision_config") if arch in VLM_ARCHS else None
        if arch in VLM_ARCHS and not vision:
            raise ValueError(f"{arch}: config.json has no vision_config")
        image_token = top.get("image_token_id", top.get("image_token_index"))
        sliding_window = None
        if arch == "MistralForCausalLM" or text_type == "mistral":
            sliding_window = d.get("sliding_window")
        elif d.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        return cls(
            architecture=served,
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
            # transformers ties a VLM's head when either its own or its text config says so.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False))
            or bool(top.get("tie_word_embeddings", False)),
            rope_scaling=scaling or None,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", QWEN3_VL) or text_type == "qwen3",
            sliding_window=sliding_window,
            hidden_act=d.get("hidden_act", "silu"),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            image_token_id=image_token if vision else None,
            vision_config=vision,
            mrope_section=tuple(mrope) if mrope else None,
            mrope_interleaved=arch == QWEN3_VL,
            quantization_config=top.get("quantization_config") or top.get("compression_config"),
            raw=top,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"model directory {path} has no config.json")
        top = read_json(p)
        if not isinstance(top, dict):
            raise ValueError(f"{p}: not a JSON object")
        return cls.from_dict(top)


def read_json(path: Path) -> Any:
    """A model directory's JSON file; a `ValueError` naming the file if it does not parse."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
