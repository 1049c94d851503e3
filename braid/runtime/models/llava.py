"""LLaVA (1.5 style): a CLIP or SigLIP vision tower, a two-layer projector, and a Llama-family
language model (Llama, Mistral, Qwen2).

An image becomes a run of embeddings in the prompt: the tower's hidden state at
`vision_feature_layer` (or several layers' states, concatenated along the features), with
CLS dropped under the "default" select strategy, through `linear_2(act(linear_1(x)))`. The
runtime scatters those rows into the prompt's embeddings at the image tokens and runs the
language model on them (`forward(..., input_embeds=...)`); positions are the plain 1-D ones.

`LlavaBase` holds what LLaVA-NeXT (`llava_next.py`) shares: the parts, their checkpoint names,
and the tower + projector pass over a stack of same-size images (`image_features`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from braid.runtime.attention.base import AttentionBackend
from braid.runtime.forward_batch import ForwardBatch
from braid.runtime.image_data import ImageData, check_each, device_pixels
from braid.runtime.layers.linear import Linear
from braid.runtime.models import MODELS
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.llama import LlamaForCausalLM, LlamaModel, lm_head_for
from braid.runtime.models.vision_towers import activation, tower_class

SELECT_STRATEGIES = ("default", "full")

# Checkpoint prefixes -> braid's module prefixes. transformers 5 modules name the parts
# `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*` and
# `lm_head.*` (what `save_pretrained(save_original_format=False)` writes); the llava-hf hub
# checkpoints, transformers 4, and transformers 5's default `save_pretrained` name them
# `language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, and
# `multi_modal_projector.*`; LLaVA-NeXT's `image_newline` is `model.image_newline` in the
# first layout and `image_newline` in the second. Longest prefix first: `model.` would match
# both layouts.
_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.image_newline", "image_newline"),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "lm_head."),
)
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.")
# Vision-tower parts LLaVA never reads: the final norm (features are taken before it) and
# SigLIP's attention-pooling head.
_UNUSED_TOWER_PARTS = ("post_layernorm.", "head.")


class LlavaProjector(nn.Module):
    """`linear_2(act(linear_1(features)))`, vision features to the LM's hidden size."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool, dtype) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, {None: hidden}, bias=bias, dtype=dtype)
        self.linear_2 = Linear(hidden, {None: hidden}, bias=bias, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _feature_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """`vision_feature_layer` (an int or a list of ints, negative from the end) as indices
    into the tower's hidden states, 0 being the embeddings; `ValueError` if out of range."""
    spec = raw.get("vision_feature_layer", -2)
    layers = [spec] if isinstance(spec, int) else list(spec)
    if not layers or not all(isinstance(i, int) for i in layers):
        raise ValueError(f"vision_feature_layer must be an int or a list of ints, got {spec!r}")
    resolved = tuple(i if i >= 0 else num_layers + 1 + i for i in layers)
    if not all(0 <= i <= num_layers for i in resolved):
        raise ValueError(
            f"vision_feature_layer {spec!r} is out of range for a {num_layers}-layer tower"
        )
    return resolved


class LlavaBase(nn.Module):
    """A vision tower, `LlavaProjector` and a Llama-family language model, named as either
    checkpoint layout names them (`checkpoint_key`). Subclasses turn images into prompt
    embeddings (`check_image`, `encode_images`) from `image_features`."""

    # The LM's fused projections; the tower's attention fuses q/k/v the same way.
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_key_suffixes = (*LlamaForCausalLM.ignored_key_suffixes, "embeddings.position_ids")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        if cfg.vision_config is None:
            raise ValueError(f"{type(self).__name__} needs a vision_config")
        raw = cfg.raw
        self.config = cfg
        vision = cfg.vision_config
        tower_cls = tower_class(vision)
        depth = vision.get("num_hidden_layers", tower_cls.defaults["num_hidden_layers"])
        self.feature_layers = _feature_layers(raw, depth)
        self.select_strategy = raw.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy {self.select_strategy!r} is not supported "
                f"(have {SELECT_STRATEGIES})"
            )
        # Layers after the deepest feature layer are neither built nor loaded.
        self.vision_tower = tower_cls(vision, dtype, max(self.feature_layers))
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.spec.hidden * len(self.feature_layers),
            cfg.hidden_size,
            raw.get("projector_hidden_act", "gelu"),
            bool(raw.get("multimodal_projector_bias", True)),
            dtype,
        )
        self.language_model = LlamaModel(cfg, dtype, max_positions)
        self.lm_head = lm_head_for(cfg, dtype, self.language_model.embed_tokens)

    @property
    def features_per_image(self) -> int:
        """How many rows `image_features` gives for each tower-sized image."""
        # transformers' "default" drops the first token of every tower, SigLIP's included
        # (which has no CLS, so there it drops a patch); braid does the same.
        return self.vision_tower.num_tokens - (self.select_strategy == "default")

    def checkpoint_key(self, key: str) -> str | None:
        """braid's name for a checkpoint key of either layout (see `_PREFIXES`); None for the
        keys of tower parts that are never run. Keys with no known prefix pass unchanged, so
        the strict loader reports them."""
        for old, new in _PREFIXES:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        else:
            return key
        if not key.startswith("vision_tower."):
            return key
        rest = key[len("vision_tower.") :]
        # transformers 4's CLIPVisionModel / SiglipVisionModel nest everything in `vision_model`.
        rest = rest.removeprefix("vision_model.")
        if rest.startswith(_UNUSED_TOWER_PARTS):
            return None
        m = _LAYER.match(rest)
        if m is not None and int(m.group(1)) >= len(self.vision_tower.encoder.layers):
            return None
        return "vision_tower." + rest

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of `input_ids` [T] (image tokens included; the caller
        overwrites their rows with `encode_images`' output)."""
        return self.language_model.embed_tokens(input_ids)

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, features_per_image, hidden] in the model's dtype for `pixels` [N, C, S, S] (any
        dtype and device; S the tower's size): the selected layers' states, concatenated, with
        the first token dropped under "default", through the projector. One tower pass."""
        weight = self.multi_modal_projector.linear_1.weight
        states = self.vision_tower(pixels.to(weight.device, weight.dtype))
        start = 1 if self.select_strategy == "default" else 0
        feats = torch.cat([states[i][:, start:] for i in self.feature_layers], dim=-1)
        return self.multi_modal_projector(feats)

    def forward(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (float32) for the rows `batch.logits_indices` selects. `input_embeds`
        [T, hidden]: the batch's embeddings with image rows filled in (None: text only, the
        embeddings of `batch.input_ids`)."""
        h = self.language_model(batch, attn, input_embeds)
        return self.lm_head(h[batch.logits_indices], batch.head_rows).float()


@MODELS.register
class LlavaForConditionalGeneration(LlavaBase):
    """LLaVA: `encode_images` turns processed images into prompt embeddings, `embed_tokens`
    the text, and `forward` runs the language model on the merged embeddings."""

    @property
    def tokens_per_image(self) -> int:
        """How many embeddings every image becomes (all LLaVA images have one size)."""
        return self.features_per_image

    def check_image(self, image: ImageData) -> None:
        """`ValueError` unless `image` is what this tower takes: [3, size, size] pixels and
        `tokens_per_image` tokens. The scheduler asks before admitting a request, so a bad
        image (a processor whose crop size is not the tower's) is that request's error."""
        size = self.vision_tower.spec.image_size
        if image.shape != (3, size, size):
            raise ValueError(
                f"pixel_values {image.shape} are not the tower's input (3, {size}, {size})"
            )
        if image.num_tokens != self.tokens_per_image:
            raise ValueError(
                f"num_tokens={image.num_tokens}, but this model turns every image into "
                f"{self.tokens_per_image} embeddings"
            )

    def encode_images(self, images: list[ImageData]) -> list[torch.Tensor]:
        """One [image.num_tokens, hidden] tensor per image, in the model's dtype, from one
        batched tower pass. `ValueError` if an image's `num_tokens` is not what the model makes
        of it (`tokens_per_image`), or its pixels are not the tower's input size."""
        if not images:
            return []
        check_each(images, self.check_image)
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack(device_pixels(images, weight.device, weight.dtype))
        return list(self.image_features(pixels).unbind(0))
