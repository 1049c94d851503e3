"""How a model's weights split over tensor-parallel ranks: integers only (no torch), so the
front end checks a split (`ModelConfig.check_engine`) before any process starts, and every
rank makes the same one at load (`braid.runtime.layers.parallel`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads) and key/
    value heads [kv_start, kv_start + num_kv_heads) of the model's."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Split the heads over `size` ranks. Query heads divide evenly; key/value heads too when
    there are at least as many as ranks, and otherwise each rank holds (a copy of) the one its
    query heads read (grouped-query attention with more ranks than KV heads). `ValueError`
    for a split that does not come out even."""
    if num_heads % size:
        raise ValueError(
            f"tensor parallelism: num_attention_heads ({num_heads}) is not a multiple of "
            f"tp_size ({size})"
        )
    heads = num_heads // size
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(
                f"tensor parallelism: num_key_value_heads ({num_kv_heads}) is not a multiple "
                f"of tp_size ({size})"
            )
        kv = num_kv_heads // size
        return HeadShard(heads, kv, rank * heads, rank * kv)
    if size % num_kv_heads:
        raise ValueError(
            f"tensor parallelism: tp_size ({size}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads})"
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    return HeadShard(heads, 1, rank * heads, rank * heads // group)


def even_block(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, size) of rank `rank`'s block of `total` split evenly over `size` ranks."""
    if total % size:
        raise ValueError(
            f"tensor parallelism: {what} ({total}) is not a multiple of tp_size ({size})"
        )
    n = total // size
    return rank * n, n
