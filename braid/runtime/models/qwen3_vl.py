"""Qwen3-VL: the Qwen2-VL family's tower and M-RoPE, changed in four places.

- The tower over 16-pixel patches adds a learned position table (a square grid resampled
  bilinearly to each image's patch grid) to the patch embeddings, which have a bias; every
  block attends over a whole image, with LayerNorm and a GELU (tanh) fc1/fc2 MLP.
- DeepStack: the outputs of the blocks `deepstack_visual_indexes` names each go through their
  own patch merger (normalising the merged block, not each patch), and those features are
  added to the image tokens' hidden states after the language model's first layers.
- The language model is Qwen3's (q/k norm, no QKV bias).
- M-RoPE's three axes take the rotary frequencies interleaved (`mrope_axes(...,
  interleaved=True)`); the positions themselves are Qwen2-VL's for images.

`encode_images` returns, per image, [num_tokens, hidden * (1 + levels)]: the merged
embeddings then each DeepStack level's, side by side, so the encoder cache and chunked
prefill handle one tensor per image; `forward(..., deepstack=(rows, features))` takes the
levels for the rows of the batch that hold image tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import Linear
from braid.runtime.layers.norm import default_weight_loader
from braid.runtime.models import MODELS
from braid.runtime.models.config import QWEN3_VL
from braid.runtime.models.qwen2_vl import (
    Qwen2VLForConditionalGeneration,
    VisionSpec,
    VisionTower,
    _LayerNorm,
)


class _Merger(nn.Module):
    """`linear_fc2(gelu(linear_fc1(norm(x))))` over every merge_size x merge_size block of
    patches: the norm is over each patch (`postshuffle=False`, the main merger) or over the
    merged block (the DeepStack mergers)."""

    def __init__(self, spec: VisionSpec, postshuffle: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged = spec.dim * spec.merge_size**2
        self.postshuffle = postshuffle
        self.norm = _LayerNorm(self.merged if postshuffle else spec.dim, 1e-6, dtype)
        self.linear_fc1 = Linear(self.merged, {None: self.merged}, bias=True, dtype=dtype)
        self.linear_fc2 = Linear(self.merged, {None: spec.out_dim}, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            x = self.norm(x.reshape(-1, self.merged))
        else:
            x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(VisionTower):
    """`forward(pixels, grids)` -> [patches / merge_size**2, out_dim * (1 + levels)]."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__(spec, dtype)
        if not spec.num_position_embeddings:
            raise ValueError("a Qwen3-VL vision config needs num_position_embeddings")
        side = int(spec.num_position_embeddings**0.5)
        if side * side != spec.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings {spec.num_position_embeddings} is not a square grid"
            )
        self.grid_side = side
        if any(not 0 <= i < spec.depth for i in spec.deepstack_layers):
            raise ValueError(
                f"deepstack_visual_indexes {list(spec.deepstack_layers)} are not blocks of a "
                f"{spec.depth}-block tower"
            )
        self.pos_embed = nn.Module()
        self.pos_embed.weight = nn.Parameter(
            torch.empty(spec.num_position_embeddings, spec.dim, dtype=dtype), requires_grad=False
        )
        self.pos_embed.weight.weight_loader = default_weight_loader
        self.pos_embed.weight.shard_names = (None,)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(spec, True, dtype) for _ in spec.deepstack_layers
        )

    def merger_for(self, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
        return _Merger(spec, False, dtype)

    def _learned_positions(
        self, hw: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """[patches, dim] float32: the position table resampled (bilinear, corners aligned) to
        each patch's (row, column) in its image, as transformers computes it."""
        device = hw.device
        counts = [t * h * w for t, h, w in grids]
        sizes = torch.tensor([(h, w) for _, h, w in grids], device=device)
        sizes = sizes.repeat_interleave(torch.tensor(counts, device=device), dim=0)
        side = self.grid_side
        taps, weights = [], []
        for axis in (0, 1):
            steps = torch.clamp(sizes[:, axis] - 1, min=1)
            src = hw[:, axis].to(torch.float32) * (side - 1) / steps
            floor = torch.floor(src)
            offsets = torch.arange(0, 2, device=device)
            taps.append((floor.long()[:, None] + offsets).clamp(0, side - 1))
            distance = (src[:, None] - floor[:, None] - offsets).abs()
            weights.append((1 - distance).clamp(min=0))
        index = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
        return (F.embedding(index, self.pos_embed.weight) * weight[:, :, None]).sum(1)

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        layout = self.layout(grids)
        rotate = self._rotation(*self._rotary(layout.hw))
        x = self.patch_embed(pixels)
        x = x + self._learned_positions(layout.hw, grids).to(x.dtype)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, rotate, layout.frames)
            if i in self.spec.deepstack_layers:
                merger = self.deepstack_merger_list[self.spec.deepstack_layers.index(i)]
                levels.append(merger(x))
        return torch.cat([self.merger(x), *levels], dim=-1)


@MODELS.register
class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL on the Qwen2-VL runtime path (see the module docstring)."""

    architectures = (QWEN3_VL,)
    tower_class = Qwen3VisionTower

    @property
    def deepstack_levels(self) -> int:
        """How many hidden-size blocks follow the embedding in each `encode_images` row."""
        return len(self.vision_spec.deepstack_layers)

    def checkpoint_key(self, key: str) -> str | None:
        key = super().checkpoint_key(key)
        # The blocks' MLP is Qwen2-VL's under other names.
        if key.startswith("visual.blocks."):
            key = key.replace(".mlp.linear_fc1.", ".mlp.fc1.").replace(
                ".mlp.linear_fc2.", ".mlp.fc2."
            )
        return key
