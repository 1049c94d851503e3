"""One image as the runtime carries it: processed pixels, how many prompt tokens it becomes,
and the content hash that names it in the prefix cache and the encoder-output cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from braid.runtime.ipc.to_scheduler import ImageInput


@dataclass
class ImageData:
    """An image processed for its model by the model's own transformers image processor.

    `pixel_values` is that processor's output for this image alone (Qwen2-VL family: the
    flattened patches, [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch];
    LLaVA: [channels, height, width]; LLaVA-NeXT: its tiles, the base one first, [tiles,
    channels, height, width]). `num_tokens` is how many embeddings the vision tower turns it
    into, so how many image tokens stand for it in the prompt, counted as transformers counts
    them. `hash` is a 63-bit hash of the processed pixels and their grid (and, for a model
    whose embeddings depend on it, LLaVA-NeXT's, of `image_size`): the same bytes processed
    the same way give the same hash, a different image another.
    """

    pixel_values: torch.Tensor
    num_tokens: int
    hash: int
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL family: patches in t, h, w
    # (height, width) of the image as loaded; LLaVA-NeXT crops its tiles' features to it.
    image_size: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_each(images: list[ImageData], check: Callable[[ImageData], None]) -> None:
    """`check(image)` for every image (a model's `check_image`); its `ValueError` is re-raised
    naming the image's index."""
    for i, image in enumerate(images):
        try:
            check(image)
        except ValueError as e:
            raise ValueError(f"image {i}: {e}") from None


def to_wire(image: ImageData, offset: int, dtype: torch.dtype | None = None) -> ImageInput:
    """The message form of `image`, whose tokens start at `offset` in the prompt, its pixels
    in `dtype` if given (the model's: its vision tower casts them to that dtype anyway, so
    sending them cast is exact and, for a 16-bit model, half the bytes)."""
    pixels = image.pixel_values
    if dtype is not None and pixels.dtype != dtype:
        pixels = pixels.to(dtype)
    pixels = pixels.contiguous()
    dtype = str(pixels.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"image pixels in {dtype} cannot be sent (have {sorted(_DTYPES)})")
    return ImageInput(
        data=pixels.view(torch.uint8).numpy().tobytes() if pixels.numel() else b"",
        shape=list(pixels.shape),
        dtype=dtype,
        num_tokens=image.num_tokens,
        offset=offset,
        hash=image.hash,
        grid_thw=list(image.grid_thw) if image.grid_thw else None,
        image_size=list(image.image_size) if image.image_size else None,
    )


def from_wire(msg: ImageInput) -> ImageData:
    """The image a message carries; `ValueError` if its bytes do not fill its shape, or its
    shape, grid or image size is not an image's."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"image: unknown pixel dtype {msg.dtype!r}")
    if any(n < 1 for n in msg.shape) or (msg.grid_thw is not None and len(msg.grid_thw) != 3):
        raise ValueError(f"image: shape {msg.shape} / grid {msg.grid_thw} is not an image's")
    size = msg.image_size
    if size is not None and (len(size) != 2 or not all(type(n) is int and n >= 1 for n in size)):
        raise ValueError(f"image: image_size {msg.image_size} is not a (height, width)")
    count = 1
    for n in msg.shape:
        count *= n
    if count * torch.finfo(dtype).bits // 8 != len(msg.data):
        raise ValueError(f"image: {len(msg.data)} bytes do not fill shape {msg.shape}")
    data = msg.data if isinstance(msg.data, bytearray) else bytearray(msg.data)
    flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return ImageData(
        pixel_values=flat.reshape(msg.shape),
        num_tokens=msg.num_tokens,
        hash=msg.hash,
        grid_thw=tuple(msg.grid_thw) if msg.grid_thw else None,
        image_size=tuple(msg.image_size) if msg.image_size else None,
    )
