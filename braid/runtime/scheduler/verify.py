"""Speculative decode steps: asking the proposer for drafts, making room for their KV, and
laying out the verify forward (a decode batch with one row per token a request verifies; see
`braid.runtime.speculative.base` for why that is exact).

Speculative steps are read back before the next step is planned: the next drafts depend on
which of these are kept, so the overlap schedule does not run ahead while speculation is on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from braid.runtime.cache.memory_pool import PageAllocator, ReqToTokenPool
from braid.runtime.executor.sampler import SamplingInput
from braid.runtime.forward_batch import ForwardBatch, ForwardMode, packed_to_device
from braid.runtime.scheduler.batch import StepPlan
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.request import Req
from braid.runtime.speculative.base import Proposer
from braid.runtime.speculative.rows import row_batch
from braid.runtime.speculative.tree import DraftTree


@dataclass
class VerifyPlan(StepPlan):
    """A decode step in which requests verify drafts. `drafts[i]` are `reqs[i]`'s (maybe none):
    the row of its last token is `first_rows[i]`, that of its draft node n is
    `first_rows[i] + 1 + n`, and each row is sampled with its `inputs` entry (the output so far
    plus the tokens of the node's branch). `roots[i]`: the position of its last token. A chain's
    nodes take the positions after it (their KV at those positions' slots); a tree's take the
    slots `tree_slots[i]` (pages `tree_pages[i]`, freed after the step) and the verify step
    moves the KV of the branch it keeps to the positions' slots."""

    drafts: list[DraftTree]
    first_rows: list[int]
    inputs: list[SamplingInput]
    roots: list[int]
    tree_slots: list[list[int]]
    tree_pages: list[list[int]]
    kept_rows: list[list[int]] = field(default_factory=list)  # filled when processed


class Drafter:
    """Asks `proposer` for each running request's drafts: a chain of at most `steps` tokens, or
    a tree (`proposer.tree_nodes` > 0) of at most that many nodes and `steps` deep, never past
    the request's `max_tokens` or the context, without tokens outside the vocabulary; no
    drafts at all when their KV pages cannot be made free."""

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
        """How deep `req`'s drafts may go this step: not at all while its grammar waits for the
        end of thinking (the grammar would start mid-draft), or with jump-forward tokens
        pending."""
        if req.waiting_grammar is not None or req.unverified:
            return 0
        room = min(req.remaining_new_tokens, self.context_length - req.seq_len) - 1
        return max(0, min(self.steps, room))

    def drafts(self, reqs: list[Req]) -> list[DraftTree]:
        """Drafts for `reqs` (which already have room for one token each). The pages of the
        positions the drafts may take are the requests' before the proposer runs (a proposer
        may write its own KV there), and whatever the drafts do not use is freed after the
        verify step; room is also made for a tree's own pages."""
        none = [DraftTree.chain(()) for _ in reqs]
        limits = [self.limit(r) for r in reqs]
        if not any(limits):
            return none
        pages_for = self.kv.allocator.pages_for
        need = [max(0, pages_for(r.kv_len + 1 + k) - len(r.pages)) for r, k in zip(reqs, limits)]
        nodes, scratch = self.proposer.tree_nodes, self.proposer.scratch_nodes
        per_tree = (pages_for(nodes) if nodes else 0) + (pages_for(scratch) if scratch else 0)
        trees = per_tree * sum(1 for k in limits if k)
        if not self.kv.make_room(sum(need) + trees):
            return none
        for r, n in zip(reqs, need):
            if n:
                self.kv.grow(r, n)
        out = []
        for d, k in zip(self.proposer.propose(reqs, limits), limits):
            tree = d if isinstance(d, DraftTree) else DraftTree.chain(d)
            out.append(tree.clip(k, nodes if nodes and not tree.is_chain else k, self.vocab_size))
        return out


def build_verify(
    reqs: list[Req],
    drafts: list[DraftTree],
    allocator: PageAllocator,
    table: ReqToTokenPool,
    device: torch.device,
) -> VerifyPlan:
    """The verify forward of `reqs`: request i's rows compute the KV of its last token and of
    its draft nodes, each row seeing the positions up to its last token and then its branch.
    A chain's nodes sit at the positions after the last token; a tree's at pages of its own
    (the caller made room for both)."""
    first_rows, inputs, roots = [], [], []
    for r, d in zip(reqs, drafts):
        first_rows.append(len(inputs))
        roots.append(r.kv_len)
        inputs.append(r.sampling)
        inputs += [r.sampling.after([d.tokens[a] for a in d.path(n)]) for n in range(len(d))]
    common = dict(
        reqs=list(reqs),
        sampling=list(reqs),
        last_rows=[f + len(d) for f, d in zip(first_rows, drafts)],
        prompt_rows={},
        drafts=drafts,
        first_rows=first_rows,
        inputs=inputs,
        roots=roots,
    )
    if all(d.is_chain for d in drafts):
        tokens = [[r.output_ids[-1], *d.tokens] for r, d in zip(reqs, drafts)]
        batch = row_batch(reqs, tokens, allocator, table, device, [r.rope_delta for r in reqs])
        batch.head_rows = len(reqs)
        ends = [r.kv_len + 1 + len(d) for r, d in zip(reqs, drafts)]
        none: list[list[int]] = [[] for _ in reqs]
        return VerifyPlan(batch=batch, ends=ends, tree_slots=none, tree_pages=none, **common)
    return _tree_plan(reqs, drafts, allocator, table, device, common)


def _tree_plan(reqs, drafts, allocator, table, device, common) -> VerifyPlan:
    """`build_verify` for a batch with a tree: every row reads its table row up to its
    request's last token (its prefix), then its tail (a node's branch, in the tree's slots)."""
    ps = allocator.page_size
    depth = max(d.max_depth for d in drafts)
    pool_rows, positions, rope, locs, ids, prefix, tails = [], [], [], [], [], [], []
    tree_slots, tree_pages, ends = [], [], []
    for r, d in zip(reqs, drafts):
        p = r.kv_len
        root_slot = r.pages[p // ps] * ps + p % ps
        table.write(r.pool_row, p, [root_slot])
        if d.is_chain:  # positional, as `row_batch` lays it out
            slots = [r.pages[q // ps] * ps + q % ps for q in range(p + 1, p + 1 + len(d))]
            if slots:
                table.write(r.pool_row, p + 1, slots)
            pages: list[int] = []
            row_prefix = [p + 1 + n for n in range(len(d) + 1)]
            row_tails = [[] for _ in range(len(d) + 1)]
        else:
            pages = allocator.alloc(allocator.pages_for(len(d)))
            assert pages is not None, "no free KV pages: the drafter must make room first"
            slots = [pages[n // ps] * ps + n % ps for n in range(len(d))]
            row_prefix = [p + 1] * (len(d) + 1)
            row_tails = [[]] + [[slots[a] for a in d.path(n)] for n in range(len(d))]
        tree_pages.append(pages)
        tree_slots.append(slots if not d.is_chain else [])
        ends.append(p + 1 + (len(d) if d.is_chain else 0))
        for n in range(-1, len(d)):
            dep = 0 if n < 0 else d.depths[n]
            pool_rows.append(r.pool_row)
            positions.append(p + dep)
            rope.append(p + dep + r.rope_delta)
            locs.append(root_slot if n < 0 else slots[n])
            ids.append(r.output_ids[-1] if n < 0 else d.tokens[n])
            prefix.append(row_prefix[n + 1])
            tails.append(row_tails[n + 1] + [0] * (depth - len(row_tails[n + 1])))
    k = len(ids)
    rows_t, pos_t, locs_t, rope_t, ids_t, prefix_t, tail = packed_to_device(
        [pool_rows, positions, locs, rope, ids, prefix, [s for t in tails for s in t]], device
    )
    tail = tail.view(k, depth)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=ids_t,
        positions=rope_t,
        out_cache_loc=locs_t,
        req_pool_indices=rows_t,
        seq_lens=pos_t + 1,
        prefix_lens=positions,
        extend_lens=[1] * k,
        logits_indices=torch.arange(k, device=device),
        tree_prefix=prefix_t,
        tree_tail=tail,
        head_rows=len(reqs),
    )
    return VerifyPlan(
        batch=batch, ends=ends, tree_slots=tree_slots, tree_pages=tree_pages, **common
    )
