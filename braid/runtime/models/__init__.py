"""Model files, a registry from Hugging Face architecture names to braid classes, and loading."""

from __future__ import annotations

from braid.runtime.registry import Registry

# Architecture -> the module whose registered class serves it; imported on first use.
MODELS: Registry[type] = Registry(
    "architecture",
    {
        "LlamaForCausalLM": "braid.runtime.models.llama",
        "MistralForCausalLM": "braid.runtime.models.llama",
        "Qwen2ForCausalLM": "braid.runtime.models.llama",
        "Qwen3ForCausalLM": "braid.runtime.models.llama",
        "LlamaModel": "braid.runtime.models.llama_embedding",
        "MistralModel": "braid.runtime.models.llama_embedding",
        "Qwen2Model": "braid.runtime.models.llama_embedding",
        "Qwen3Model": "braid.runtime.models.llama_embedding",
        "Qwen2VLForConditionalGeneration": "braid.runtime.models.qwen2_vl",
        "Qwen2_5_VLForConditionalGeneration": "braid.runtime.models.qwen2_vl",
        "Qwen3VLForConditionalGeneration": "braid.runtime.models.qwen3_vl",
        "LlavaForConditionalGeneration": "braid.runtime.models.llava",
        "LlavaNextForConditionalGeneration": "braid.runtime.models.llava_next",
    },
    unknown="{kind} {name!r} is not supported (supported: {known})",
)


def get_model_class(architecture: str) -> type:
    """The model class for a Hugging Face architecture name; `ValueError` listing the
    supported ones if braid has none."""
    return MODELS.get(architecture)


def supported_architectures() -> list[str]:
    """The architecture names braid serves, sorted; listing them imports no model file."""
    return MODELS.names()
