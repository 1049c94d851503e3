"""braid's LLaVA-NeXT equals transformers': the processor's tiles and token counts (per image
size, so per tile grid and crop), the packed image features (base tile, cropped grid,
newlines) from one batched tower pass, strict loading of both checkpoint layouts, and greedy
float32 tokens through `braid.LLM` for images of different sizes, two images in one prompt and
a batch mixed with a text-only prompt. Malformed images are `ValueError`s, at admission for
their own request only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, AutoTokenizer, LlavaNextForConditionalGeneration

import braid
from braid.runtime.image_data import ImageData, from_wire, to_wire
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.llava_next import AnyResGrid, anyres_grid
from braid.runtime.models.loader import build_model
from braid.runtime.multimodal.processor import ImageProcessor
from braid.runtime.sampling_params import SamplingParams
from tests.conftest import local_scheduler, run_to_end
from tests.multimodal.tiny_llava import build_tiny_llava_next, tiny_image

NEW = 8
GREEDY = braid.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# (width, height) of test images for 32-pixel tiles (CLIP's; scaled to SigLIP's 56): they land
# on grids of 1x2, 2x1, 2x2 and 1x3 tiles, with the features cropped in width, in height, or
# not at all.
# The last is so thin that its kept width rounds to no feature column: only newlines remain.
SIZES = [(40, 30), (20, 70), (64, 64), (100, 24), (7, 5), (60, 40), (1, 150)]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava_next")
    return {
        "clip": build_tiny_llava_next(root / "clip"),
        "siglip": build_tiny_llava_next(root / "siglip", "siglip", "qwen2", feature_layer=[0, -2]),
    }


@pytest.fixture(scope="module")
def hf_models(dirs) -> dict:
    return {
        name: LlavaNextForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
        for name, d in dirs.items()
    }


def _braid(d: Path):
    cfg = ModelConfig.from_dir(d)
    return build_model(cfg, d, dtype=torch.float32, device=CPU, max_positions=512, progress=False)


@pytest.fixture(scope="module")
def models(dirs) -> dict:
    return {name: _braid(d) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def processors(dirs) -> dict[str, ImageProcessor]:
    return {
        name: ImageProcessor.from_model_dir(
            d, ModelConfig.from_dir(d), AutoTokenizer.from_pretrained(str(d))
        )
        for name, d in dirs.items()
    }


@pytest.fixture(scope="module")
def references(dirs) -> dict:
    """transformers' LlavaNextProcessor of each model."""
    return {name: AutoProcessor.from_pretrained(str(d)) for name, d in dirs.items()}


def _images(tile: int = 32) -> list[Image.Image]:
    """`SIZES` scaled to `tile`-pixel tiles."""
    return [
        tiny_image(round(w * tile / 32), round(h * tile / 32), seed=i)
        for i, (w, h) in enumerate(SIZES)
    ]


def _count(ref, image: Image.Image) -> int:
    ids = ref(text=["<image>"], images=[image])["input_ids"][0]
    return ids.count(ref.image_token_id)


# -- processing ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_tiles_and_token_counts_equal_transformers_processor(processors, references, models, name):
    proc, ref, model = processors[name], references[name], models[name]
    images = _images(model.grid.tile)
    layouts = set()
    for image in images:
        out = proc.process(image)
        want = ref(text=["<image>"], images=[image], return_tensors="pt")
        assert out.num_tokens == want["input_ids"][0].tolist().count(proc.image_token_id)
        torch.testing.assert_close(out.pixel_values, want["pixel_values"][0], rtol=0, atol=0)
        assert out.image_size == (image.height, image.width)
        assert out.image_size == tuple(want["image_sizes"][0].tolist())
        model.check_image(out)
        rows, cols, (top, bottom), (left, right) = model.grid.layout(*out.image_size)
        fh, fw = rows * model.grid.side, cols * model.grid.side
        layouts.add(((rows, cols), (bottom - top) < fh, (right - left) < fw))
    # Every tile grid, with features cropped in height, in width, and not at all.
    assert {grid for grid, _, _ in layouts} == {(1, 2), (2, 1), (2, 2), (1, 3)}
    assert {(h, w) for _, h, w in layouts} == {(False, True), (True, False), (False, False)}

    # Batched, transformers pads every image to the most tiles; braid keeps each one's own.
    small, large = images[0], images[2]
    batch = ref(text=["<image><image>"], images=[small, large], return_tensors="pt")
    mine = proc.process(small).pixel_values
    assert batch["pixel_values"].shape[1] == 5 and mine.shape[0] == 3
    torch.testing.assert_close(batch["pixel_values"][0, :3], mine, rtol=0, atol=0)
    assert not batch["pixel_values"][0, 3:].any()


def test_same_pixels_from_two_sizes_are_two_images(processors, references):
    """Uniform images of 30x24 and 31x25 make the same tiles, but crop to different token
    counts: the hash covers the size, so neither reuses the other's encoder output."""
    proc, ref = processors["clip"], references["clip"]
    a, b = Image.new("RGB", (30, 24), (200, 30, 90)), Image.new("RGB", (31, 25), (200, 30, 90))
    pa, pb = proc.process(a), proc.process(b)
    assert torch.equal(pa.pixel_values, pb.pixel_values)
    assert (pa.num_tokens, pb.num_tokens) == (_count(ref, a), _count(ref, b)) == (44, 36)
    assert pa.hash != pb.hash
    assert proc.process(a.copy()).hash == pa.hash


# -- the model -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_image_features_equal_transformers(processors, references, hf_models, models, name):
    proc, ref, hf, model = processors[name], references[name], hf_models[name], models[name]
    images = _images(model.grid.tile)
    data = [proc.process(im) for im in images]
    inputs = ref(text=["<image>" * len(images)], images=images, return_tensors="pt")
    with torch.inference_mode():
        want = hf.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"]
        ).pooler_output
        got = model.encode_images(data)
        alone = model.encode_images(data[3:4])
    assert len(got) == len(want) == len(images)
    for g, w, d in zip(got, want, data):
        assert g.shape == w.shape == (d.num_tokens, model.config.hidden_size)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone[0], got[3], atol=1e-5, rtol=0)
    # The newline embedding ends every kept feature row of the grid.
    rows, cols, (top, bottom), (left, right) = model.grid.layout(*data[0].image_size)
    base, width = model.grid.side**2, right - left + 1
    ends = got[0][base + width - 1 :: width]
    assert ends.shape[0] == bottom - top
    assert torch.equal(ends, model.image_newline.expand_as(ends))


def _hub_key(key: str) -> str:
    # transformers 4 / llava-hf: the vision model's parameters sit under `vision_model.`.
    return key.replace("vision_tower.", "vision_tower.vision_model.", 1)


def test_both_checkpoint_layouts_load_to_the_same_weights(dirs, hf_models, models, tmp_path):
    d, hf, model = dirs["clip"], hf_models["clip"], models["clip"]
    assert "image_newline" in load_file(str(d / "model.safetensors"))
    modules = tmp_path / "modules"
    hf.save_pretrained(str(modules), save_original_format=False)
    stored = load_file(str(modules / "model.safetensors"))
    assert "model.image_newline" in stored and "image_newline" not in stored
    hub = tmp_path / "hub"
    shutil.copytree(d, hub)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({_hub_key(k): v for k, v in tensors.items()}, str(hub / "model.safetensors"))
    want = model.state_dict()
    for other in (_braid(modules), _braid(hub)):
        got = other.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    assert torch.equal(model.image_newline, hf.model.image_newline)
    key = model.checkpoint_key
    assert key("model.image_newline") == key("image_newline") == "image_newline"


def test_malformed_images_are_value_errors(processors, models):
    model, proc = models["clip"], processors["clip"]
    good = proc.process(tiny_image(40, 30, 1))  # 1x2 tiles, 44 tokens
    cases = [
        (ImageData(good.pixel_values, good.num_tokens, 1), "image_size is missing"),
        (ImageData(good.pixel_values[:2], good.num_tokens, 2, image_size=(30, 40)), "1x2 grid"),
        (ImageData(torch.zeros(3, 3, 16, 16), 44, 3, image_size=(30, 40)), r"\(3, 3, 16, 16\)"),
        (ImageData(good.pixel_values, 45, 4, image_size=(30, 40)), "num_tokens=45.*into 44"),
        # The right pixels for a 30x40 image, claimed to be from a 64x64 one.
        (ImageData(good.pixel_values, good.num_tokens, 5, image_size=(64, 64)), "2x2 grid"),
    ]
    for image, words in cases:
        with pytest.raises(ValueError, match=words):
            model.check_image(image)
    with pytest.raises(ValueError, match="image 1: num_tokens=45"):
        model.encode_images([good, cases[3][0]])
    wire = to_wire(good, 0)
    wire.image_size = [30, 0]
    with pytest.raises(ValueError, match=r"image_size \[30, 0\] is not a \(height, width\)"):
        from_wire(wire)


def test_configs_that_cannot_be_tiled_are_refused(dirs):
    cfg = ModelConfig.from_dir(dirs["clip"])
    with pytest.raises(ValueError, match="not a whole number of the tower's 32x32 tiles"):
        AnyResGrid(32, 4, ((32, 48),))
    full = ModelConfig.from_dict({**cfg.raw, "vision_feature_select_strategy": "full"})
    with pytest.raises(ValueError, match="leaves 17 features per tile"):
        anyres_grid(full)
    bad = ModelConfig.from_dict({**cfg.raw, "image_grid_pinpoints": [[32]]})
    with pytest.raises(ValueError, match="list of \\[height, width\\] integer pairs"):
        anyres_grid(bad)


def test_a_bad_image_fails_only_its_own_request(dirs, processors):
    """At admission (the model's `check_image`): the other requests of the batch run."""
    proc = processors["clip"]
    tok = AutoTokenizer.from_pretrained(str(dirs["clip"]))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def request(rid: str, image: Image.Image, claimed_size: list[int] | None = None):
        data = proc.process(image)
        ids, offsets = proc.expand(tok.encode("look <image> now", add_special_tokens=False), [data])
        wire = to_wire(data, offsets[0])
        if claimed_size is not None:
            wire.image_size = claimed_size
        return GenerateReq(rid, ids, params, 0, images=[wire])

    sched = local_scheduler(dirs["clip"], kv_tokens=1024)
    # A 30x40 image's tiles (1x2 of them) claimed to be a 70x20 one's (2x1: as many tiles).
    with pytest.raises(ValueError, match=r"images\[0\]: num_tokens=44, .* 70x20 .* into 40"):
        sched.handle(request("bad", tiny_image(40, 30, 1), claimed_size=[70, 20]))
    sched.handle(request("good", tiny_image(20, 70, 2)))
    sched.handle(GenerateReq("text", [7, 8, 9], params, 0))
    out = run_to_end(sched)
    assert len(out["good"]) == 4 and len(out["text"]) == 4 and "bad" not in out


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(dirs):
    with braid.LLM(dirs["clip"], kv_tokens=2048, page_size=4, show_progress=False) as llm:
        yield llm


def _hf_greedy(hf, ref, text: str, images: list) -> tuple[list[int], list[int]]:
    """transformers' prompt ids (its processor's expansion) and greedy tokens."""
    inputs = ref(text=[text], images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(
            **inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def _run(llm, prompts: list[tuple[str, list]]) -> list:
    items = [
        {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        for text, images in prompts
    ]
    return llm.generate(items, GREEDY, use_tqdm=False)


def test_greedy_tokens_equal_transformers_alone_and_batched(llm, hf_models, references):
    hf, ref = hf_models["clip"], references["clip"]
    images = _images()
    prompts = [(f"USER: <image>\nwhat is picture {i}?", [im]) for i, im in enumerate(images[:4])]
    prompts.append(("USER: <image> and <image>\nsame?", [images[5], images[6]]))
    prompts.append(("USER: no image here", []))
    expected = [_hf_greedy(hf, ref, text, ims) for text, ims in prompts]
    alone = [_run(llm, [p])[0] for p in prompts]
    batched = _run(llm, prompts)
    llm.check_invariants()
    for (ids, tokens), one, many in zip(expected, alone, batched):
        assert one.prompt_token_ids == many.prompt_token_ids == ids
        assert one.outputs[0].token_ids == tokens
        assert many.outputs[0].token_ids == tokens
    # Different images, different outputs: the images reach the language model.
    assert len({tuple(t) for _, t in expected[:4]}) > 1
