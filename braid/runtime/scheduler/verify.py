"""Speculative decode steps: asking the proposer for drafts, making room for their KV, and
laying out the verify forward (a decode batch with one row per token a request verifies; see
`braid.runtime.speculative.base` for why that is exact).

Speculative steps are read back before the next step is planned: the next drafts depend on
which of these are kept, so the overlap schedule does not run ahead while speculation is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from braid.runtime.cache.memory_pool import PageAllocator, ReqToTokenPool
from braid.runtime.executor.sampler import SamplingInput
from braid.runtime.forward_batch import ForwardBatch, ForwardMode, to_device
from braid.runtime.scheduler.batch import StepPlan
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.request import Req
from braid.runtime.speculative.base import Proposer


@dataclass
class VerifyPlan(StepPlan):
    """A decode step in which some requests verify drafts. `drafts[i]` are `reqs[i]`'s (maybe
    none); its rows are `first_rows[i]` .. `first_rows[i] + len(drafts[i])`, and row j is
    sampled with `inputs[first_rows[i] + j]` (its output so far plus `drafts[i][:j]`).
    `ends[i]`: how many of its tokens have KV once the forward has run, all drafts included."""

    drafts: list[list[int]]
    first_rows: list[int]
    inputs: list[SamplingInput]


class Drafter:
    """Asks `proposer` for each running request's drafts, at most `steps` a request and never
    past its `max_tokens` or the context, and trims them to the KV pages that can be made
    free."""

    def __init__(self, proposer: Proposer, steps: int, kv: KVManager, context_length: int):
        self.proposer = proposer
        self.steps = steps
        self.kv = kv
        self.context_length = context_length

    def limit(self, req: Req) -> int:
        """The most drafts `req` may verify this step: none while its grammar waits for the end
        of thinking (the grammar would start mid-draft), or with jump-forward tokens pending."""
        if req.waiting_grammar is not None or req.unverified:
            return 0
        room = min(req.remaining_new_tokens, self.context_length - req.seq_len) - 1
        return max(0, min(self.steps, room))

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Drafts for `reqs` (which already have room for one token each); none for any when
        their pages cannot be made free."""
        none: list[list[int]] = [[] for _ in reqs]
        limits = [self.limit(r) for r in reqs]
        if not any(limits):
            return none
        drafts = [d[:k] for d, k in zip(self.proposer.propose(reqs, limits), limits)]
        if not any(drafts):
            return none
        pages_for = self.kv.allocator.pages_for
        need = sum(
            max(0, pages_for(r.kv_len + 1 + len(d)) - len(r.pages)) for r, d in zip(reqs, drafts)
        )
        if not self.kv.make_room(need):
            return none
        return drafts


def build_verify(
    reqs: list[Req],
    drafts: list[list[int]],
    allocator: PageAllocator,
    table: ReqToTokenPool,
    device: torch.device,
) -> VerifyPlan:
    """The verify forward of `reqs`: request i's rows compute the KV of its last token and of
    `drafts[i]` at the positions after it, each row seeing the positions up to its own. The
    caller made sure the pages are free."""
    ps = allocator.page_size
    pool_rows, positions, rope, locs, ids = [], [], [], [], []
    first_rows, ends, inputs = [], [], []
    for r, d in zip(reqs, drafts):
        p = r.kv_len  # the last sampled token's position
        n = 1 + len(d)
        need = allocator.pages_for(p + n) - len(r.pages)
        if need > 0:
            pages = allocator.alloc(need)
            assert pages is not None, "no free KV pages: the drafter must make room first"
            r.pages.extend(pages)
        first_rows.append(len(ids))
        ids += [r.output_ids[-1], *d]
        for j in range(n):
            pos = p + j
            pool_rows.append(r.pool_row)
            positions.append(pos)
            rope.append(pos + r.rope_delta)
            locs.append(r.pages[pos // ps] * ps + pos % ps)
            s = r.sampling
            inputs.append(
                SamplingInput(s.params, s.seed, s.prompt_ids, [*r.output_ids, *d[:j]], s.stop_ids)
            )
        ends.append(p + n)
    n = len(ids)
    packed = to_device(pool_rows + positions + locs + rope + ids, device)
    rows_t, pos_t, locs_t = packed[:n], packed[n : 2 * n], packed[2 * n : 3 * n]
    table.table[rows_t, pos_t] = locs_t
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=packed[4 * n :],
        positions=packed[3 * n : 4 * n],
        out_cache_loc=locs_t,
        req_pool_indices=rows_t,
        seq_lens=pos_t + 1,
        prefix_lens=positions,
        extend_lens=[1] * n,
        logits_indices=torch.arange(n, device=device),
    )
    last_rows = [f + len(d) for f, d in zip(first_rows, drafts)]
    return VerifyPlan(
        reqs=list(reqs),
        sampling=list(reqs),
        batch=batch,
        last_rows=last_rows,
        prompt_rows={},
        ends=ends,
        drafts=drafts,
        first_rows=first_rows,
        inputs=inputs,
    )
