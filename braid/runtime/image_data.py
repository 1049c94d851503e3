"""One image as the runtime carries it: its pixels (the processor's output, or the uint8 image
it comes from and the recipe that finishes it), how many prompt tokens it becomes, and the
content hash that names it in the prefix cache and the encoder-output cache.

A recipe runs an image processor's last steps in torch, on the device that runs the vision
tower: uint8 pixels in, the processor's float32 output out, equal to the bit. transformers'
numpy code rescales in float64 and rounds once to float32 (`image.astype(np.float64) *
scale`, then `.astype(np.float32)`), then normalises in float32 (`(image - mean) / std`, mean
and std rounded to float32 first). Both are functions of one byte and its channel, so
`value_table` computes them once for all 256 values of each channel, on the CPU in that
order of operations, and the device only looks values up in that table: no device arithmetic
can round differently. (The same product taken in float32 rounds twice and is off by an ulp
for about 40% of the values.) Qwen2-VL's patchify is a reshape and transpose, and a copy of
the frame for each temporal patch, which moves values without changing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from braid.runtime.ipc.to_scheduler import ImageInput, PixelRecipe


@dataclass
class ImageData:
    """An image processed for its model by the model's own transformers image processor.

    `pixel_values` is that processor's output for this image alone (Qwen2-VL family: the
    flattened patches, [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch];
    LLaVA: [channels, height, width]; LLaVA-NeXT: its tiles, the base one first, [tiles,
    channels, height, width]). What the image holds is `data`: either that output itself
    (`recipe` None), or the processor's uint8 image before its rescale, normalise and
    (Qwen2-VL) patchify steps, [channels, height, width] (Qwen2-VL family, LLaVA) or [tiles,
    channels, height, width] (LLaVA-NeXT), which `recipe` turns into the same float32 values
    on any device (`pixels`).

    `num_tokens` is how many embeddings the vision tower turns it into, so how many image
    tokens stand for it in the prompt, counted as transformers counts them. `hash` is a 63-bit
    hash of `data`, its grid and its recipe (and, for a model whose embeddings depend on it,
    LLaVA-NeXT's, of `image_size`): the same bytes processed the same way give the same hash,
    a different image another.
    """

    data: torch.Tensor
    num_tokens: int
    hash: int
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL family: patches in t, h, w
    # (height, width) of the image as loaded; LLaVA-NeXT crops its tiles' features to it.
    image_size: tuple[int, int] | None = None
    recipe: PixelRecipe | None = None

    @property
    def pixel_values(self) -> torch.Tensor:
        """The processor's output (see the class), on the CPU: `data` itself without a recipe,
        else computed from it on each access. The runtime reads `pixels(device)` instead."""
        return self.data if self.recipe is None else apply_recipe(self.data, self.recipe)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of `pixel_values`, without computing them."""
        return patched_shape(tuple(self.data.shape), self.recipe)

    def pixels(self, device: torch.device | str) -> torch.Tensor:
        """`pixel_values` in float32 on `device`, the recipe (if any) run there."""
        data = self.data.to(device)
        return data.float() if self.recipe is None else apply_recipe(data, self.recipe)

    @property
    def nbytes(self) -> int:
        """Bytes of `data`: what the image costs to hold and to send."""
        return self.data.numel() * self.data.element_size()


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
}


def check_each(images: list[ImageData], check: Callable[[ImageData], None]) -> None:
    """`check(image)` for every image (a model's `check_image`); its `ValueError` is re-raised
    naming the image's index."""
    for i, image in enumerate(images):
        try:
            check(image)
        except ValueError as e:
            raise ValueError(f"image {i}: {e}") from None


def device_pixels(
    images: list[ImageData], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Each image's `pixel_values` on `device`, computed in float32 (`ImageData.pixels`), then
    cast to `dtype` one image at a time. The uint8 images cross to the device in one copy, to
    CUDA from pinned memory without waiting (as `forward_batch.to_device` does), and their
    recipes run there."""
    packed = [im for im in images if im.recipe is not None]
    flat = torch.empty(0, dtype=torch.uint8)
    if packed:
        flat = torch.cat([im.data.reshape(-1) for im in packed])
        if torch.device(device).type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
    parts = iter(flat.split([im.data.numel() for im in packed]))
    return [
        (
            im.pixels(device)
            if im.recipe is None
            else apply_recipe(next(parts).view(im.data.shape), im.recipe)
        ).to(dtype)
        for im in images
    ]


def to_wire(image: ImageData, offset: int, dtype: torch.dtype | None = None) -> ImageInput:
    """The message form of `image`, whose tokens start at `offset` in the prompt. Float pixels
    (no recipe) are sent in `dtype` if given (the model's: its vision tower casts them to that
    dtype anyway, so sending them cast is exact and, for a 16-bit model, half the bytes); uint8
    pixels go as they are, their recipe beside them."""
    pixels = image.data
    if image.recipe is None and dtype is not None and pixels.dtype != dtype:
        pixels = pixels.to(dtype)
    pixels = pixels.contiguous()
    name = str(pixels.dtype).removeprefix("torch.")
    if name not in _DTYPES or (name == "uint8") != (image.recipe is not None):
        raise ValueError(
            f"image pixels in {name} {'with' if image.recipe else 'without'} a recipe cannot be "
            f"sent (floats without one, uint8 with one)"
        )
    return ImageInput(
        data=pixels.view(torch.uint8).numpy().tobytes() if pixels.numel() else b"",
        shape=list(pixels.shape),
        dtype=name,
        num_tokens=image.num_tokens,
        offset=offset,
        hash=image.hash,
        grid_thw=list(image.grid_thw) if image.grid_thw else None,
        image_size=list(image.image_size) if image.image_size else None,
        recipe=image.recipe,
    )


def from_wire(msg: ImageInput) -> ImageData:
    """The image a message carries; `ValueError` if its bytes do not fill its shape, or its
    shape, grid, image size or recipe is not an image's."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"image: unknown pixel dtype {msg.dtype!r}")
    if any(n < 1 for n in msg.shape) or (msg.grid_thw is not None and len(msg.grid_thw) != 3):
        raise ValueError(f"image: shape {msg.shape} / grid {msg.grid_thw} is not an image's")
    size = msg.image_size
    if size is not None and (len(size) != 2 or not all(type(n) is int and n >= 1 for n in size)):
        raise ValueError(f"image: image_size {msg.image_size} is not a (height, width)")
    _check_recipe(msg)
    count = 1
    for n in msg.shape:
        count *= n
    if count * dtype.itemsize != len(msg.data):
        raise ValueError(f"image: {len(msg.data)} bytes do not fill shape {msg.shape}")
    data = msg.data if isinstance(msg.data, bytearray) else bytearray(msg.data)
    flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return ImageData(
        data=flat.reshape(msg.shape),
        num_tokens=msg.num_tokens,
        hash=msg.hash,
        grid_thw=tuple(msg.grid_thw) if msg.grid_thw else None,
        image_size=tuple(msg.image_size) if msg.image_size else None,
        recipe=msg.recipe,
    )


def _check_recipe(msg: ImageInput) -> None:
    recipe = msg.recipe
    if recipe is None:
        if msg.dtype == "uint8":
            raise ValueError("image: uint8 pixels need the recipe that finishes them")
        return
    if msg.dtype != "uint8" or len(msg.shape) not in (3, 4):
        raise ValueError(
            f"image: a recipe takes uint8 [(tiles,) channels, height, width] pixels, not "
            f"{msg.dtype} {msg.shape}"
        )
    numbers = [recipe.rescale, *recipe.mean, *recipe.std]
    if (
        len(recipe.mean) != msg.shape[-3]
        or len(recipe.std) != msg.shape[-3]
        or not all(math.isfinite(x) for x in numbers)
        or not all(s != 0 for s in recipe.std)
    ):
        raise ValueError(
            f"image: recipe mean {recipe.mean} / std {recipe.std} / rescale {recipe.rescale} "
            f"is not one finite mean and non-zero std per channel of {msg.shape}"
        )
    if recipe.patch is not None and (
        len(recipe.patch) != 3 or min(recipe.patch) < 1 or len(msg.shape) != 3
    ):
        raise ValueError(f"image: recipe patch {recipe.patch} is not a (temporal, patch, merge)")


def apply_recipe(pixels: torch.Tensor, recipe: PixelRecipe) -> torch.Tensor:
    """The processor's float32 output for uint8 `pixels` ([channels, height, width], or
    [tiles, channels, height, width]), on `pixels`' device: rescaled and normalised per
    channel, then patchified when `recipe.patch` is set ([patches, patch values])."""
    if pixels.dtype != torch.uint8 or pixels.dim() not in (3, 4):
        raise ValueError(
            f"a recipe takes uint8 [(tiles,) channels, height, width] pixels, not "
            f"{str(pixels.dtype).removeprefix('torch.')} {tuple(pixels.shape)}"
        )
    table = value_table(recipe, pixels.device)
    channels = pixels.shape[-3]
    if channels != table.shape[0]:
        raise ValueError(f"pixels of {channels} channels, a recipe for {table.shape[0]}")
    channel = torch.arange(channels, device=pixels.device).view(channels, 1, 1)
    values = table[channel, pixels.long()]
    if recipe.patch is None:
        return values
    if values.dim() != 3:
        raise ValueError(
            f"patches are cut from one [channels, height, width] image, not {tuple(values.shape)}"
        )
    temporal, patch, merge = recipe.patch
    return patchify(values, temporal, patch, merge)


def value_table(recipe: PixelRecipe, device: torch.device) -> torch.Tensor:
    """[channels, 256] float32 on `device`: entry [c, v] is what the processor makes of value
    v in channel c."""
    return _table(recipe.rescale, tuple(recipe.mean), tuple(recipe.std), torch.device(device))


@lru_cache(maxsize=16)
def _table(
    rescale: float, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> torch.Tensor:
    if len(mean) != len(std) or not mean:
        raise ValueError(f"mean {list(mean)} and std {list(std)}: one of each per channel")
    # transformers' rescale: the float64 product, rounded once to float32.
    values = (torch.arange(256, dtype=torch.float64) * rescale).to(torch.float32)
    # transformers' normalize: mean and std as float32, difference and quotient in float32.
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1)
    return ((values - m) / s).to(device)


def patchify(image: torch.Tensor, temporal: int, patch: int, merge: int) -> torch.Tensor:
    """[channels, height, width] -> [patches, channels * temporal * patch * patch] in Qwen2-VL's
    order: merge x merge blocks of patches row by row, each block's patches row by row, each
    patch's values channel, then frame (the image repeated `temporal` times), row, column.
    `ValueError` unless height and width are whole blocks."""
    c, h, w = image.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(
            f"an image of {h}x{w} is not a whole number of {merge}x{merge} blocks of "
            f"{patch}-pixel patches"
        )
    gh, gw = h // patch, w // patch
    x = image.view(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(1, 4, 2, 5, 0, 3, 6).unsqueeze(5)  # blocks, block row/col, c, frame, p, p
    x = x.expand(*x.shape[:5], temporal, patch, patch)
    return x.reshape(gh * gw, c * temporal * patch * patch)


def patched_shape(shape: tuple[int, ...], recipe: PixelRecipe | None) -> tuple[int, ...]:
    """The shape `apply_recipe` gives for uint8 pixels of `shape`, without computing it."""
    if recipe is None or recipe.patch is None or len(shape) != 3:
        return tuple(shape)
    temporal, patch, _ = recipe.patch
    c, h, w = shape
    return ((h // patch) * (w // patch), c * temporal * patch * patch)
