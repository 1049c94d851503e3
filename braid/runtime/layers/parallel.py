"""Layers split over a tensor-parallel group (`braid.runtime.distributed.group`), built
inside `sharding(group)`; outside it each is the plain layer it extends.

- `ColumnParallelLinear`: each rank holds a block of every shard's output rows (its
  attention heads of a fused QKV, its columns of a fused gate-up); no communication.
- `RowParallelLinear`: each rank holds a block of the input columns and its output is a
  partial sum; the ranks all-reduce it (the bias is rank 0's alone, so it is added once).
- `VocabParallelEmbedding` / `ParallelLMHead`: each rank holds a block of the vocabulary
  (padded to a multiple of the group size); embeddings are summed over the ranks (a token is
  looked up where it lives, zeros elsewhere), logits gathered side by side for the sampler.

Weights load by shard as the plain layers do; each rank keeps only its block of every
checkpoint tensor, and reads only that block when the loader hands it a safetensors slice
(`reads_slices` on the parameter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.distributed.group import TPGroup, building_group
from braid.runtime.distributed.split import HeadShard, even_block, head_shard
from braid.runtime.layers.embedding import LMHead, VocabEmbedding
from braid.runtime.layers.linear import Linear


def read_block(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """Elements [start, start + size) along `dim` of a checkpoint tensor, or of a safetensors
    slice (which reads only them from the file)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def full_shape(loaded) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


class ColumnParallelLinear(Linear):
    """A `Linear` whose shards are split by output rows. `shards` maps each shard to
    `(rows in the checkpoint, first row this rank holds, rows it holds)`; without a group,
    give every shard as `(rows, 0, rows)`."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str | None, tuple[int, int, int]],
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        self.blocks = dict(shards)
        super().__init__(
            in_features, {n: rows for n, (_, _, rows) in shards.items()}, bias=bias, dtype=dtype
        )
        for p in (self.weight, self.bias):
            if p is not None:
                p.reads_slices = True

    def _load_shard(self, param: nn.Parameter, loaded, shard: str | None) -> None:
        if shard not in self.blocks:
            raise ValueError(f"unknown shard {shard!r} (have {list(self.blocks)})")
        total, start, rows = self.blocks[shard]
        shape = full_shape(loaded)
        if shape[0] != total:
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {shape} has {shape[0]} rows, expected {total}"
            )
        super()._load_shard(param, read_block(loaded, 0, start, rows), shard)


class RowParallelLinear(Linear):
    """A `Linear` whose input columns are split: this rank multiplies its block
    [in_start, in_start + in_features) of the input features and the group sums the outputs.
    `full_in` is the checkpoint's input width."""

    def __init__(
        self,
        full_in: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        self.group: TPGroup | None = building_group()
        rank, size = (self.group.rank, self.group.size) if self.group else (0, 1)
        self.in_start, local_in = even_block(full_in, rank, size, "input features")
        self.full_in = full_in
        super().__init__(local_in, {None: out_features}, bias=bias, dtype=dtype)
        self.weight.reads_slices = True
        if self.bias is not None:
            self.bias.reads_slices = True

    def _load_shard(self, param: nn.Parameter, loaded, shard: str | None) -> None:
        shape = full_shape(loaded)
        if param is self.bias:
            if self.group is not None and self.group.rank != 0:
                # Every rank's partial sum would add it: only rank 0's does.
                super()._load_shard(param, torch.zeros(shape, dtype=param.dtype), shard)
                return
            super()._load_shard(param, read_block(loaded, 0, 0, shape[0]), shard)
            return
        if len(shape) != 2 or shape[1] != self.full_in:
            raise ValueError(f"checkpoint shape {shape} != expected {(shape[0], self.full_in)}")
        super()._load_shard(param, read_block(loaded, 1, self.in_start, self.in_features), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(super().forward(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The group's sum of this rank's output (a fused kernel that computed the
        projection itself calls this)."""
        return partial if self.group is None else self.group.all_reduce(partial)


def _vocab_block(vocab_size: int, group: TPGroup | None) -> tuple[int, int]:
    """(first id, ids held) of this rank's vocabulary block, padded to a multiple of the
    group's size (the last rank's padding rows are zero and never selected)."""
    if group is None:
        return 0, vocab_size
    per = -(-vocab_size // group.size)
    return group.rank * per, per


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.group = building_group()
        self.vocab_size = vocab_size
        self.vocab_start, rows = _vocab_block(vocab_size, self.group)
        super().__init__(rows, hidden_size, dtype)
        self.weight.weight_loader = self._load
        self.weight.reads_slices = True

    def _load(self, param: nn.Parameter, loaded, shard: str | None) -> None:
        load_vocab_block(param, loaded, self.vocab_size, self.vocab_start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(h)


def load_vocab_block(param: nn.Parameter, loaded, vocab_size: int, start: int) -> None:
    """Rows [start, start + len(param)) of a [vocab, hidden] checkpoint tensor into `param`;
    rows past the vocabulary (padding) are zero."""
    shape = full_shape(loaded)
    if shape != (vocab_size, param.shape[1]):
        raise ValueError(f"checkpoint shape {shape} != expected {(vocab_size, param.shape[1])}")
    rows = max(0, min(param.shape[0], vocab_size - start))
    param.data[rows:].zero_()
    if rows:
        param.data[:rows].copy_(read_block(loaded, 0, start, rows))


class ParallelLMHead(LMHead):
    """Logits for this rank's vocabulary block, gathered from every rank (rank order, the
    padding cut off): each rank ends with the whole [tokens, vocab]."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        self.group = building_group()
        self.vocab_size = vocab_size
        self.vocab_start, rows = _vocab_block(vocab_size, self.group)
        super().__init__(rows, hidden_size, dtype, tied_to=tied_to)
        if tied_to is None:
            self.weight.weight_loader = self._load
            self.weight.reads_slices = True

    def _load(self, param: nn.Parameter, loaded, shard: str | None) -> None:
        load_vocab_block(param, loaded, self.vocab_size, self.vocab_start)

    def forward(self, h: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        logits = super().forward(h, rows)
        if self.group is None:
            return logits
        return self.group.all_gather_last(logits)[..., : self.vocab_size]


def qkv_shards(
    num_heads: int, num_kv_heads: int, head_dim: int, group: TPGroup | None
) -> tuple[HeadShard, dict[str, tuple[int, int, int]]]:
    """The heads this rank holds and the fused QKV projection's `ColumnParallelLinear` shards."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    hs = head_shard(num_heads, num_kv_heads, rank, size)
    d = head_dim
    kv = (num_kv_heads * d, hs.kv_start * d, hs.num_kv_heads * d)
    return hs, {"q": (num_heads * d, hs.q_start * d, hs.num_heads * d), "k": kv, "v": kv}


def column_shards(
    sizes: dict[str | None, int], group: TPGroup | None, what: str
) -> dict[str | None, tuple[int, int, int]]:
    """Each of `sizes`' shards split evenly by output rows (a fused gate-up's columns)."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    out = {}
    for name, total in sizes.items():
        start, n = even_block(total, rank, size, what)
        out[name] = (total, start, n)
    return out
