"""Images cross the processes as the processor's uint8 image, and its last steps (rescale,
normalise, Qwen2-VL's patchify) run beside the vision tower: what the tower gets must be
transformers' float32 `pixel_values`, to the bit, for both model families, every size and
odd image; the message must carry uint8 (a quarter of the float32 bytes, an eighth for
Qwen2-VL's doubled frames); and the content hash must follow the processed image."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from braid.runtime.image_data import (
    ImageData,
    apply_recipe,
    device_pixels,
    from_wire,
    to_wire,
    value_table,
)
from braid.runtime.ipc import codec
from braid.runtime.ipc.to_scheduler import GenerateReq, PixelRecipe
from braid.runtime.models.config import ModelConfig
from braid.runtime.multimodal.media import MediaLimits, load_image
from braid.runtime.multimodal.processor import ImageProcessor, split_recipe
from braid.runtime.sampling_params import SamplingParams
from tests.multimodal.tiny_llava import build_tiny_llava, build_tiny_llava_next
from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl, tiny_image

FAMILIES = ["qwen2.5", "qwen3", "llava-clip", "llava-siglip", "llava-next"]
# (width, height): Qwen's smart_resize up and down, CLIP's shortest edge and centre crop,
# LLaVA-NeXT's pinpoints of every shape, and a 180:1 strip.
SIZES = [(1, 1), (13, 9), (50, 70), (300, 40), (401, 233), (5, 900)]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


class Family:
    """A tiny model directory, braid's `ImageProcessor` for it and transformers' own image
    processor (PIL backend), whose float32 output is the reference."""

    def __init__(self, name: str, path: Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.name, self.path = name, path
        self.proc = ImageProcessor.from_model_dir(
            path, ModelConfig.from_dir(path), AutoTokenizer.from_pretrained(str(path))
        )
        self.hf = AutoImageProcessor.from_pretrained(str(path), backend="pil")

    @property
    def qwen(self) -> bool:
        return self.name.startswith("qwen")

    def reference(self, image: Image.Image) -> torch.Tensor:
        out = self.hf(images=[image], return_tensors="pt")["pixel_values"]
        return out if self.qwen else out[0]


def _build(name: str, root: Path) -> Path:
    if name.startswith("qwen"):
        return build_tiny_qwen2_vl(root, name.removeprefix("qwen"))
    if name == "llava-next":
        return build_tiny_llava_next(root)
    return build_tiny_llava(root, name.removeprefix("llava-"))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, _build(request.param, tmp_path_factory.mktemp(request.param)))


def _through_the_wire(image: ImageData) -> ImageData:
    """`image` as the scheduler gets it: its message, msgpack-encoded and decoded."""
    req = GenerateReq("r", [1] * image.num_tokens, SamplingParams(), 0, images=[to_wire(image, 0)])
    back = codec.decode(codec.encode(req))
    assert back == req
    return from_wire(back.images[0])


# -- the value of every byte ------------------------------------------------------------------


@pytest.mark.parametrize(
    "mean, std",
    [(CLIP_MEAN, CLIP_STD), ([0.5] * 3, [0.5] * 3), ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])],
)
def test_every_byte_becomes_what_transformers_rescale_and_normalize_make_of_it(mean, std):
    from transformers.image_transforms import normalize, rescale
    from transformers.image_utils import ChannelDimension

    first = ChannelDimension.FIRST
    ramp = np.tile(np.arange(256, dtype=np.uint8), (3, 1, 1))  # [3, 1, 256]: every byte
    want = normalize(
        rescale(ramp, 1 / 255, input_data_format=first), mean, std, input_data_format=first
    )
    want = torch.from_numpy(want)[:, 0]
    table = value_table(PixelRecipe(1 / 255, mean, std), torch.device("cpu"))
    assert want.dtype == table.dtype == torch.float32
    torch.testing.assert_close(table, want, rtol=0, atol=0)
    # transformers multiplies in float64 and rounds once: the same product in float32 rounds
    # twice and is off by an ulp for about 40% of the values, so the order matters.
    x = torch.arange(256, dtype=torch.float32)
    naive = (x * (1 / 255) - torch.tensor(mean).view(3, 1)) / torch.tensor(std).view(3, 1)
    assert not torch.equal(naive, want)


def test_rescale_and_normalize_turned_off_are_the_identity():
    hf = _clip_processor()
    hf.do_rescale = hf.do_normalize = False
    recipe = split_recipe(hf, None)
    assert recipe == PixelRecipe(1.0, [0.0] * 3, [1.0] * 3)
    image = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8)
    assert torch.equal(apply_recipe(image, recipe), image.float())


# -- the processor's output, to the bit --------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_device_side_pixels_equal_the_processors_float32_output(family: Family, size):
    image = tiny_image(*size, seed=sum(size))
    want = family.reference(image)
    data = family.proc.process(image)
    assert data.data.dtype == torch.uint8 and data.recipe is not None
    assert data.shape == tuple(want.shape)
    got = _through_the_wire(data).pixels("cpu")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got, want)  # not merely close: the same float32 bits


def test_a_batch_of_images_is_finished_like_each_alone(family: Family):
    images = [family.proc.process(tiny_image(*s, seed=i)) for i, s in enumerate(SIZES[1:5])]
    # One image of a processor that is not split (its float output) among them.
    floats = ImageData(images[0].pixel_values, images[0].num_tokens, 1, images[0].grid_thw)
    batch = [_through_the_wire(im) for im in images[:2]] + [floats, images[2], images[3]]
    alone = [im.pixels("cpu") for im in batch]
    assert torch.equal(alone[2], alone[0])
    for dtype in (torch.float32, torch.bfloat16):
        batched = device_pixels(batch, "cpu", dtype)
        assert len(batched) == len(alone)
        for a, b in zip(alone, batched):
            assert b.dtype == dtype and torch.equal(a.to(dtype), b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pixels_finished_on_cuda_equal_the_processors(family: Family):
    images = [tiny_image(*s, seed=i) for i, s in enumerate(SIZES)]
    data = [_through_the_wire(family.proc.process(im)) for im in images]
    for got, image in zip(device_pixels(data, "cuda"), images):
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), family.reference(image))


# -- the message -------------------------------------------------------------------------------


def test_the_message_carries_uint8_a_quarter_of_float32(family: Family):
    image = tiny_image(401, 233, seed=5)
    data = family.proc.process(image)
    new = to_wire(data, 0, torch.float32)  # uint8 goes as it is, whatever the model's dtype
    # What braid sent before: the processor's float32 output.
    floats = ImageData(family.reference(image), data.num_tokens, 0, data.grid_thw, data.image_size)
    old = to_wire(floats, 0, torch.float32)
    assert new.dtype == "uint8" and old.dtype == "float32"
    assert new.recipe == family.proc.recipe and old.recipe is None
    if family.qwen:
        # One frame of the resized image; the patches repeat it temporal_patch_size times.
        t, h, w = data.grid_thw
        patch = family.hf.patch_size
        assert t == 1 and new.shape == [3, h * patch, w * patch]
        assert new.recipe.patch == [2, patch, 2]
        ratio = 4 * 2
    elif family.name == "llava-next":
        tile = family.hf.crop_size.height
        assert new.shape[1:] == [3, tile, tile] and new.shape[0] >= 2  # base tile + the grid
        ratio = 4
    else:
        size = family.hf.crop_size.height if family.name == "llava-clip" else family.hf.size.height
        assert new.shape == [3, size, size]
        ratio = 4
    assert len(old.data) == ratio * len(new.data)
    # The encoded messages differ by the pixels, give or take the recipe's few numbers.
    sizes = [
        len(codec.encode(GenerateReq("r", [1], SamplingParams(), 0, images=[m]))[1])
        for m in (new, old)
    ]
    assert abs((sizes[1] - sizes[0]) - (len(old.data) - len(new.data))) < 200


def test_malformed_uint8_messages_are_value_errors():
    recipe = PixelRecipe(1 / 255, CLIP_MEAN, CLIP_STD, [2, 14, 2])
    image = ImageData(torch.zeros(3, 28, 28, dtype=torch.uint8), 1, 7, (1, 2, 2), recipe=recipe)
    cases = [
        (dict(recipe=None), "uint8 pixels need the recipe"),
        (dict(dtype="float32", data=bytes(3 * 28 * 28 * 4)), "a recipe takes uint8"),
        (dict(shape=[3, 784], data=bytes(3 * 784)), "a recipe takes uint8"),
        (dict(recipe=PixelRecipe(1 / 255, CLIP_MEAN[:2], CLIP_STD)), "one finite mean"),
        (dict(recipe=PixelRecipe(1 / 255, CLIP_MEAN, [0.5, 0.0, 0.5])), "non-zero std"),
        (dict(recipe=PixelRecipe(float("nan"), CLIP_MEAN, CLIP_STD)), "one finite mean"),
        (dict(recipe=PixelRecipe(1 / 255, CLIP_MEAN, CLIP_STD, [2, 14])), "recipe patch"),
    ]
    for change, words in cases:
        wire = to_wire(image, 0)
        for key, value in change.items():
            setattr(wire, key, value)
        with pytest.raises(ValueError, match=words):
            from_wire(wire)
    with pytest.raises(ValueError, match="uint8 without a recipe cannot be sent"):
        to_wire(ImageData(image.data, 1, 7, (1, 2, 2)), 0)


# -- odd images ----------------------------------------------------------------------------------


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _odd_images() -> dict[str, bytes]:
    rng = np.random.default_rng(11)
    rgba = rng.integers(0, 256, (30, 20, 4), dtype=np.uint8)
    rgba[..., 3] = rng.choice([0, 128, 255], (30, 20))  # clear, half and opaque pixels
    palette = tiny_image(24, 18, 12).quantize(16)
    palette.info["transparency"] = 3  # one palette entry is see-through
    return {
        "1x1": _png(tiny_image(1, 1, 13)),
        "200-to-1": _png(tiny_image(1000, 5, 14)),
        "grayscale": _png(Image.fromarray(rng.integers(0, 256, (21, 33), dtype=np.uint8))),
        "rgba": _png(Image.fromarray(rgba, mode="RGBA")),
        "palette": _png(palette),
    }


ODD = _odd_images()


@pytest.mark.parametrize("kind", list(ODD))
def test_odd_images_still_give_the_processors_result(family: Family, kind: str):
    raw = Image.open(io.BytesIO(ODD[kind]))
    assert (kind, raw.mode) in {
        ("1x1", "RGB"),
        ("200-to-1", "RGB"),
        ("grayscale", "L"),
        ("rgba", "RGBA"),
        ("palette", "P"),
    }
    # The front end's path (load_image converts to RGB), against the processor given the
    # decoded file as it is (it converts to RGB itself).
    data = family.proc.process(load_image(ODD[kind], MediaLimits()))
    assert data.data.dtype == torch.uint8
    assert torch.equal(_through_the_wire(data).pixels("cpu"), family.reference(raw))


# -- content hash ------------------------------------------------------------------------------


def test_hash_follows_the_processed_image(family: Family):
    image = tiny_image(64, 48, seed=21)
    first = family.proc.process(image)
    assert family.proc.process(image.copy()).hash == first.hash
    changed = image.copy()
    r, g, b = changed.getpixel((32, 24))
    changed.putpixel((32, 24), ((r + 128) % 256, g, b))
    assert family.proc.process(changed).hash != first.hash
    assert family.proc.process(tiny_image(64, 48, seed=22)).hash != first.hash


def test_images_that_process_to_the_same_bytes_share_a_hash(tmp_path: Path):
    """CLIP crops the centre of an image already at its shortest edge: pixels outside the crop
    change nothing the model sees, so the hash (of the processed uint8 image) is the same."""
    family = Family("llava-clip", build_tiny_llava(tmp_path / "clip", "clip"))
    size = family.hf.crop_size.height
    base = tiny_image(size + 8, size, seed=31)
    edited = base.copy()
    edited.putpixel((0, 0), (1, 2, 3))  # column 0 is cropped away
    a, b = family.proc.process(base), family.proc.process(edited)
    assert torch.equal(a.data, b.data) and a.hash == b.hash


# -- a processor that cannot be split ----------------------------------------------------------


def _clip_processor(**kwargs):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, **kwargs
    )


def test_padding_after_normalising_keeps_the_float_path(tmp_path: Path):
    """CLIP's generic pipeline pads to `pad_size` after normalising, with zeros no byte
    normalises to: braid does not split such a processor, and its images carry the
    processor's float32 output, unchanged."""
    hf = _clip_processor(do_pad=True, pad_size={"height": 40, "width": 40})
    assert split_recipe(hf, None) is None
    image = tiny_image(50, 70, seed=41)
    want = hf(images=[image], return_tensors="pt")["pixel_values"][0]
    split = hf(images=[image], do_rescale=False, do_normalize=False, return_tensors="pt")
    # What splitting would have given: the padding normalised, so not the processor's zeros.
    recipe = split_recipe(_clip_processor(), None)
    assert not torch.equal(apply_recipe(split["pixel_values"][0], recipe), want)
    # Through braid: a LLaVA directory whose processor pads (to the tower's size here, so
    # the tower can take the result).
    path = build_tiny_llava(tmp_path / "pad", "clip")
    settings = json.loads((path / "processor_config.json").read_text())
    settings["image_processor"] |= {"do_pad": True, "pad_size": {"height": 32, "width": 32}}
    (path / "processor_config.json").write_text(json.dumps(settings))
    family = Family("llava-clip", path)
    assert family.proc.recipe is None
    data = family.proc.process(image)
    assert data.recipe is None and data.data.dtype == torch.float32
    wire = to_wire(data, 0)
    assert wire.dtype == "float32" and wire.recipe is None
    assert torch.equal(from_wire(wire).pixels("cpu"), family.reference(image))
