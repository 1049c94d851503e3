"""Building the `ForwardBatch` of one step: assigning KV slots to new tokens and laying out the
tensors of a prefill (extend) or decode batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from braid.runtime.cache.memory_pool import PageAllocator, ReqToTokenPool, assign_slots
from braid.runtime.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ImageSlice,
    packed_to_device,
    to_device,
)
from braid.runtime.scheduler.request import Req


@dataclass
class StepPlan:
    """A forward batch; `reqs` are the requests in it and `sampling` those among them that
    sample a token this step (a chunk that does not finish its prompt samples nothing).
    `last_rows[i]` is the logits row of `sampling[i]`'s last token; in an extend, the
    `sampling[i].unverified` rows before it score its unverified jump-forward tokens (the row
    before each token predicts it). `prompt_rows` maps an index of `sampling` to the logits
    rows covering its whole prompt (prompt logprobs). `ends[i]`: how many tokens of `reqs[i]`
    have KV once the forward has run (the host's copy of `batch.seq_lens`). `pooling`: the
    embedding requests in an extend, each with the batch rows of its tokens (first, count); the
    forward must capture its hidden states for them. `decode_rows`: in a mixed extend, the
    last this many of `reqs` are running requests decoding one token (their KV is not cached
    anew after the step)."""

    reqs: list[Req]
    sampling: list[Req]
    batch: ForwardBatch
    last_rows: list[int]
    prompt_rows: dict[int, tuple[int, int]]
    ends: list[int]
    pooling: list[tuple[Req, int, int]] = field(default_factory=list, kw_only=True)
    decode_rows: int = field(default=0, kw_only=True)

    @property
    def prefilled(self) -> list[Req]:
        """`reqs` but a mixed extend's decode rows."""
        return self.reqs[: len(self.reqs) - self.decode_rows]


def build_extend(
    items: list[tuple[Req, int]],
    allocator: PageAllocator,
    table: ReqToTokenPool,
    device: torch.device,
    decode_rows: int = 0,
) -> StepPlan:
    """A prefill batch: each request computes KV for positions [req.kv_len, end). Requests
    whose `end` is their full length sample their next token. The last `decode_rows` items
    are running requests decoding one token (a mixed step: `ForwardBatch.decode_tail`)."""
    ids: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    prefix_lens, extend_lens, last_rows = [], [], []
    logits_rows: list[int] = []
    prompt_rows: dict[int, tuple[int, int]] = {}
    sampling: list[Req] = []
    images: list[ImageSlice] = []
    pooling: list[tuple[Req, int, int]] = []
    for r, end in items:
        start = r.kv_len
        locs += assign_slots(r, end, allocator)  # the table is written from the copy below
        base = len(ids)
        seq = r.tokens(end)
        ids += seq[start:end]
        positions += range(start, end)
        for image, offset in zip(r.images, r.image_offsets):
            lo, hi = max(offset, start), min(offset + image.num_tokens, end)
            if lo < hi:
                images.append(ImageSlice(image, base + lo - start, lo - offset, hi - lo))
        prefix_lens.append(start)
        extend_lens.append(end - start)
        if r.embed is not None:
            pooling.append((r, base, end - start))  # pooled, never sampled: no logits
            continue
        if end < r.seq_len:
            continue  # a chunk: no logits
        if r.params.prompt_logprobs is not None and not r.prompt_logprobs_sent:
            # Rows for positions start..end-1 (start <= logprob_start_len - 1: see match_limit).
            prompt_rows[len(sampling)] = (len(logits_rows), len(logits_rows) + end - start)
            logits_rows += range(base, base + end - start)
        else:
            first = end - 1 - r.unverified
            assert first >= start, "the rows verifying jump-forward tokens must be computed"
            logits_rows += range(base + first - start, base + end - start)
        last_rows.append(len(logits_rows) - 1)
        sampling.append(r)
    reqs = [r for r, _ in items]
    ends = [end for _, end in items]
    rows = [r.pool_row for r in reqs]
    ids_t, pos_t, locs_t, rows_t, ends_t, logits_t = packed_to_device(
        [ids, positions, locs, rows, ends, logits_rows], device
    )
    table.write_runs(rows, prefix_lens, extend_lens, locs, locs_t)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids_t,
        positions=pos_t,
        out_cache_loc=locs_t,
        req_pool_indices=rows_t,
        seq_lens=ends_t,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        logits_indices=logits_t,
        images=images,
        mrope_positions=_mrope_positions(items, device),
        capture_hidden=bool(pooling),
        decode_tail=decode_rows,
        host={  # what tensor parallelism sends the other ranks, without reading them back
            "input_ids": ids,
            "positions": positions,
            "out_cache_loc": locs,
            "req_pool_indices": rows,
            "seq_lens": ends,
            "logits_indices": logits_rows,
        },
    )
    return StepPlan(
        reqs,
        sampling,
        batch,
        last_rows,
        prompt_rows,
        ends,
        pooling=pooling,
        decode_rows=decode_rows,
    )


def _mrope_positions(items: list[tuple[Req, int]], device: torch.device) -> torch.Tensor | None:
    """The [3, tokens] M-RoPE positions of an extend in which some request has images (None if
    none has): a prompt's own positions, then p + delta for every later token; requests
    without images have the 1-D positions in all three rows."""
    if all(r.rope_positions is None for r, _ in items):
        return None
    parts = []
    for r, end in items:
        start = r.kv_len
        if r.rope_positions is None:
            parts.append(torch.arange(start, end).expand(3, -1))
            continue
        in_prompt = r.rope_positions[:, start : min(end, r.prompt_len)]
        after = torch.arange(max(start, r.prompt_len), max(end, r.prompt_len)) + r.rope_delta
        parts += [in_prompt, after.expand(3, -1)]
    return torch.cat(parts, dim=1).to(device)


def build_decode(
    reqs: list[Req],
    allocator: PageAllocator,
    table: ReqToTokenPool,
    device: torch.device,
    input_ids: torch.Tensor | None = None,
) -> StepPlan:
    """A decode batch: each request computes the KV of its last token (at position
    `req.kv_len`) and samples the next. `input_ids`, when given, are those last tokens already
    on the device (the previous step's samples, not yet read back); else each request's last
    output token."""
    ps = allocator.page_size
    rows, positions, locs, deltas = [], [], [], []
    for r in reqs:
        pos = r.kv_len  # the last sampled token, whose KV is written now
        if pos // ps >= len(r.pages):
            pages = allocator.alloc(1)
            assert pages is not None, "no free KV pages: the scheduler must make room first"
            r.pages.extend(pages)
        rows.append(r.pool_row)
        positions.append(pos)
        locs.append(r.pages[pos // ps] * ps + pos % ps)
        deltas.append(r.rope_delta)
    # One copy to the device for the vectors (M-RoPE deltas only when some request has one).
    n = len(reqs)
    shifted = any(deltas)
    vectors = packed_to_device([rows, positions, locs] + ([deltas] if shifted else []), device)
    rows_t, pos_t, locs_t = vectors[:3]
    rope_t = pos_t + vectors[3] if shifted else pos_t
    table.write_at(rows, positions, locs, on_device=(rows_t, pos_t, locs_t))
    ends, last_rows = [p + 1 for p in positions], list(range(n))
    host = {
        "out_cache_loc": locs,
        "req_pool_indices": rows,
        "seq_lens": ends,
        "logits_indices": last_rows,
    }
    if not shifted:
        host["positions"] = positions
    if input_ids is None:
        host["input_ids"] = [r.output_ids[-1] for r in reqs]
        input_ids = to_device(host["input_ids"], device)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids,
        positions=rope_t,
        out_cache_loc=locs_t,
        req_pool_indices=rows_t,
        seq_lens=pos_t + 1,
        prefix_lens=positions,
        extend_lens=[1] * n,
        logits_indices=torch.arange(n, device=device),
        host=host,
    )
    return StepPlan(reqs, reqs, batch, last_rows, {}, ends)
