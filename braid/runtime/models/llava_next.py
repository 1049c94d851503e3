"""LLaVA-NeXT (LLaVA 1.6): LLaVA with any-resolution tiling.

The image processor picks, from the config's `image_grid_pinpoints`, the resolution that
keeps the most of the image (then wastes the least), resizes the image into it keeping its
aspect ratio, pads it centred, and cuts it into tower-sized tiles; the image resized whole
to one tile (the base) goes first. Every tile goes through the tower and the projector as a
LLaVA image does. The base tile's features come first in the prompt; then the grid tiles'
features laid out as the image they came from (rows of patches across tiles), cropped back
to the image's own aspect ratio (the padding's rows or columns dropped), with the learned
`image_newline` after each row. So an image's token count depends on its original size,
which `ImageData.image_size` carries.

`AnyResGrid` is that geometry, shared by the model and the image processor (so both count
tokens with one rule); it follows transformers' `select_best_resolution` and `unpad_image`
to the same float rounding, so the counts equal transformers' processor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from braid.runtime.image_data import ImageData, check_each, device_pixels
from braid.runtime.models import MODELS
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.llava import LlavaBase
from braid.runtime.models.vision_towers import VisionSpec, loadable_param, tower_class

# transformers' LlavaNextConfig default, (height, width) each.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

Span = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class AnyResGrid:
    """How an image of a given (height, width) is tiled and how many tokens it becomes.

    `tile`: pixels per side of a tile (the tower's input size); `side`: feature rows (and
    columns) per tile, tile // patch; `pinpoints`: the resolutions (height, width) an image
    may be resized into, each a whole number of tiles."""

    tile: int
    side: int
    pinpoints: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.pinpoints:
            raise ValueError("image_grid_pinpoints is empty")
        for h, w in self.pinpoints:
            if h < self.tile or w < self.tile or h % self.tile or w % self.tile:
                raise ValueError(
                    f"image_grid_pinpoints: [{h}, {w}] is not a whole number of the tower's "
                    f"{self.tile}x{self.tile} tiles"
                )

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint an image of `height` x `width` is resized into: the one keeping the
        most of its pixels (each side scaled down to whole pixels), then wasting the least,
        the first on a tie."""

        def fit(pinpoint: tuple[int, int]) -> tuple[int, int]:
            h, w = pinpoint
            scale = min(w / width, h / height)
            kept = min(int(width * scale) * int(height * scale), width * height)
            return kept, -(h * w - kept)

        return max(self.pinpoints, key=fit)

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of grid tiles for an image of `height` x `width`."""
        h, w = self.best_resolution(height, width)
        return h // self.tile, w // self.tile

    def num_tiles(self, height: int, width: int) -> int:
        """Tiles the tower runs on for the image: the grid's and the base one."""
        rows, cols = self.tiles(height, width)
        return rows * cols + 1

    def layout(self, height: int, width: int) -> tuple[int, int, Span, Span]:
        """(tile rows, tile columns, feature rows kept, feature columns kept): the spans of
        the (rows * side) x (cols * side) feature grid that the image covers once resized
        into it and centred, as transformers' `unpad_image` computes them."""
        rows, cols = self.tiles(height, width)
        fh, fw = rows * self.side, cols * self.side
        if width / height > fw / fh:
            kept = int(round(height * (fw / width), 7))
            pad = (fh - kept) // 2
            return rows, cols, (pad, fh - pad), (0, fw)
        kept = int(round(width * (fh / height), 7))
        pad = (fw - kept) // 2
        return rows, cols, (0, fh), (pad, fw - pad)

    def num_tokens(self, height: int, width: int) -> int:
        """Prompt tokens for an image of `height` x `width`: the base tile's features, then
        each kept feature row of the grid plus its newline."""
        _, _, (top, bottom), (left, right) = self.layout(height, width)
        return self.side * self.side + (bottom - top) * (right - left + 1)


def _pinpoints(spec: Any) -> tuple[tuple[int, int], ...]:
    if spec is None:
        return DEFAULT_PINPOINTS
    if not isinstance(spec, (list, tuple)) or not all(
        isinstance(p, (list, tuple))
        and len(p) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in p)
        for p in spec
    ):
        raise ValueError(
            f"image_grid_pinpoints must be a list of [height, width] integer pairs, got {spec!r}"
        )
    return tuple((int(h), int(w)) for h, w in spec)


def anyres_grid(cfg: ModelConfig) -> AnyResGrid:
    """The tiling of a LLaVA-NeXT config: its tower's tile and patch sizes and its
    `image_grid_pinpoints`. `ValueError` if those do not describe whole tiles, or if the
    feature strategy leaves a tile's features not a square grid of patches (CLIP's CLS kept
    under "full", or a SigLIP patch dropped under "default": transformers cannot pack those
    either)."""
    vision = cfg.vision_config
    if vision is None:
        raise ValueError(f"{cfg.architecture} needs a vision_config")
    tower = tower_class(vision)
    spec = VisionSpec.from_config(vision, tower.defaults, 0)
    strategy = cfg.raw.get("vision_feature_select_strategy", "default")
    per_tile = spec.num_patches + int(tower.has_cls) - int(strategy == "default")
    if per_tile != spec.num_patches:
        raise ValueError(
            f"vision_feature_select_strategy {strategy!r} with a "
            f"{vision.get('model_type', 'clip_vision_model')} tower leaves {per_tile} features "
            f"per tile, not the {spec.num_patches} patches LLaVA-NeXT lays out as a grid"
        )
    pinpoints = _pinpoints(cfg.raw.get("image_grid_pinpoints"))
    return AnyResGrid(spec.image_size, spec.image_size // spec.patch, pinpoints)


@MODELS.register
class LlavaNextForConditionalGeneration(LlavaBase):
    """LLaVA-NeXT: `encode_images` runs every tile of every image through the tower in one
    pass and packs each image's features (base tile, then the cropped grid with its
    newlines); `embed_tokens` and `forward` are LLaVA's."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(cfg, dtype, max_positions)
        self.grid = anyres_grid(cfg)
        self.image_newline = loadable_param(cfg.hidden_size, dtype=dtype)

    def check_image(self, image: ImageData) -> None:
        """`ValueError` unless `image` carries its original (height, width) and is what this
        model makes of an image of that size: the grid's tiles and the base tile, each
        [channels, tile, tile], and `grid.num_tokens` tokens. The scheduler asks before
        admitting a request, so a bad image is that request's error alone."""
        if image.image_size is None:
            raise ValueError(
                "image_size is missing: LLaVA-NeXT needs the image's (height, width) to crop "
                "its tiles' features"
            )
        height, width = image.image_size
        if height < 1 or width < 1:
            raise ValueError(f"image_size {image.image_size} is not an image's (height, width)")
        rows, cols = self.grid.tiles(height, width)
        s = self.vision_tower.spec
        want = (rows * cols + 1, s.channels, s.image_size, s.image_size)
        if image.shape != want:
            raise ValueError(
                f"pixel_values {image.shape} are not the {rows}x{cols} grid "
                f"tiles and the base tile an image of {height}x{width} (height x width) makes: "
                f"{want}"
            )
        num = self.grid.num_tokens(height, width)
        if image.num_tokens != num:
            raise ValueError(
                f"num_tokens={image.num_tokens}, but this model turns an image of "
                f"{height}x{width} (height x width) into {num} embeddings"
            )

    def encode_images(self, images: list[ImageData]) -> list[torch.Tensor]:
        """One [image.num_tokens, hidden] tensor per image, in the model's dtype; all the
        images' tiles go through the tower in one batch. `ValueError` for an image that
        `check_image` refuses."""
        if not images:
            return []
        check_each(images, self.check_image)
        weight = self.multi_modal_projector.linear_1.weight
        feats = self.image_features(torch.cat(device_pixels(images, weight.device, weight.dtype)))
        per_image = feats.split([im.shape[0] for im in images])
        return [self._pack(f, *im.image_size) for f, im in zip(per_image, images)]

    def _pack(self, tiles: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[num_tokens, hidden] from one image's tile features [tiles, side * side, hidden]."""
        rows, cols, (top, bottom), (left, right) = self.grid.layout(height, width)
        s, d = self.grid.side, tiles.shape[-1]
        # [rows, cols, s, s, d] -> [rows, s, cols, s, d]: the image's patch rows, left to right.
        grid = tiles[1:].view(rows, cols, s, s, d).transpose(1, 2).reshape(rows * s, cols * s, d)
        grid = grid[top:bottom, left:right]
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, d)
        return torch.cat([tiles[0], torch.cat([grid, newline], dim=1).flatten(0, 1)])
