"""ImageProcessor against transformers' own processors, on tiny model directories (configs, a
real tokenizer with the image special tokens, the image processor config; no weights)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from braid.runtime.image_data import ImageData
from braid.runtime.models.config import ModelConfig
from braid.runtime.multimodal.processor import ImageProcessor
from tests.runtime.tiny_tokenizers import build_byte_level_bpe

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<image>"]
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Sizes that exercise Qwen's smart_resize both ways (up to min_pixels, down to max_pixels),
# odd aspect ratios, and CLIP's shortest-edge resize plus center crop.
SIZES = [(50, 70), (13, 9), (300, 40), (128, 128), (401, 233)]


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    build_byte_level_bpe(path, vocab_size=480)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(str(path))
    return tok


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    tok = _tokenizer(path)
    ids = dict(zip(["vision_start", "image", "vision_end"], tok.convert_tokens_to_ids(SPECIAL)))
    tf.Qwen2_5_VLConfig(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        text_config=dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["image"],
        video_token_id=ids["image"] + 10,
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    ).save_pretrained(path)
    # Small pixel bounds keep the patch counts (and the test) small.
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40).save_pretrained(path)
    return path


def _llava_dir(path: Path, tower: str) -> Path:
    """A LLaVA directory saved as transformers 5 saves one: the image processor's settings
    inside processor_config.json (no preprocessor_config.json)."""
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tok = _tokenizer(path)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    if tower == "clip":
        vision_cfg = tf.CLIPVisionConfig(**vision, image_size=56, patch_size=14)
        image_proc = CLIPImageProcessorPil(
            size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
        )
        strategy, extra = "default", 1
    else:
        vision_cfg = tf.SiglipVisionConfig(**vision, image_size=48, patch_size=8)
        image_proc = SiglipImageProcessorPil(size={"height": 48, "width": 48})
        strategy, extra = "full", 0
    tf.LlavaConfig(
        architectures=["LlavaForConditionalGeneration"],
        text_config=tf.LlamaConfig(**TEXT).to_dict(),
        vision_config=vision_cfg.to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy=strategy,
    ).save_pretrained(path)
    tf.LlavaProcessor(
        image_processor=image_proc,
        tokenizer=tok,
        patch_size=vision_cfg.patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra,
    ).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llava_dir(tmp_path_factory.mktemp(f"llava_{request.param}"), request.param)


def _build(path: Path) -> ImageProcessor:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    proc = ImageProcessor.from_model_dir(path, ModelConfig.from_dir(path), tok)
    assert proc is not None
    return proc


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> ImageProcessor:
    return _build(qwen_dir)


# -- Qwen2.5-VL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_qwen_pixels_grid_and_count_match_transformers(
    qwen: ImageProcessor, qwen_dir: Path, size: tuple[int, int]
) -> None:
    from transformers import AutoImageProcessor

    ref_proc = AutoImageProcessor.from_pretrained(str(qwen_dir), backend="pil")
    image = _image(*size)
    ref = ref_proc(images=[image], return_tensors="pt")
    out = qwen.process(image)
    assert out.pixel_values.dtype == torch.float32
    torch.testing.assert_close(out.pixel_values, ref["pixel_values"], rtol=0, atol=0)
    assert out.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    # Qwen2VLProcessor's rule: one token per merge_size x merge_size block of patches.
    assert out.num_tokens == int(ref["image_grid_thw"][0].prod()) // ref_proc.merge_size**2
    assert out.pixel_values.shape == (out.num_tokens * 4, 3 * 2 * 14 * 14)
    assert out.image_size == (size[1], size[0])


def test_qwen_placeholder_is_spelled_from_the_tokenizer(
    qwen: ImageProcessor, qwen_dir: Path
) -> None:
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert qwen.placeholder == QWEN_PLACEHOLDER
    assert qwen.image_token_id == cfg["image_token_id"]


# -- LLaVA ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES[:3])
def test_llava_pixels_and_count_match_llava_processor(
    llava_dir: Path, size: tuple[int, int]
) -> None:
    from transformers import AutoProcessor

    proc = _build(llava_dir)
    reference = AutoProcessor.from_pretrained(str(llava_dir))
    assert type(reference).__name__ == "LlavaProcessor"
    image = _image(*size)
    ref = reference(text="look: <image> then", images=[image], return_tensors="pt")
    out = proc.process(image)
    assert out.pixel_values.dtype == torch.float32 and out.pixel_values.dim() == 3
    torch.testing.assert_close(out.pixel_values, ref["pixel_values"][0], rtol=0, atol=0)
    assert out.num_tokens == ref["input_ids"][0].tolist().count(proc.image_token_id)
    assert out.grid_thw is None and out.image_size == (size[1], size[0])
    # The expansion gives transformers' prompt ids exactly.
    ids = reference.tokenizer.encode("look: <image> then", add_special_tokens=False)
    expanded, offsets = proc.expand(ids, [out])
    assert expanded == ref["input_ids"][0].tolist()
    assert offsets == [expanded.index(proc.image_token_id)]


def test_llava_placeholder_is_the_image_token(llava_dir: Path) -> None:
    proc = _build(llava_dir)
    assert proc.placeholder == "<image>"


def test_llava_stated_extra_tokens_must_match_the_tower(tmp_path: Path) -> None:
    path = _llava_dir(tmp_path, "clip")
    settings = json.loads((path / "processor_config.json").read_text())
    settings["num_additional_image_tokens"] = 0
    (path / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="num_additional_image_tokens=0.*adds 1"):
        _build(path)


# -- hashes, expansion, loading errors ------------------------------------------------------------


def test_hash_is_stable_and_changes_with_one_pixel(qwen: ImageProcessor) -> None:
    image = _image(64, 48)
    first, again = qwen.process(image), qwen.process(image.copy())
    assert first.hash == again.hash and 0 <= first.hash < 2**63
    changed = image.copy()
    r, g, b = changed.getpixel((10, 10))
    changed.putpixel((10, 10), ((r + 128) % 256, g, b))
    assert qwen.process(changed).hash != first.hash


def _fake(num_tokens: int) -> ImageData:
    return ImageData(torch.zeros(1), num_tokens=num_tokens, hash=num_tokens)


def test_expand_widens_each_placeholder_in_order(qwen: ImageProcessor) -> None:
    t = qwen.image_token_id
    ids = [1, 2, t, 3, t, t, 4]
    expanded, offsets = qwen.expand(ids, [_fake(3), _fake(1), _fake(2)])
    assert expanded == [1, 2, t, t, t, 3, t, t, t, 4]
    assert offsets == [2, 6, 7]
    assert qwen.expand([5, 6], []) == ([5, 6], [])


def test_expand_refuses_a_count_mismatch(qwen: ImageProcessor) -> None:
    t = qwen.image_token_id
    with pytest.raises(ValueError, match="has 1 image placeholder but 2 images were given"):
        qwen.expand([1, t, 2], [_fake(2), _fake(2)])
    with pytest.raises(ValueError, match="has 2 image placeholders but 1 image was given"):
        qwen.expand([t, t], [_fake(2)])
    # Already expanded ids are not guessed at: one token per image is the contract.
    with pytest.raises(ValueError, match="has 3 image placeholders but 1 image was given"):
        qwen.expand([t, t, t], [_fake(3)])


def test_text_only_model_has_no_processor(tmp_path: Path) -> None:
    import transformers as tf

    tf.LlamaConfig(**TEXT, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert ImageProcessor.from_model_dir(tmp_path, ModelConfig.from_dir(tmp_path), None) is None


def test_vlm_without_preprocessor_config_is_refused(qwen_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        _build(tmp_path)


def test_unsupported_processor_type_is_named(qwen_dir: Path, tmp_path: Path) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    CLIPImageProcessorPil().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="image processor CLIPImageProcessor is not supported"):
        _build(tmp_path)


def test_extreme_aspect_ratio_is_refused(qwen: ImageProcessor) -> None:
    with pytest.raises(ValueError, match="aspect ratio must be at most 200"):
        qwen.process(Image.new("RGB", (2010, 10)))


# -- threads --------------------------------------------------------------------------------------


def test_process_from_four_threads_matches_serial(qwen: ImageProcessor) -> None:
    images = [_image(*SIZES[i % len(SIZES)], seed=i) for i in range(12)]
    serial = [qwen.process(im) for im in images]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(qwen.process, images))
    for a, b in zip(serial, threaded):
        assert a.hash == b.hash and a.grid_thw == b.grid_thw and a.num_tokens == b.num_tokens
        assert torch.equal(a.pixel_values, b.pixel_values)


# -- the front end: downloads beside the image threads -------------------------------------------


def test_slow_image_urls_hold_up_no_other_image(qwen_dir: Path) -> None:
    """Downloads are awaited on the loop, not in the image threads: with more slow URLs in
    flight than there are threads, an inline image is still processed at once, and each slow
    one fails at its own deadline naming its URL."""
    import asyncio
    import base64
    import io
    import socket
    import time

    from transformers import PreTrainedTokenizerFast

    from braid.runtime.config import EngineConfig
    from braid.runtime.errors import ParamError
    from braid.runtime.multimodal import frontend

    # A server that accepts connections and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    silent_port = silent.getsockname()[1]
    url = f"http://127.0.0.1:{silent_port}/cat.png?key=secret"
    buf = io.BytesIO()
    _image(40, 30).save(buf, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    config = EngineConfig(model=str(qwen_dir), media_fetch_timeout_s=3.0)
    tok = PreTrainedTokenizerFast.from_pretrained(str(qwen_dir))
    media = frontend.MediaFrontend(config, qwen_dir, ModelConfig.from_dir(qwen_dir), tok)
    ids = tok.encode(f"look: {QWEN_PLACEHOLDER}")

    async def run() -> tuple[float, list]:
        slow = [
            asyncio.ensure_future(media.prepare(ids, [url], f"prompt {i}"))
            for i in range(2 * frontend.WORKERS)
        ]
        await asyncio.sleep(0.3)  # every slow download is under way
        start = time.monotonic()
        expanded, images = await media.prepare(ids, [inline], "prompt x")
        took = time.monotonic() - start
        assert len(images) == 1 and len(expanded) > len(ids)
        return took, await asyncio.gather(*slow, return_exceptions=True)

    try:
        took, failures = asyncio.run(run())
    finally:
        media.shutdown()
        silent.close()
    assert took < 1.5  # before: queued behind the downloads in the image threads, 3 s and more
    for i, e in enumerate(failures):
        assert isinstance(e, ParamError)  # the URL without its query string
        assert str(e) == (
            f"prompt {i}: image 0: http://127.0.0.1:{silent_port}/cat.png: "
            "could not fetch the URL: timed out after 3 s"
        )
