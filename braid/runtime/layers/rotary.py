"""Rotary position embedding (the rotate-half form Llama, Mistral and Qwen use), with the
linear and Llama 3 frequency scalings, and M-RoPE (Qwen2-VL: three position axes).

The cos/sin tables are computed exactly as Hugging Face computes them (float32 frequencies,
then `cat(freqs, freqs)`), so positions embed bit-for-bit the same. A `RotaryEmbedding` created
on CUDA rotates with the fused Triton kernel (`braid.kernels.rotary`: q and k in place, one
launch per layer); elsewhere with plain torch. The choice is made once, at construction.

M-RoPE gives each token three positions (temporal, height, width) and splits the rotary
frequencies into sections, each rotated by one axis; its cos/sin rows are gathered from the same
tables (`RotaryEmbedding.lookup_mrope`); on CUDA the fused kernel takes them as a table of
their own, elsewhere the torch path does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotary inverse frequencies; raises `ValueError` for a scaling braid does not implement."""
    inv_freq = _inv_freq(head_dim, theta)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")


def mrope_axes(sections: Sequence[int], head_dim: int, interleaved: bool = False) -> torch.Tensor:
    """For each of the `head_dim` rotary columns, the position axis (0 temporal, 1 height,
    2 width) that rotates it under M-RoPE; the second half of the head repeats the first (the
    `cat(freqs, freqs)` layout). As transformers splits the `head_dim // 2` frequencies:
    Qwen2-VL gives section `i` of them, one after another, to axis `i % 3`; Qwen3-VL
    (`interleaved`) gives frequency `j` to axis `j % 3` while `j < 3 * sections[j % 3]` and to
    the temporal axis after that. `ValueError` if the sections do not add up to
    `head_dim // 2`."""
    if sum(sections) != head_dim // 2 or any(n < 0 for n in sections):
        raise ValueError(
            f"mrope_section {list(sections)} must add up to head_dim // 2 = {head_dim // 2}"
        )
    if interleaved:
        if len(sections) != 3:
            raise ValueError(f"interleaved mrope_section {list(sections)} needs 3 sections")
        j = torch.arange(head_dim // 2)
        axis = j % 3
        limits = torch.tensor([3 * n for n in sections])[axis]
        half = torch.where(j < limits, axis, 0)
    else:
        half = torch.cat(
            [torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(sections)]
        )
    return torch.cat((half, half))


@dataclass(frozen=True)
class FusedRotaryTables:
    """The cos/sin tables and the fused kernel that reads them: what a CUDA `RotaryEmbedding`'s
    `lookup` hands to `apply_rotary` in place of the per-token sin rows."""

    cos: torch.Tensor  # [max_positions, head_dim]
    sin: torch.Tensor
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place; with `store=(v, k_cache, v_cache, loc)` also write the
        rotated k and v into the pool (`braid.kernels.rotary`), quantized with `kv_scales`
        for an fp8 pool."""
        return self.kernel(q, k, positions, (self.cos, self.sin), store=store, kv_scales=kv_scales)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        self._fused: FusedRotaryTables | None = None
        if self.cos.is_cuda:
            from braid.kernels.rope import rotary

            self._fused = FusedRotaryTables(self.cos, self.sin, rotary)

    def lookup(
        self, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | FusedRotaryTables]:
        """What `apply_rotary(q, k, *lookup(positions))` needs, looked up once per forward and
        shared by every layer: cos and sin rows for `positions`, shaped to broadcast over heads;
        or, for a module created on CUDA, `(positions, FusedRotaryTables)` for the fused
        kernel (a module created on CPU and moved keeps the torch path)."""
        if self._fused is not None:
            return positions, self._fused
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def lookup_mrope(
        self, positions: torch.Tensor, axes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | FusedRotaryTables]:
        """M-RoPE cos and sin rows for `apply_rotary`: column `j` of token `t` is the table
        entry at position `positions[axes[j], t]`. `positions`: int64 [3, tokens]; `axes`:
        `mrope_axes(...)` on this module's device. A token whose three positions are equal gets
        exactly its `lookup` row. On the CPU: the rows, [tokens, 1, head_dim]. For a module
        created on CUDA: `(arange(tokens), FusedRotaryTables)` over the rows as a table of
        their own (token `t` at "position" `t`), so the fused kernel rotates q and k (and
        stores K and V) as for 1-D positions; it reads the first half of each row, which the
        second repeats (`mrope_axes`)."""
        rows = positions.index_select(0, axes).T  # [tokens, head_dim]
        cos, sin = self.cos.gather(0, rows), self.sin.gather(0, rows)
        if self._fused is not None:
            tokens = torch.arange(rows.shape[0], device=rows.device)
            return tokens, FusedRotaryTables(cos, sin, self._fused.kernel)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor | FusedRotaryTables,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q`: [tokens, heads, head_dim], `k`: [tokens, kv_heads, head_dim]; `cos`, `sin` as
    `RotaryEmbedding.lookup` returns them. Returns the rotated (q, k): new tensors from the
    torch path; from the fused kernel, q and k themselves, rotated in place."""
    if isinstance(sin, FusedRotaryTables):
        return sin.rotate(q, k, cos)  # `cos` holds the positions here
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
