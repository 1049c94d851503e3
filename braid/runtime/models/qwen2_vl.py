"""Qwen2-VL and Qwen2.5-VL: a ViT over 14-pixel patches with 2-D rotary positions, a patch
merger into the language model's hidden size, and a Qwen2 language model whose rotary
positions have three axes (M-RoPE: temporal, height, width).

braid's own implementation. The language model is `LlamaModel` (Qwen2: QKV bias); the vision
tower is built here, once per architecture: Qwen2-VL's blocks use LayerNorm and a quick-GELU
fc1/fc2 MLP with every block attending over a whole image; Qwen2.5-VL's use RMSNorm and a
SwiGLU MLP with bias, and attend within windows of `window_size` pixels except in the blocks
`fullatt_block_indexes` names. Several images go through the tower in one pass, their patches
laid end to end; attention never crosses from one image (or window) into another, and a
windowed pass runs its blocks in window order (models/patch_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.attention.base import AttentionBackend
from braid.runtime.forward_batch import ForwardBatch
from braid.runtime.image_data import ImageData, check_each, device_pixels
from braid.runtime.layers.linear import Linear
from braid.runtime.layers.norm import RMSNorm, default_weight_loader
from braid.runtime.layers.rotary import apply_rotary, compute_inv_freq, mrope_axes
from braid.runtime.models import MODELS
from braid.runtime.models.config import QWEN3_VL, ModelConfig
from braid.runtime.models.llama import LlamaForCausalLM, LlamaModel, lm_head_for
from braid.runtime.models.patch_layout import PatchLayout, Segments
from braid.runtime.models.vision_mlp import VisionGatedMLP

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The vision MLP activations Qwen2-VL family checkpoints name (transformers' ACT2FN spellings).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower's shape, read from `vision_config` with transformers' defaults for keys
    a config leaves out (hub configs spell the input channels `in_chans`)."""

    windowed: bool  # Qwen2.5-VL: RMSNorm, SwiGLU MLP, window attention
    depth: int
    dim: int
    num_heads: int
    mlp_dim: int
    act: str
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge_size: int
    out_dim: int
    window_size: int
    full_attention_blocks: frozenset[int]
    rope_theta: float
    # Qwen3-VL: a bias on the patch embedding, a learned position table of
    # `num_position_embeddings` (a square grid, resampled to each image), and the blocks
    # whose outputs feed the language model's first layers (DeepStack).
    patch_bias: bool = False
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision hidden size {self.dim} over {self.num_heads} heads must give a head "
                "size divisible by 4 (2-D rotary: a quarter of it per axis and half)"
            )
        if self.act not in _ACTIVATIONS:
            raise ValueError(
                f"vision hidden_act {self.act!r} is not supported (have {sorted(_ACTIVATIONS)})"
            )
        if self.windowed and self.window_units < 1:
            raise ValueError(
                f"window_size {self.window_size} is smaller than one merged patch "
                f"({self.patch_size * self.merge_size} pixels)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_units(self) -> int:
        """A window's side in merged patches."""
        return self.window_size // self.merge_size // self.patch_size

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> VisionSpec:
        vc: dict[str, Any] = cfg.vision_config or {}
        windowed = cfg.architecture == QWEN2_5_VL
        qwen3 = cfg.architecture == QWEN3_VL
        if qwen3:
            dim = vc.get("hidden_size", 1152)
            mlp_dim = vc.get("intermediate_size", 4304)
            out_dim = vc.get("out_hidden_size", cfg.hidden_size)
            act = vc.get("hidden_act", "gelu_pytorch_tanh")
        elif windowed:
            dim = vc.get("hidden_size", 1280)
            mlp_dim = vc.get("intermediate_size", 3420)
            out_dim = vc.get("out_hidden_size", cfg.hidden_size)
            act = vc.get("hidden_act", "silu")
        else:
            # Qwen2-VL's vision `hidden_size` is the merger's output: the language model's.
            dim = vc.get("embed_dim", 1280)
            mlp_dim = int(dim * vc.get("mlp_ratio", 4))
            out_dim = vc.get("hidden_size", cfg.hidden_size)
            act = vc.get("hidden_act", "quick_gelu")
        rope = vc.get("rope_parameters") or {}
        return cls(
            windowed=windowed,
            depth=vc.get("depth", 32),
            dim=dim,
            num_heads=vc.get("num_heads", 16),
            mlp_dim=mlp_dim,
            act=act,
            patch_size=vc.get("patch_size", 16 if qwen3 else 14),
            temporal_patch_size=vc.get("temporal_patch_size", 2),
            in_channels=vc.get("in_channels", vc.get("in_chans", 3)),
            merge_size=vc.get("spatial_merge_size", 2),
            out_dim=out_dim,
            window_size=vc.get("window_size", 112),
            full_attention_blocks=frozenset(vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            patch_bias=qwen3,
            num_position_embeddings=vc.get("num_position_embeddings", 2304) if qwen3 else 0,
            deepstack_layers=tuple(vc.get("deepstack_visual_indexes", (8, 16, 24)))
            if qwen3
            else (),
        )


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        for p in (self.weight, self.bias):
            p.weight_loader = default_weight_loader
            p.shard_names = (None,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def _vision_norm(spec: VisionSpec, size: int, dtype: torch.dtype) -> nn.Module:
    return RMSNorm(size, 1e-6, dtype) if spec.windowed else _LayerNorm(size, 1e-6, dtype)


def _load_conv_kernel(load: Callable[..., None]) -> Callable[..., None]:
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        # The checkpoint holds a Conv3d kernel [dim, C, T, P, P] whose stride is its size, so it
        # is a linear map of the flattened (C, T, P, P) patch.
        load(param, loaded.reshape(loaded.shape[0], -1), shard)

    return loader


class _PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(spec.patch_dim, {None: spec.dim}, bias=spec.patch_bias, dtype=dtype)
        self.proj.weight.weight_loader = _load_conv_kernel(self.proj.weight.weight_loader)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


# Rotates a block's (q, k) by the pass's patch positions.
Rotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = Linear(spec.dim, {None: 3 * spec.dim}, bias=True, dtype=dtype)
        self.proj = Linear(spec.dim, {None: spec.dim}, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, rotate: Rotate, segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, k)
        return self.proj(segments.attend(q, k, v))


class _VisionMLP(nn.Module):
    """Qwen2-VL: `fc2(act(fc1(x)))`."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(spec.dim, {None: spec.mlp_dim}, bias=True, dtype=dtype)
        self.fc2 = Linear(spec.mlp_dim, {None: spec.dim}, bias=True, dtype=dtype)
        self.act = _ACTIVATIONS[spec.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _vision_norm(spec, spec.dim, dtype)
        self.norm2 = _vision_norm(spec, spec.dim, dtype)
        self.attn = _VisionAttention(spec, dtype)
        act, silu = _ACTIVATIONS[spec.act], spec.act in ("silu", "swish")
        self.mlp = (
            VisionGatedMLP(spec.dim, spec.mlp_dim, act, silu, dtype)
            if spec.windowed
            else _VisionMLP(spec, dtype)
        )

    def forward(self, x: torch.Tensor, rotate: Rotate, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotate, segments)
        return x + self.mlp(self.norm2(x))

    def forward_rms(
        self, h: torch.Tensor, residual: torch.Tensor | None, rotate: Rotate, segments: Segments
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm blocks (Qwen2.5-VL): the block on `h + residual` kept as its two terms
        (`residual` None: `h` alone), each add made by the norm after it; returns the output
        the same way. Bit for bit `forward`: the norm rounds the sum as the add would."""
        x, residual = (self.norm1(h), h) if residual is None else self.norm1(h, residual)
        x, residual = self.norm2(self.attn(x, rotate, segments), residual)
        return self.mlp(x), residual


class _PatchMerger(nn.Module):
    """Normalises each patch, then maps every merge_size x merge_size block of patches (adjacent
    in the tower's order) to one language-model embedding."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        merged = spec.dim * spec.merge_size**2
        self.merged = merged
        self.ln_q = _vision_norm(spec, spec.dim, dtype)
        # Named as the checkpoint's nn.Sequential (mlp.0, mlp.2).
        self.mlp = nn.Sequential(
            Linear(merged, {None: merged}, bias=True, dtype=dtype),
            nn.GELU(),
            Linear(merged, {None: spec.out_dim}, bias=True, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


class VisionTower(nn.Module):
    """Patch embedding, `depth` blocks, patch merger. `forward(pixels, grids)` maps the
    concatenated patches of several images (each [t*h*w, patch_dim], merge-block order, as the
    Qwen2-VL image processor emits them) to [sum t*h*w / merge_size**2, out_dim]."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = _PatchEmbed(spec, dtype)
        self.blocks = nn.ModuleList(_VisionBlock(spec, dtype) for _ in range(spec.depth))
        self.merger = self.merger_for(spec, dtype)
        # Axial rotary: a quarter of each head's columns per axis (row, column), then repeated.
        inv_freq = compute_inv_freq(spec.head_dim // 2, spec.rope_theta, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # On CUDA q and k rotate in one fused kernel per block (float32 math, one rounding,
        # as transformers' float32 rotation); elsewhere in plain torch. Chosen once.
        self._fused_rotary = None
        if self.inv_freq.is_cuda:
            from braid.kernels.rope import rotary

            self._fused_rotary = rotary

    def merger_for(self, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
        """The module that maps merged blocks of patches to the language model's width."""
        return _PatchMerger(spec, dtype)

    def layout(self, grids: Sequence[tuple[int, int, int]]) -> PatchLayout:
        spec = self.spec
        units = spec.window_units if spec.windowed else None
        return PatchLayout.build(grids, spec.merge_size, units, self.inv_freq.device)

    def _rotary(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (hw[:, :, None].float() * self.inv_freq).flatten(1)  # [patches, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        layout = self.layout(grids)
        rotate = self._rotation(*self._rotary(layout.hw))
        h, residual = layout.permute(self.patch_embed(pixels)), None
        for i, block in enumerate(self.blocks):
            windowed = layout.windows is not None and i not in self.spec.full_attention_blocks
            segments = layout.windows if windowed else layout.frames
            if self.spec.windowed:  # RMSNorm blocks: the residual adds fold into the norms
                h, residual = block.forward_rms(h, residual, rotate, segments)
            else:
                h = block(h, rotate, segments)
        return layout.restore(self.merger(h if residual is None else h + residual))

    def _rotation(self, cos: torch.Tensor, sin: torch.Tensor) -> Rotate:
        """How every block rotates its q and k by the patches' float32 `cos`/`sin` rows."""
        fused = self._fused_rotary
        if fused is not None:
            tables = (cos[:, 0], sin[:, 0])  # row p is patch p's: its "position" is p
            positions = torch.arange(cos.shape[0], device=cos.device)
            return lambda q, k: fused(q, k, positions, tables)

        def rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # In float32 whatever the model dtype, as transformers does.
            rq, rk = apply_rotary(q.float(), k.float(), cos, sin)
            return rq.to(q.dtype), rk.to(k.dtype)

        return rotate


@MODELS.register
class Qwen2VLForConditionalGeneration(nn.Module):
    """Serves Qwen2-VL and Qwen2.5-VL (the tower is chosen from `cfg.architecture`).

    The runtime embeds a prompt with `embed_tokens`, replaces its image tokens' rows with
    `encode_images` outputs, and runs `forward` with those embeddings and, for a prompt with
    images, the M-RoPE positions `mrope_positions` gives (decode steps: 1-D positions shifted
    by the request's rope delta).
    """

    stacked_params = LlamaForCausalLM.stacked_params
    # Rotary tables some checkpoints store (language model and vision tower).
    ignored_key_suffixes = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")
    # transformers 5 nests the parts (`model.language_model.`, `model.visual.`); the hub and
    # transformers 4 layout, which braid's names follow, has them at `model.` and `visual.`.
    _key_prefixes = (("model.language_model.", "model."), ("model.visual.", "visual."))

    architectures: tuple[str, ...] = (QWEN2_VL, QWEN2_5_VL)
    tower_class: type[VisionTower] = VisionTower

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        if cfg.architecture not in self.architectures:
            raise ValueError(f"{cfg.architecture} is not served by {type(self).__name__}")
        if cfg.mrope_section is None or cfg.image_token_id is None:
            raise ValueError(
                f"{cfg.architecture}: the config needs mrope_section and an image token"
            )
        self.config = cfg
        self.dtype = dtype
        self.vision_spec = VisionSpec.from_config(cfg)
        if self.vision_spec.out_dim != cfg.hidden_size:
            raise ValueError(
                f"vision tower output {self.vision_spec.out_dim} != hidden size {cfg.hidden_size}"
            )
        self.visual = self.tower_class(self.vision_spec, dtype)
        self.model = LlamaModel(cfg, dtype, max_positions)
        self.lm_head = lm_head_for(cfg, dtype, self.model.embed_tokens)
        self.register_buffer(
            "mrope_column_axes",
            mrope_axes(cfg.mrope_section, cfg.head_dim, cfg.mrope_interleaved),
            persistent=False,
        )

    def checkpoint_key(self, key: str) -> str | None:
        """braid's name for a checkpoint key of either layout."""
        for old, new in self._key_prefixes:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] embeddings of `input_ids` (image tokens get the placeholder's)."""
        return self.model.embed_tokens(input_ids)

    def check_image(self, image: ImageData) -> None:
        """`ValueError` unless `image` is what this tower takes: a (t, h, w) grid of whole
        merge blocks, one row of `patch_dim` values per patch (or, with a recipe, one uint8
        frame of h x w patches and this tower's patchify), `num_tokens` = patches /
        merge_size**2. The scheduler asks before admitting a request, so a bad image is that
        request's error, not its batch's."""
        if image.grid_thw is None or len(image.grid_thw) != 3:
            raise ValueError("no (t, h, w) grid_thw (a Qwen2-VL image processor sets it)")
        t, h, w = image.grid_thw
        spec, merge = self.vision_spec, self.vision_spec.merge_size
        shape = tuple(image.data.shape)
        if image.recipe is None:
            want = (t * h * w, spec.patch_dim)
        else:
            want = (spec.in_channels, h * spec.patch_size, w * spec.patch_size)
            if t != 1 or image.recipe.patch != [spec.temporal_patch_size, spec.patch_size, merge]:
                want = None
        if len(shape) != (2 if image.recipe is None else 3) or min(t, h, w) < 1:
            raise ValueError(f"pixel_values {shape} are not patches")
        if shape != want:
            raise ValueError(
                f"pixel_values {shape} do not fit grid {image.grid_thw} of patches of "
                f"{spec.patch_dim} values"
            )
        if h % merge or w % merge:
            raise ValueError(f"grid {image.grid_thw} does not divide into blocks")
        if image.num_tokens != t * h * w // merge**2:
            raise ValueError(f"num_tokens {image.num_tokens} != {t * h * w} patches / {merge**2}")

    def encode_images(self, images: list[ImageData]) -> list[torch.Tensor]:
        """One [image.num_tokens, hidden] tensor per image, in the model's dtype and device,
        from one tower pass over all of them."""
        if not images:
            return []
        check_each(images, self.check_image)
        device = self.model.embed_tokens.weight.device
        pixels = torch.cat(device_pixels(images, device, self.dtype))
        grids = [(int(t), int(h), int(w)) for t, h, w in (im.grid_thw for im in images)]
        merged = self.visual(pixels, grids)
        return list(merged.split([im.num_tokens for im in images]))

    def forward(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Logits (float32) for the rows `batch.logits_indices` selects. With
        `batch.mrope_positions` ([3, tokens]) the rotary rows are M-RoPE's; otherwise the 1-D
        rotary of `batch.positions`. `deepstack`: see `LlamaModel.forward` (Qwen3-VL)."""
        mrope = getattr(batch, "mrope_positions", None)
        cos_sin = None
        if mrope is not None:
            cos_sin = self.model.rotary.lookup_mrope(mrope, self.mrope_column_axes)
        h = self.model(batch, attn, input_embeds=input_embeds, cos_sin=cos_sin, deepstack=deepstack)
        return self.lm_head(h[batch.logits_indices], batch.head_rows).float()

    @staticmethod
    def mrope_positions(
        cfg: ModelConfig, input_ids: list[int], images: list[ImageData]
    ) -> tuple[torch.Tensor, int]:
        """The [3, len(input_ids)] int64 M-RoPE positions of a prompt and its rope delta (max
        position + 1 - len(input_ids)), as transformers' `get_rope_index` computes them for
        images: text tokens count up on all three axes; an image's tokens take (start, start +
        row, start + column) over its merged grid (start + frame on the temporal axis), and the
        text after it resumes at start + the longer side of that grid. Image tokens are the
        `cfg.image_token_id` tokens, `images[k]` taking the next `images[k].num_tokens` of them,
        which must be consecutive; `ValueError` if the counts do not match."""
        m = (cfg.vision_config or {}).get("spatial_merge_size", 2)
        ids = torch.tensor(input_ids, dtype=torch.int64)
        where = torch.nonzero(ids == cfg.image_token_id).flatten().tolist()
        counts = [im.num_tokens for im in images]
        if len(where) != sum(counts):
            raise ValueError(
                f"the prompt has {len(where)} image tokens, its images need {sum(counts)}"
            )
        parts: list[torch.Tensor] = []
        cursor = pos = used = 0  # next token, next text position, image tokens consumed
        for image, n in zip(images, counts):
            if n < 1:
                raise ValueError("an image stands for no tokens")
            start = where[used]
            if where[used + n - 1] != start + n - 1:
                raise ValueError(f"the {n} tokens of an image at {start} are not consecutive")
            if start > cursor:
                parts.append(torch.arange(pos, pos + start - cursor).expand(3, -1))
                pos += start - cursor
            t, h, w = (int(x) for x in image.grid_thw)
            gt, gh, gw = t, h // m, w // m
            grid = torch.stack(
                torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            )
            parts.append(grid.reshape(3, -1) + pos)
            pos += max(gh, gw)
            cursor, used = start + n, used + n
        if cursor < len(input_ids):
            parts.append(torch.arange(pos, pos + len(input_ids) - cursor).expand(3, -1))
        positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)
        delta = int(positions.max()) + 1 - len(input_ids) if len(input_ids) else 0
        return positions.contiguous(), delta
