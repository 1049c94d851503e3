"""Tiny random-weight vision-language models for tests: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL built
from a transformers config and saved with `save_pretrained` (so transformers is the reference),
with a real byte-level BPE tokenizer, a Qwen2-VL-style chat template and an image processor
config beside it; and small random test images."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.runtime.tiny_tokenizers import CORPUS

# Special tokens first, so their ids are 0.. and stay below the vocabulary size.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's template, trimmed to what braid serves: an image content part becomes
# <|vision_start|><|image_pad|><|vision_end|> (the processor then repeats <|image_pad|> once per
# image embedding).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB_SIZE = 512
PATCH_SIZE = 14
QWEN3_PATCH_SIZE = 16
MERGE_SIZE = 2
# Pixel bounds for the image processor: a 112x112 image stays 8x8 patches (16 tokens), and
# nothing grows past 96 patches.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 24


def build_vlm_tokenizer(path: Path, vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    """A byte-level BPE (tests/runtime/tiny_tokenizers.py's recipe) with `SPECIAL_TOKENS`
    and `CHAT_TEMPLATE`, saved to `path`; returns the special tokens' ids (all < vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= vocab_size
    fast.save_pretrained(str(path))
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert all(0 <= i < vocab_size for i in ids.values())
    return ids


def _config(version: str, ids: dict[str, int]):
    import transformers as tf

    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        # head_dim 16: M-RoPE splits its 8 frequencies as temporal 2, height 3, width 3.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=None,
    )
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    common = dict(
        depth=2,
        num_heads=2,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        in_channels=3,
        initializer_range=0.1,
    )
    if version == "2":
        vision = dict(common, embed_dim=32, mlp_ratio=2, hidden_size=64, hidden_act="quick_gelu")
        # Tied embeddings, as Qwen2-VL-2B.
        return tf.Qwen2VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens
        )
    if version == "3":
        # A 4x4 learned position grid, resampled to every image's patch grid; DeepStack takes
        # both tower blocks, so features join the first two of three language layers.
        text3 = dict(
            text,
            num_hidden_layers=3,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        )
        vision = dict(
            common,
            patch_size=QWEN3_PATCH_SIZE,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            hidden_act="gelu_pytorch_tanh",
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        )
        return tf.Qwen3VLConfig(
            text_config=text3, vision_config=vision, tie_word_embeddings=False, **tokens
        )
    if version == "2.5":
        # Windows of 56 pixels = 2x2 merged patches: a 112x112 image has 4 of them. Block 0
        # attends within windows, block 1 over the whole image.
        vision = dict(
            common,
            hidden_size=32,
            # Not a multiple of 64 (as Qwen2.5-VL's 3420): on CUDA the MLP is widened.
            intermediate_size=60,
            out_hidden_size=64,
            hidden_act="silu",
            window_size=56,
            fullatt_block_indexes=[1],
        )
        return tf.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens
        )
    raise ValueError(f"version must be '2', '2.5' or '3', got {version!r}")


def qwen_image_processor_config(
    min_pixels: int, max_pixels: int, patch_size: int = PATCH_SIZE
) -> dict:
    """A `preprocessor_config.json` for Qwen2VLImageProcessor (patch 14 unless given, merge 2,
    CLIP's mean and std) bounding each image to [min_pixels, max_pixels]."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }


def build_tiny_qwen2_vl(path: Path, version: str = "2.5") -> Path:
    """A random-weight Qwen2-VL (`version="2"`), Qwen2.5-VL (`"2.5"`) or Qwen3-VL (`"3"`)
    saved to `path` by transformers' `save_pretrained`, with the tokenizer, chat template and
    `preprocessor_config.json` (Qwen2VLImageProcessor, merge 2, patch 14; 16 for Qwen3-VL,
    with the pixel bounds scaled alike) beside it. Every weight, norms and biases included, is
    random (seeded), so loading errors cannot hide."""
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = build_vlm_tokenizer(path)
    torch.manual_seed(1234)
    model = AutoModelForImageTextToText.from_config(_config(version, ids), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    if version == "3":
        scale = (QWEN3_PATCH_SIZE / PATCH_SIZE) ** 2
        processor = qwen_image_processor_config(
            round(MIN_PIXELS * scale), round(MAX_PIXELS * scale), QWEN3_PATCH_SIZE
        )
    else:
        processor = qwen_image_processor_config(MIN_PIXELS, MAX_PIXELS)
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def tiny_image(w: int, h: int, seed: int):
    """A random RGB PIL image of `w` x `h` pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), mode="RGB")
