"""ViT vision encoders of the LLaVA family: CLIP's and SigLIP's, as braid modules.

Both are a patch embedding, learned position embeddings and a stack of pre-norm encoder layers
(LayerNorm, bidirectional attention with biases, a two-layer MLP). They differ in the details:
CLIP prepends a class token and normalises the embeddings once more (`pre_layrnorm`) before
the first layer, with quick-GELU in the MLP; SigLIP has neither, and GELU (tanh form).

A tower is built only up to the last layer its caller reads (`num_layers_used`): LLaVA takes a
layer near the end, and the layers after it (and the final norm, and SigLIP's pooling head)
would be computed for nothing. Parameter names follow transformers' vision models
(`embeddings.*`, `encoder.layers.N.*`, `pre_layrnorm.*`), with q/k/v fused into `qkv_proj`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.attention
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import Linear
from braid.runtime.layers.norm import default_weight_loader


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Hugging Face activation names (config `hidden_act`, `projector_hidden_act`) -> function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names; `ValueError` listing the supported names otherwise."""
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"activation {name!r} is not supported (have {sorted(ACTIVATIONS)})")
    return fn


def loadable_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An unfilled parameter (no grad) the strict loader fills whole (one shard, `None`)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = default_weight_loader
    p.shard_names = (None,)
    return p


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = loadable_param(size, dtype=dtype)
        self.bias = loadable_param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class PatchEmbedding(nn.Module):
    """The patchify convolution (kernel = stride = patch size), weight [hidden, C, p, p]."""

    def __init__(self, channels: int, hidden: int, patch: int, bias: bool, dtype) -> None:
        super().__init__()
        self.patch = patch
        self.weight = loadable_param(hidden, channels, patch, patch, dtype=dtype)
        self.bias = loadable_param(hidden, dtype=dtype) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, (H/p) * (W/p), hidden], patches in row-major order."""
        x = F.conv2d(pixels, self.weight, self.bias, stride=self.patch)
        return x.flatten(2).transpose(1, 2)


class PositionEmbedding(nn.Module):
    """One learned vector per position; every image has all positions, in order."""

    def __init__(self, num_positions: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = loadable_param(num_positions, hidden, dtype=dtype)


class VisionAttention(nn.Module):
    """Multi-head self-attention over all the tokens of one image (no mask, no rotary)."""

    def __init__(self, hidden: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"vision hidden_size {hidden} is not a multiple of {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv_proj = Linear(
            hidden, {"q": hidden, "k": hidden, "v": hidden}, bias=True, dtype=dtype
        )
        self.out_proj = Linear(hidden, {None: hidden}, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        qkv = self.qkv_proj(x).view(n, t, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, T, head_dim]
        o = tower_sdpa(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(o.transpose(1, 2).reshape(n, t, -1))


# The towers' attention backends on CUDA: not cuDNN's, which builds an execution plan for each
# new shape (tens of ms each; a tower's shapes change with the number of images in a step:
# 0.2 s of a 256-image serving run on the H200 went to building them).
_TOWER_SDPA = [
    torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    torch.nn.attention.SDPBackend.MATH,
]


def tower_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for vision towers: on CUDA among flash, memory-
    efficient and math attention (never cuDNN); elsewhere as torch chooses."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with torch.nn.attention.sdpa_kernel(_TOWER_SDPA):
        return F.scaled_dot_product_attention(q, k, v, **kw)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, {None: inter}, bias=True, dtype=dtype)
        self.fc2 = Linear(inter, {None: hidden}, bias=True, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@dataclass(frozen=True)
class VisionSpec:
    """The fields of a vision config a tower reads, and how many of its layers are built."""

    hidden: int
    inter: int
    num_heads: int
    num_layers: int
    channels: int
    image_size: int
    patch: int
    eps: float
    act: str
    num_layers_used: int

    def __post_init__(self) -> None:
        if not 0 <= self.num_layers_used <= self.num_layers:
            raise ValueError(
                f"num_layers_used={self.num_layers_used}: the tower has {self.num_layers} layers"
            )
        if self.image_size % self.patch:
            raise ValueError(f"image_size {self.image_size} is not a multiple of {self.patch}")

    @classmethod
    def from_config(
        cls, cfg: dict[str, Any], defaults: dict[str, Any], num_layers_used: int
    ) -> VisionSpec:
        # transformers' defaults fill the keys a config.json leaves out (hub configs often
        # list only what differs from them).
        c = {**defaults, **cfg}
        return cls(
            hidden=c["hidden_size"],
            inter=c["intermediate_size"],
            num_heads=c["num_attention_heads"],
            num_layers=c["num_hidden_layers"],
            channels=c["num_channels"],
            image_size=c["image_size"],
            patch=c["patch_size"],
            eps=float(c["layer_norm_eps"]),
            act=c["hidden_act"],
            num_layers_used=num_layers_used,
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


CLIP_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    num_channels=3,
    image_size=224,
    patch_size=32,
    layer_norm_eps=1e-5,
    hidden_act="quick_gelu",
)
SIGLIP_DEFAULTS: dict[str, Any] = {
    **CLIP_DEFAULTS,
    "patch_size": 16,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}


class VisionEncoderLayer(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(spec.hidden, spec.eps, dtype)
        self.self_attn = VisionAttention(spec.hidden, spec.num_heads, dtype)
        self.layer_norm2 = LayerNorm(spec.hidden, spec.eps, dtype)
        self.mlp = VisionMLP(spec.hidden, spec.inter, spec.act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(spec, dtype) for _ in range(spec.num_layers_used)
        )


class ClipVisionEmbeddings(nn.Module):
    """[CLS] + patch tokens, plus one learned position embedding each."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.class_embedding = loadable_param(spec.hidden, dtype=dtype)
        self.patch_embedding = PatchEmbedding(
            spec.channels, spec.hidden, spec.patch, bias=False, dtype=dtype
        )
        self.position_embedding = PositionEmbedding(spec.num_patches + 1, spec.hidden, dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class SiglipVisionEmbeddings(nn.Module):
    """Patch tokens (the convolution has a bias) plus learned position embeddings; no CLS."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = PatchEmbedding(
            spec.channels, spec.hidden, spec.patch, bias=True, dtype=dtype
        )
        self.position_embedding = PositionEmbedding(spec.num_patches, spec.hidden, dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(pixels) + self.position_embedding.weight


class VisionTower(nn.Module):
    """A ViT built up to layer `num_layers_used`. Subclasses set `defaults` (transformers'
    config defaults), `has_cls`, and the embeddings; `forward` is shared."""

    defaults: ClassVar[dict[str, Any]]
    has_cls: ClassVar[bool]

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype, num_layers_used: int):
        super().__init__()
        self.spec = VisionSpec.from_config(vision_config, self.defaults, num_layers_used)
        self.embeddings = self._embeddings(self.spec, dtype)
        self.encoder = VisionEncoder(self.spec, dtype)

    def _embeddings(self, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def _pre_norm(self, h: torch.Tensor) -> torch.Tensor:
        return h

    @property
    def num_tokens(self) -> int:
        """Tokens per image in every hidden state ([CLS] included where the tower has one)."""
        return self.spec.num_patches + int(self.has_cls)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states [N, num_tokens, hidden] of `pixel_values` [N, C, H, W]: index 0 the
        embeddings (the first layer's input), index i the output of layer i, up to
        `num_layers_used`, as transformers' `output_hidden_states` indexes them (before the
        tower's final norm, which is not built). Negative indices would count from
        `num_layers_used`, not from the tower's depth: resolve them against the config."""
        s = self.spec
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
            s.channels,
            s.image_size,
            s.image_size,
        ):
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}: the tower takes "
                f"[N, {s.channels}, {s.image_size}, {s.image_size}] (the image processor's size)"
            )
        h = self._pre_norm(self.embeddings(pixel_values))
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)
            states.append(h)
        return states


class ClipVisionTower(VisionTower):
    """CLIP's ViT: [CLS] + patches, position embeddings, `pre_layrnorm`, quick-GELU layers."""

    defaults = CLIP_DEFAULTS
    has_cls = True

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype, num_layers_used: int):
        super().__init__(vision_config, dtype, num_layers_used)
        self.pre_layrnorm = LayerNorm(self.spec.hidden, self.spec.eps, dtype)

    def _embeddings(self, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
        return ClipVisionEmbeddings(spec, dtype)

    def _pre_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.pre_layrnorm(h)


class SiglipVisionTower(VisionTower):
    """SigLIP's ViT: patches (no CLS), position embeddings, GELU (tanh) layers."""

    defaults = SIGLIP_DEFAULTS
    has_cls = False

    def _embeddings(self, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
        return SiglipVisionEmbeddings(spec, dtype)


# vision_config["model_type"] -> tower class
TOWERS: dict[str, type[VisionTower]] = {
    "clip_vision_model": ClipVisionTower,
    "siglip_vision_model": SiglipVisionTower,
}


def tower_class(vision_config: dict[str, Any]) -> type[VisionTower]:
    """The tower for a vision config's `model_type`; `ValueError` naming the supported ones."""
    kind = vision_config.get("model_type", "clip_vision_model")
    cls = TOWERS.get(kind)
    if cls is None:
        raise ValueError(f"vision tower {kind!r} is not supported (have {sorted(TOWERS)})")
    return cls
