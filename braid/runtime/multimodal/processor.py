"""The model's own image processor: one RGB image in, one `ImageData` out (its pixels, how many
prompt tokens it becomes, its content hash), and the prompt's image placeholders expanded to
those tokens.

The pixels come from transformers' processor class for the model (read from the model
directory), so braid's inputs are the ones the checkpoint was trained on; braid only counts
the tokens, with the rule transformers' processor for that model uses.

The processor's work is split where that is exact. Here, in the front end, it runs its
geometric steps: conversion to RGB, its own resize (its resample and size rules), crop, pad
and LLaVA-NeXT's tiles, which all give uint8 values. Its last steps (rescale, normalise and,
for the Qwen2-VL family, patchify) are elementwise or a reordering, so they run on the
device before the vision tower (a `PixelRecipe`, run by `image_data.apply_recipe`), to the
same float32 bits, and a quarter of the bytes (an eighth for Qwen2-VL, whose patches hold
each frame twice) cross the processes. `split_recipe` says when a processor cannot be split
that way; its images then carry its float output, as before.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from braid.runtime.image_data import ImageData
from braid.runtime.ipc.to_scheduler import PixelRecipe
from braid.runtime.models.config import QWEN_VL_ARCHS, ModelConfig

if TYPE_CHECKING:
    from PIL import Image

# transformers' image processor classes (backend suffix dropped) each family is served with.
QWEN2_VL_PROCESSORS = frozenset({"Qwen2VLImageProcessor"})
LLAVA_PROCESSORS = frozenset({"CLIPImageProcessor", "SiglipImageProcessor", "LlavaImageProcessor"})
LLAVA_NEXT_PROCESSORS = frozenset({"LlavaNextImageProcessor"})
# LLaVA's vision towers, and how many embeddings each adds to its patches (CLIP's CLS).
LLAVA_TOWER_EXTRA_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
# Qwen2-VL's processor refuses more; the same bound keeps a shortest-edge resize (CLIP) from
# blowing a 1 x 5000 image up into hundreds of megabytes before it is cropped.
MAX_ASPECT_RATIO = 200
_HASH_MASK = (1 << 63) - 1


class ImageProcessor:
    """One model's image preprocessing, built by `from_model_dir`.

    `placeholder` is the prompt text that stands for one image (its chat-template form);
    within it one `image_token_id` marks where the image's tokens go, and `expand` widens
    each such token to the image's `num_tokens`. `process` may be called from several
    threads at once: each thread works on its own copy of transformers' processor.
    `recipe` is the processor's steps that run on the device (None: it is not split, and its
    images carry its float output).
    """

    placeholder: str
    image_token_id: int
    # Whether the model reads `ImageData.image_size` (then it changes the embeddings, so the
    # hash covers it: LLaVA-NeXT's same pixels from two sizes crop differently).
    hashes_image_size = False

    def __init__(self, hf_processor: Any, placeholder: str, image_token_id: int) -> None:
        self.placeholder = placeholder
        self.image_token_id = image_token_id
        self._prototype = hf_processor
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self.recipe = split_recipe(hf_processor, self._patchify_sizes(hf_processor))

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, cfg: ModelConfig, tokenizer: Any
    ) -> ImageProcessor | None:
        """The processor for the model in `model_dir`, or None for a text-only model.
        `ValueError` if a vision-language model's directory has no image processor config,
        its processor type is not one braid supports for the architecture, or the tokenizer
        does not spell the placeholder with the config's token ids."""
        if cfg.vision_config is None:
            return None
        model_dir = Path(model_dir)
        if cfg.image_token_id is None:
            raise ValueError(f"{cfg.architecture}: config.json has no image_token_id")
        hf = _load_hf_processor(model_dir)
        kind = _base_name(type(hf).__name__)
        if cfg.architecture in QWEN_VL_ARCHS:
            if kind not in QWEN2_VL_PROCESSORS:
                raise ValueError(_unsupported(cfg, kind, QWEN2_VL_PROCESSORS))
            return _QwenVLProcessor(hf, cfg, tokenizer)
        if cfg.architecture == "LlavaForConditionalGeneration":
            if kind not in LLAVA_PROCESSORS:
                raise ValueError(_unsupported(cfg, kind, LLAVA_PROCESSORS))
            return _LlavaProcessor(hf, cfg, tokenizer, model_dir)
        if cfg.architecture == "LlavaNextForConditionalGeneration":
            if kind not in LLAVA_NEXT_PROCESSORS:
                raise ValueError(_unsupported(cfg, kind, LLAVA_NEXT_PROCESSORS))
            return _LlavaNextProcessor(hf, cfg, tokenizer, model_dir)
        raise ValueError(f"{cfg.architecture}: braid has no image processing for it")

    def process(self, image: Image.Image) -> ImageData:
        """`image` (RGB, as `load_image` returns it) processed for this model: its
        `pixel_values` equal transformers' processor output for it alone (float32, to the
        bit), held as the processor's uint8 image and `recipe` when the processor is split;
        its token count; and a hash of what it holds, its grid and recipe (and of the image's
        size, for a model that reads it). `ValueError` if the processor refuses the image."""
        width, height = image.size
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ValueError(
                f"image {width}x{height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}"
            )
        try:
            if self.recipe is None:
                data, grid_thw, num_tokens = self._finish(
                    self._hf()(images=[image], return_tensors="pt")
                )
                data = data.to(torch.float32)
            else:
                data, grid_thw, num_tokens = self._geometry(image)
        except ValueError as e:
            raise ValueError(f"image {width}x{height} cannot be processed: {e}") from e
        data = data.contiguous()
        size = (height, width) if self.hashes_image_size else None
        return ImageData(
            data=data,
            num_tokens=num_tokens,
            hash=_content_hash(data, grid_thw, size, self.recipe),
            grid_thw=grid_thw,
            image_size=(height, width),
            recipe=self.recipe,
        )

    def expand(self, input_ids: list[int], images: list[ImageData]) -> tuple[list[int], list[int]]:
        """`input_ids` with each single `image_token_id` widened to its image's `num_tokens`
        copies, images taken in order, and the offset of each image's first token in the
        result. `ValueError` if the number of image tokens is not the number of images."""
        positions = [i for i, t in enumerate(input_ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise ValueError(
                f"the prompt has {_count(len(positions), 'image placeholder')} but "
                f"{_count(len(images), 'image')} {'was' if len(images) == 1 else 'were'} given"
            )
        ids: list[int] = []
        offsets: list[int] = []
        start = 0
        for pos, image in zip(positions, images):
            ids.extend(input_ids[start:pos])
            offsets.append(len(ids))
            ids.extend([self.image_token_id] * image.num_tokens)
            start = pos + 1
        ids.extend(input_ids[start:])
        return ids, offsets

    def _finish(self, out: Any) -> tuple[torch.Tensor, tuple[int, int, int] | None, int]:
        """(pixels for the one image, its grid, its token count) from the processor output."""
        raise NotImplementedError

    def _geometry(
        self, image: Image.Image
    ) -> tuple[torch.Tensor, tuple[int, int, int] | None, int]:
        """`_finish` of the processor's output with its rescale and normalise turned off: the
        uint8 values they would have taken."""
        out = self._hf()(images=[image], do_rescale=False, do_normalize=False, return_tensors="pt")
        pixels, grid, num = self._finish(out)
        return _uint8(pixels), grid, num

    def _patchify_sizes(self, hf: Any) -> tuple[int, int, int] | None:
        """The (temporal, patch, merge) sizes of the processor's patchify, if it has one."""
        return None

    def _hf(self) -> Any:
        # transformers does not promise its processors are thread-safe; a copy per worker
        # thread makes sharing a non-question and costs one small object per thread.
        hf = getattr(self._local, "hf", None)
        if hf is None:
            with self._copy_lock:
                hf = copy.deepcopy(self._prototype)
            self._local.hf = hf
        return hf


class _QwenVLProcessor(ImageProcessor):
    """Qwen2-VL / Qwen2.5-VL: the image becomes grid_t * grid_h * grid_w patches, and every
    merge_size x merge_size block of them one token."""

    def __init__(self, hf: Any, cfg: ModelConfig, tokenizer: Any) -> None:
        vision = cfg.vision_config or {}
        for ours, theirs in (
            ("patch_size", "patch_size"),
            ("temporal_patch_size", "temporal_patch_size"),
            ("merge_size", "spatial_merge_size"),
        ):
            if theirs in vision and vision[theirs] != getattr(hf, ours):
                raise ValueError(
                    f"preprocessor config {ours}={getattr(hf, ours)} does not match the "
                    f"vision config's {theirs}={vision[theirs]}"
                )
        self._merge = int(hf.merge_size)
        ids = [_config_id(cfg, "vision_start_token_id"), cfg.image_token_id]
        ids.append(_config_id(cfg, "vision_end_token_id"))
        placeholder = _spell(tokenizer, ids)
        super().__init__(hf, placeholder, int(cfg.image_token_id))

    def _finish(self, out: Any) -> tuple[torch.Tensor, tuple[int, int, int] | None, int]:
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"], (t, h, w), t * h * w // self._merge**2

    def _geometry(
        self, image: Image.Image
    ) -> tuple[torch.Tensor, tuple[int, int, int] | None, int]:
        # Qwen2VLImageProcessor's own steps before its rescale: its conversion, then its resize
        # (smart_resize to whole merge blocks, its resample); patchify is left to the recipe.
        hf = self._hf()
        pixels = hf.process_image(image, do_convert_rgb=hf.do_convert_rgb)
        if hf.do_resize:
            factor = hf.patch_size * hf.merge_size
            pixels = hf.resize(pixels, size=hf.size, resample=hf.resample, factor=factor)
        pixels = _uint8(torch.from_numpy(np.ascontiguousarray(pixels)))
        _, height, width = pixels.shape
        if height % (hf.patch_size * self._merge) or width % (hf.patch_size * self._merge):
            raise ValueError(f"{height}x{width} is not a whole number of merged patches")
        h, w = height // hf.patch_size, width // hf.patch_size
        return pixels, (1, h, w), h * w // self._merge**2

    def _patchify_sizes(self, hf: Any) -> tuple[int, int, int] | None:
        return (int(hf.temporal_patch_size), int(hf.patch_size), int(hf.merge_size))


class _LlavaProcessor(ImageProcessor):
    """LLaVA: the vision tower makes one embedding per patch (plus CLIP's CLS); the "default"
    feature strategy drops the first of them."""

    def __init__(self, hf: Any, cfg: ModelConfig, tokenizer: Any, model_dir: Path) -> None:
        vision = cfg.vision_config or {}
        tower = vision.get("model_type", "")
        if tower not in LLAVA_TOWER_EXTRA_TOKENS:
            raise ValueError(
                f"LLaVA vision tower {tower!r} is not supported "
                f"(supported: {sorted(LLAVA_TOWER_EXTRA_TOKENS)})"
            )
        self._patch = int(vision.get("patch_size") or _default_patch_size(vision))
        self._extra = LLAVA_TOWER_EXTRA_TOKENS[tower]
        strategy = cfg.raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        self._drop = 1 if strategy == "default" else 0
        stated = _processor_settings(model_dir).get("num_additional_image_tokens")
        if stated is not None and stated != self._extra:
            # transformers would count with the stated number and then fail to match the
            # tower's output; say so at load time instead.
            raise ValueError(
                f"processor_config.json says num_additional_image_tokens={stated}, but a "
                f"{tower} tower adds {self._extra}"
            )
        placeholder = _spell(tokenizer, [int(cfg.image_token_id)])
        super().__init__(hf, placeholder, int(cfg.image_token_id))

    def _finish(self, out: Any) -> tuple[torch.Tensor, tuple[int, int, int] | None, int]:
        pixels = out["pixel_values"][0]
        height, width = pixels.shape[-2:]
        num = (height // self._patch) * (width // self._patch) + self._extra - self._drop
        return pixels, None, num


class _LlavaNextProcessor(_LlavaProcessor):
    """LLaVA-NeXT: the processor's tiles (the base image, then the any-res grid) and the
    image's own size, counted with the model's `AnyResGrid` (the rule of transformers'
    LlavaNextProcessor). The processor pads every image of a batch to the most tiles; braid
    processes one image at a time and keeps only its own tiles regardless."""

    hashes_image_size = True

    def __init__(self, hf: Any, cfg: ModelConfig, tokenizer: Any, model_dir: Path) -> None:
        super().__init__(hf, cfg, tokenizer, model_dir)
        # The model's own geometry, so the two count alike (model code, loaded only for it).
        from braid.runtime.models.llava_next import anyres_grid

        self._grid = anyres_grid(cfg)
        theirs = [list(p) for p in getattr(hf, "image_grid_pinpoints", None) or []]
        if theirs != [list(p) for p in self._grid.pinpoints]:
            raise ValueError(
                f"the image processor's image_grid_pinpoints {theirs} are not the model "
                f"config's {[list(p) for p in self._grid.pinpoints]}"
            )

    def _finish(self, out: Any) -> tuple[torch.Tensor, tuple[int, int, int] | None, int]:
        height, width = (int(n) for n in out["image_sizes"][0])
        tiles = self._grid.num_tiles(height, width)
        pixels = out["pixel_values"][0]
        if pixels.dim() != 4 or pixels.shape[0] < tiles:
            raise ValueError(
                f"the image processor gave pixels {tuple(pixels.shape)}, not {tiles} tiles"
            )
        return pixels[:tiles], None, self._grid.num_tokens(height, width)


def _load_hf_processor(model_dir: Path) -> Any:
    # transformers 5 saves a processor's image settings inside processor_config.json;
    # older checkpoints have preprocessor_config.json.
    if not (model_dir / "preprocessor_config.json").is_file() and (
        "image_processor" not in _processor_settings(model_dir)
    ):
        raise ValueError(
            f"{model_dir} has no preprocessor_config.json: a vision-language model needs its "
            "image processor's config"
        )
    from transformers import AutoImageProcessor  # heavy: only for vision-language models

    try:
        # The PIL implementation on every machine: the same pixels (so the same hashes)
        # whether or not torchvision is installed.
        return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    except TypeError:
        # A transformers without processor backends (4.x) has only the PIL one.
        return AutoImageProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load the image processor from {model_dir}: {e}") from e


def _processor_settings(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "processor_config.json"
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return settings if isinstance(settings, dict) else {}


def _base_name(class_name: str) -> str:
    for suffix in ("Pil", "Fast"):
        if class_name.endswith(suffix):
            return class_name[: -len(suffix)]
    return class_name


def _unsupported(cfg: ModelConfig, kind: str, supported: frozenset[str]) -> str:
    return (
        f"{cfg.architecture}: image processor {kind} is not supported "
        f"(supported: {', '.join(sorted(supported))})"
    )


def _config_id(cfg: ModelConfig, key: str) -> int:
    value = cfg.raw.get(key, (cfg.raw.get("text_config") or {}).get(key))
    if value is None:
        raise ValueError(f"{cfg.architecture}: config.json has no {key}")
    return int(value)


def _spell(tokenizer: Any, ids: list[int]) -> str:
    """The text of `ids`, checked to tokenize back to exactly them: a placeholder the
    tokenizer splits differently would never be found in the prompt."""
    tokens = tokenizer.convert_ids_to_tokens(ids)
    if any(t is None for t in tokens):
        raise ValueError(f"the tokenizer has no token for some of the image token ids {ids}")
    text = "".join(tokens)
    if tokenizer.encode(text, add_special_tokens=False) != ids:
        raise ValueError(
            f"the tokenizer does not encode the image placeholder {text!r} as the ids {ids}"
        )
    return text


def _default_patch_size(vision: dict[str, Any]) -> int:
    from transformers import AutoConfig

    fields = {k: v for k, v in vision.items() if k != "model_type"}
    return int(AutoConfig.for_model(vision["model_type"], **fields).patch_size)


def split_recipe(hf: Any, patch: tuple[int, int, int] | None) -> PixelRecipe | None:
    """The steps of transformers' processor `hf` that run on the device (its rescale and
    normalise, and `patch`: its patchify), or None where splitting them off is not exact:
    - a processor outside transformers' PIL backend (transformers 4.x): its steps are
      reached only through one call, so braid does not take them apart;
    - a processor on the backend's generic pipeline (CLIP, SigLIP) that pads to a fixed
      `pad_size`: it pads after normalising, with zeros that no uint8 value normalises to."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:
        return None
    if not isinstance(hf, PilBackend):
        return None
    if type(hf)._preprocess is PilBackend._preprocess and hf.do_pad and hf.pad_size:
        return None
    channels = 3  # every image is converted to RGB first
    rescale = float(hf.rescale_factor) if hf.do_rescale else 1.0
    mean, std = [0.0] * channels, [1.0] * channels
    if hf.do_normalize:
        mean, std = _per_channel(hf.image_mean, channels), _per_channel(hf.image_std, channels)
    return PixelRecipe(rescale, mean, std, list(patch) if patch else None)


def _per_channel(value: Any, channels: int) -> list[float]:
    # transformers' normalize repeats a single number for every channel.
    if np.ndim(value) == 0:
        return [float(value)] * channels
    return [float(v) for v in value]


def _uint8(pixels: torch.Tensor) -> torch.Tensor:
    if pixels.dtype != torch.uint8:
        # The geometric steps of an RGB image only move, resample and pad bytes.
        raise RuntimeError(f"the image processor's geometric steps gave {pixels.dtype}, not uint8")
    return pixels


def _content_hash(
    data: torch.Tensor,
    grid_thw: tuple[int, int, int] | None,
    image_size: tuple[int, int] | None = None,
    recipe: PixelRecipe | None = None,
) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr((tuple(data.shape), grid_thw, str(data.dtype))).encode())
    if image_size is not None:
        digest.update(repr(image_size).encode())
    if recipe is not None:
        digest.update(repr(recipe).encode())
    digest.update(data.numpy())
    return int.from_bytes(digest.digest(), "little") & _HASH_MASK


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
