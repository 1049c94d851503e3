"""Tiny random-weight LLaVA checkpoints for tests: a transformers `LlavaForConditionalGeneration`
(CLIP or SigLIP vision tower, Llama, Mistral or Qwen2 language model) or
`LlavaNextForConditionalGeneration` (the same towers, any-resolution tiling over small
`image_grid_pinpoints`) saved with `save_pretrained`, beside a real byte-level BPE tokenizer, a
chat template and the image processor, so that `AutoProcessor.from_pretrained` loads the
directory as a `LlavaProcessor` / `LlavaNextProcessor`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.runtime.tiny_tokenizers import build_byte_level_bpe

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,  # vision_feature_layer=-2 leaves the last layer unused
    num_attention_heads=4,
    initializer_range=0.1,
)
# tower -> (image_size, patch_size)
TOWER_GEOMETRY = {"clip": (32, 8), "siglip": (56, 14)}
# LLaVA-NeXT's resolutions, in tiles (rows, columns): grids of 1x2, 2x1, 2x2 and 1x3 tiles.
NEXT_GRIDS = ((1, 2), (2, 1), (2, 2), (1, 3))
SPECIAL_TOKENS = ["<image>", "<|im_start|>", "<|im_end|>"]

# ChatML turns; an image content part renders as "<image>\n", which the processor expands.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<image>\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _text_config(text: str):
    import transformers as tf

    if text == "llama":
        return tf.LlamaConfig(**TEXT, tie_word_embeddings=False)
    if text == "mistral":
        return tf.MistralConfig(**TEXT, head_dim=16, sliding_window=None, tie_word_embeddings=False)
    if text == "qwen2":
        return tf.Qwen2Config(**TEXT, tie_word_embeddings=True)
    raise ValueError(f"text model {text!r} (have llama, mistral, qwen2)")


def _vision(tower: str):
    """(vision config, image processor, extra tokens per image beyond the patches)."""
    import transformers as tf

    if tower not in TOWER_GEOMETRY:
        raise ValueError(f"tower {tower!r} (have {sorted(TOWER_GEOMETRY)})")
    size, patch = TOWER_GEOMETRY[tower]
    if tower == "clip":
        cfg = tf.CLIPVisionConfig(**VISION, image_size=size, patch_size=patch, projection_dim=32)
        proc = tf.CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        return cfg, proc, 1  # the CLS token
    cfg = tf.SiglipVisionConfig(**VISION, image_size=size, patch_size=patch)
    return cfg, tf.SiglipImageProcessor(size={"height": size, "width": size}), 0


def build_tiny_llava(
    path: Path,
    tower: str = "clip",
    text: str = "llama",
    *,
    feature_layer: int | list[int] = -2,
    strategy: str | None = None,
    save_original_format: bool = True,
) -> Path:
    """A random-weight LLaVA saved to `path` with its processor (tokenizer, chat template, image
    processor). `strategy` defaults to "default" (drop CLS) for CLIP and "full" for SigLIP, as
    released checkpoints use them. `save_original_format=False` saves the parameter names of
    transformers 5's modules (`model.language_model.*`) instead of the hub layout."""
    import transformers as tf

    path = Path(path)
    tok = _tokenizer(path)
    image_token_id = tok.convert_tokens_to_ids("<image>")

    vision, image_processor, extra = _vision(tower)
    strategy = strategy or ("default" if tower == "clip" else "full")
    cfg = tf.LlavaConfig(
        vision_config=vision,
        text_config=_text_config(text),
        image_token_index=image_token_id,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
        tie_word_embeddings=text == "qwen2",
    )
    torch.manual_seed(1234)
    model = tf.LlavaForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(str(path), save_original_format=save_original_format)

    processor = tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=vision.patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra,
        chat_template=CHAT_TEMPLATE,
    )
    tok.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(str(path))
    return path


def build_tiny_llava_next(
    path: Path,
    tower: str = "clip",
    text: str = "llama",
    *,
    feature_layer: int | list[int] = -2,
    save_original_format: bool = True,
) -> Path:
    """A random-weight LLaVA-NeXT saved to `path` with its `LlavaNextProcessor` (tokenizer, chat
    template, a PIL `LlavaNextImageProcessor` cutting the tower's tiles). Its pinpoints are
    `NEXT_GRIDS` tiles of the tower's size. CLIP runs with "default" (CLS dropped) and SigLIP
    with "full": the strategies that leave each tile a square grid of features."""
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    path = Path(path)
    tok = _tokenizer(path)
    vision, _, extra = _vision(tower)
    size = vision.image_size
    pinpoints = [[rows * size, cols * size] for rows, cols in NEXT_GRIDS]
    strategy = "default" if tower == "clip" else "full"
    cfg = tf.LlavaNextConfig(
        vision_config=vision,
        text_config=_text_config(text),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=pinpoints,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
        tie_word_embeddings=text == "qwen2",
    )
    torch.manual_seed(1234)
    model = tf.LlavaNextForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(str(path), save_original_format=save_original_format)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_grid_pinpoints=pinpoints,
    )
    processor = tf.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=vision.patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra,
        chat_template=CHAT_TEMPLATE,
    )
    tok.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(str(path))
    return path


def _tokenizer(path: Path):
    """The byte-level BPE with `SPECIAL_TOKENS` (all below the text model's vocabulary)."""
    import transformers as tf

    build_byte_level_bpe(path, vocab_size=500)
    tok = tf.PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.pad_token = "<|endoftext|>"
    assert len(tok) <= TEXT["vocab_size"]
    return tok


def tiny_image(w: int, h: int, seed: int) -> Image.Image:
    """A random RGB image of `w` x `h` pixels, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), mode="RGB")
