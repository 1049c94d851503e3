"""Forward batches over a holder's KV (a scheduler request, or a draft model's state of one):
several tokens of one holder as decode rows, each attending to every position up to its own
(the layout of a verify step and of a draft model's catch-up), or as an extend."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from braid.runtime.cache.memory_pool import (
    PageAllocator,
    ReqToTokenPool,
    SlotHolder,
    grow,
    slots_of,
)
from braid.runtime.forward_batch import ForwardBatch, ForwardMode, packed_to_device


def row_batch(
    holders: Sequence[SlotHolder],
    tokens: Sequence[Sequence[int]],
    allocator: PageAllocator,
    table: ReqToTokenPool,
    device: torch.device,
    rope_deltas: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
) -> ForwardBatch:
    """A decode batch with one row per token: `tokens[i]` at positions `starts[i]` (default
    `holders[i].kv_len`) onwards, each row seeing every position up to its own, with a logits
    row each. Grows the holders' pages and records the slots in their table rows; `kv_len` is
    left to the caller."""
    ps = allocator.page_size
    pool_rows, positions, rope, locs, ids = [], [], [], [], []
    for i, (h, toks) in enumerate(zip(holders, tokens)):
        start = h.kv_len if starts is None else starts[i]
        grow(h, start + len(toks), allocator)
        delta = rope_deltas[i] if rope_deltas is not None else 0
        for j, t in enumerate(toks):
            pos = start + j
            pool_rows.append(h.pool_row)
            positions.append(pos)
            rope.append(pos + delta)
            locs.append(h.pages[pos // ps] * ps + pos % ps)
            ids.append(t)
    n = len(ids)
    rows_t, pos_t, locs_t, rope_t, ids_t = packed_to_device(
        [pool_rows, positions, locs, rope, ids], device
    )
    table.write_at(pool_rows, positions, locs, on_device=(rows_t, pos_t, locs_t))
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=ids_t,
        positions=rope_t,
        out_cache_loc=locs_t,
        req_pool_indices=rows_t,
        seq_lens=pos_t + 1,
        prefix_lens=positions,
        extend_lens=[1] * n,
        logits_indices=torch.arange(n, device=device),
    )


def extend_batch(
    holders: Sequence[SlotHolder],
    tokens: Sequence[Sequence[int]],
    allocator: PageAllocator,
    table: ReqToTokenPool,
    device: torch.device,
    starts: Sequence[int] | None = None,
) -> ForwardBatch:
    """An extend of `tokens[i]` at positions `starts[i]` (default each holder's `kv_len`)
    onwards, with the logits of each holder's last token only. Grows pages and records slots
    as `row_batch` does."""
    ps = allocator.page_size
    ids, positions, locs, lasts = [], [], [], []
    begins = [h.kv_len for h in holders] if starts is None else list(starts)
    for h, toks, start in zip(holders, tokens, begins):
        end = start + len(toks)
        grow(h, end, allocator)
        locs += slots_of(h.pages, ps, start, end)
        ids += toks
        positions += range(start, end)
        lasts.append(len(ids) - 1)
    rows = [h.pool_row for h in holders]
    ends = [s + len(t) for s, t in zip(begins, tokens)]
    ids_t, pos_t, locs_t, rows_t, ends_t, lasts_t = packed_to_device(
        [ids, positions, locs, rows, ends, lasts], device
    )
    lens = [len(t) for t in tokens]
    table.write_runs(rows, begins, lens, locs, locs_t)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids_t,
        positions=pos_t,
        out_cache_loc=locs_t,
        req_pool_indices=rows_t,
        seq_lens=ends_t,
        prefix_lens=begins,
        extend_lens=lens,
        logits_indices=lasts_t,
    )
