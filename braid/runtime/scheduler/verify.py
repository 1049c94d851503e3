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
from braid.runtime.scheduler.batch import StepPlan
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.request import Req
from braid.runtime.speculative.base import Proposer
from braid.runtime.speculative.rows import row_batch


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
    past its `max_tokens` or the context, cut at the first id outside the vocabulary, and
    dropped when their KV pages cannot be made free."""

    def __init__(
        self,
        proposer: Proposer,
        steps: int,
        kv: KVManager,
        context_length: int,
        vocab_size: int,
    ) -> None:
        self.proposer = proposer
        self.steps = steps
        self.kv = kv
        self.context_length = context_length
        self.vocab_size = vocab_size

    def limit(self, req: Req) -> int:
        """The most drafts `req` may verify this step: none while its grammar waits for the end
        of thinking (the grammar would start mid-draft), or with jump-forward tokens pending."""
        if req.waiting_grammar is not None or req.unverified:
            return 0
        room = min(req.remaining_new_tokens, self.context_length - req.seq_len) - 1
        return max(0, min(self.steps, room))

    def _valid(self, drafts: list[int]) -> list[int]:
        for i, t in enumerate(drafts):
            if not 0 <= t < self.vocab_size:
                return drafts[:i]
        return drafts

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Drafts for `reqs` (which already have room for one token each); none for any when
        the pages of as many drafts as each may take cannot be made free. Those pages are
        the requests' before the proposer runs (a proposer may write its own KV at the
        positions the drafts will take), and whatever the drafts do not use is freed after
        the verify step."""
        none: list[list[int]] = [[] for _ in reqs]
        limits = [self.limit(r) for r in reqs]
        if not any(limits):
            return none
        pages_for = self.kv.allocator.pages_for
        need = [max(0, pages_for(r.kv_len + 1 + k) - len(r.pages)) for r, k in zip(reqs, limits)]
        if not self.kv.make_room(sum(need)):
            return none
        for r, n in zip(reqs, need):
            if n:
                self.kv.grow(r, n)
        return [self._valid(d[:k]) for d, k in zip(self.proposer.propose(reqs, limits), limits)]


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
    tokens = [[r.output_ids[-1], *d] for r, d in zip(reqs, drafts)]
    batch = row_batch(reqs, tokens, allocator, table, device, [r.rope_delta for r in reqs])
    first_rows, inputs = [], []
    for r, d in zip(reqs, drafts):
        first_rows.append(len(inputs))
        inputs += [r.sampling.after(d[:j]) for j in range(len(d) + 1)]
    return VerifyPlan(
        reqs=list(reqs),
        sampling=list(reqs),
        batch=batch,
        last_rows=[f + len(d) for f, d in zip(first_rows, drafts)],
        prompt_rows={},
        ends=[r.kv_len + 1 + len(d) for r, d in zip(reqs, drafts)],
        drafts=drafts,
        first_rows=first_rows,
        inputs=inputs,
    )
