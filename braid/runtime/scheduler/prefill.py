"""The prefill planner: which requests an extend step computes, and how much of each.

One extend holds, within the prefill budget: the jump-forward tokens of running requests (their
KV), the next chunk of a prompt between chunks, and newly admitted requests in policy order
(also after a prompt's last chunk, in the budget it leaves). A request is admitted when its
table row, its first chunk and the decode reserve of everything running fit in free and
evictable pages (a request admitted alone needs no reserve); admission stops at the first that
does not fit. Under the program policies the requests of one program call (a fork's branches)
fit together or wait together while anything else runs (`_gang_fits`). With chunked prefill, a
long prompt runs in page-aligned chunks, one prompt at a time. With `whole_prompts`
(EngineConfig.avoid_partial_chunks) a later prompt that would fit whole in a step of prompts of
its own, but not in what this step leaves, waits for the next step instead of being cut (a
partial chunk delays its request's first token by a step, and the rest's attention reads the
part before it again); it is held back once only (a policy without aging, lpm, could pass it
over for ever), and a step's first prompt, or one longer than the budget, is cut as before.

Session pins are the KV that goes first after the unpinned cache (`_pins_give_way`): they give
way, the soonest to expire first and one at a time, to the first request in policy order when
releasing them can make it fit (a pin never keeps the queue's head waiting: under a queue, pins
that held half the pool for paused programs had halved what ran), and, when nothing runs and
nothing else is in the step, to the next chunk of the prompt between chunks (else nothing would
free the room, and the scheduler would stall). Under program-srpt a pin gives way to the queue's
head only if its program is predicted to need more work yet than the head's
(`SchedulePolicy.pins_kept_from`, by srpt's aged key): srpt would serve the other first, and
evicting its context would have it computed again when its call comes back; when nothing else
would free the room, kept pins give way too, after the others.

Program admission (program-srpt while programs hold pins): a request that would start a
program waits while as many programs are under way as the pool holds at their peak
(`ProgramTable.program_cap`, from the ended programs' KV), unless nothing else runs or
srpt's aging has put its key below 0; the calls of programs under way are admitted as
before. More programs under way than the pool holds only push each other's contexts out, to
be computed again when they come back (on the CPU's agent traffic, at 64 rows, lpm computed
twice the prefill it did at 8).

With `mix_decode` (EngineConfig.enable_mixed_chunk, as SGLang's mixed chunks), an extend that
has prefill work also carries one decode row per running request (its last sampled token, at
the end of the batch), when the running requests take less than half the budget: their decode
rides on the prefill's weight reads instead of a step of its own. Their tokens come out of the
budget first; a row whose page cannot be made free (without retracting anyone) is left for the
decode step that follows.
"""

from __future__ import annotations

import torch

from braid.runtime.constrained.manager import GrammarManager
from braid.runtime.scheduler.batch import StepPlan, build_extend
from braid.runtime.scheduler.decode import DecodePlanner
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.policy import (
    Candidate,
    SchedulePolicy,
    call_key,
    candidates,
    gangs_of,
    match_limit,
    shares_uncached_prefix,
)
from braid.runtime.scheduler.request import Req, ReqStatus, RequestTable
from braid.runtime.scheduler.stats import SchedulerStats


class PrefillPlanner:
    def __init__(
        self,
        reqs: RequestTable,
        kv: KVManager,
        decode: DecodePlanner,
        grammars: GrammarManager,
        stats: SchedulerStats,
        device: torch.device,
        *,
        budget: int,
        chunked: bool,
        policy: SchedulePolicy,
        max_running: int,
        mix_decode: bool = False,
        whole_prompts: bool = True,
    ) -> None:
        self.reqs = reqs
        self.kv = kv
        self.decode = decode
        self.grammars = grammars
        self.stats = stats
        self.device = device
        self.budget = budget
        self.chunked = chunked
        self.policy = policy
        self.max_running = max_running
        self.mix_decode = mix_decode
        self.whole_prompts = whole_prompts
        self.page_size = kv.page_size

    def plan(self) -> StepPlan | None:
        items = self._jumped_items()
        budget = self.budget - sum(end - r.kv_len for r, end in items)
        running = self.reqs.view(ReqStatus.RUNNING) if self.mix_decode else []
        if len(running) * 2 >= budget:
            running = []  # decode rows would crowd the prefill out: a decode step of their own
        budget -= len(running)
        whole = budget  # what a step of prompts has: a prompt this long is not cut (_admit)
        prefilling = self.reqs.first(ReqStatus.PREFILLING)
        if prefilling is not None:
            req = prefilling
            end = self._chunk_end(req.kv_len, req, budget)
            grow = self.kv.pages_to_grow(req, end)
            if self.kv.make_room(grow, release_pins=self._pins_give_way(end, items)):
                self.kv.grow(req, grow)
                items.append((req, end))
                budget -= end - req.kv_len
                if end == req.seq_len and self.reqs.count(ReqStatus.WAITING):
                    self._admit(items, budget, whole)  # the last chunk leaves room for more
            elif not items:
                return None  # wait for running requests to finish and free pages
        elif self.reqs.count(ReqStatus.WAITING):
            self._admit(items, budget, whole)
        if not items:
            return None
        for req, end in items:
            self.stats.prefill_tokens_computed += end - req.kv_len
            if self.reqs.programs is not None:
                self.reqs.programs.serve(req, req.kv_len, end)
        self.stats.prefill_steps += 1
        rows = self._decode_rows(running)
        if rows:
            self.decode.count_step([r for r, _ in rows])
            self.stats.mixed_steps += 1
            self.stats.mixed_decode_rows += len(rows)
        return build_extend(items + rows, self.kv.allocator, self.kv.table, self.device, len(rows))

    def _decode_rows(self, running: list[Req]) -> list[tuple[Req, int]]:
        """One extend row per running request: the KV of its last sampled token, and the
        next sample. Stops at the first whose page cannot be made free by evicting cache
        (it and those after it decode in the next step)."""
        rows = []
        for req in running:
            if req.kv_len != req.seq_len - 1 or req.unverified:
                continue  # (neither happens to a running request between steps)
            grow = self.kv.pages_to_grow(req, req.seq_len)
            if grow and not self.kv.make_room(grow):
                break
            self.kv.grow(req, grow)
            rows.append((req, req.seq_len))
        return rows

    def _admit(self, items: list[tuple[Req, int]], budget: int, whole: int) -> None:
        """Admit waiting requests into `items` in policy order while they fit, in `budget`
        new tokens; `whole`: the step's budget before any prompt's (a prompt of at most
        that many tokens is held back once rather than cut behind another)."""
        waiting = self.reqs.view(ReqStatus.WAITING)
        running = self.reqs.view(ReqStatus.RUNNING)
        policy = self.policy.for_queue(len(waiting))
        admitted = []
        ordered = candidates(waiting, self.kv.cache, policy, self.reqs.programs, self.reqs.clock())
        gate = self._program_gate()
        gangs = gangs_of(ordered) if policy.by_program else {}
        heads: set[str] = set()  # the head gang's requests (admitted first this step)
        for cand in ordered:
            if len(running) + len(items) >= self.max_running:
                break
            if self.kv.table.free_slots == 0 or budget <= 0:
                break
            if policy.defers_sharers and shares_uncached_prefix(cand, admitted):
                continue
            if self._waits_to_start(cand, gate, busy=bool(items or running)):
                continue
            gang = gangs.pop(call_key(cand.req), None)
            if gang is not None:
                if not self._gang_fits(gang, running, items, head=not admitted):
                    break  # the call's requests wait together, as one request that does not fit
                if not admitted:  # the pins give way to each of them, as to the head
                    heads = {c.req.rid for c in gang}
            req = cand.req
            # Match again: making room for earlier admissions may have evicted pages.
            match = None
            if cand.use_cache:
                match = self.kv.cache.match_prefix(req.cache_tokens(match_limit(req)))
            prefix_pages = match.pages if match is not None else []
            start = len(prefix_pages) * self.page_size
            end = req.seq_len
            if end - start > budget:
                if (
                    self.whole_prompts
                    and not req.held_whole
                    and end - start <= whole
                    and self._has_prompt(items)
                ):
                    req.held_whole = True  # once: a policy without aging could pass it for ever
                    break  # it fits whole in a step of its own: not cut into a partial chunk
                # Prompt logprobs need every prompt position in one forward: never chunked.
                if self.chunked and req.params.prompt_logprobs is None:
                    end = self._chunk_end(start, req, budget)
                    if end < req.seq_len and req.unverified:
                        # Earlier chunks give no logits to verify the jump: undo it.
                        assert req.kv_len <= req.prompt_len + req.verified
                        self.grammars.unjump(req)
                        end = self._chunk_end(start, req, budget)
                elif items:
                    break  # next step; a long prompt runs alone when chunking is off
            # Lock the match first so evicting to make room cannot take it.
            if match is not None:
                self.kv.cache.lock(match.node)
            grow = self.kv.allocator.pages_for(end) - len(prefix_pages)
            decoding = running + [r for r, _ in items] + [req]
            fits = self.fits(grow, decoding)
            keep = None if fits else self._pins_kept_from(cand)
            # The pinned paths are walked only for a head that does not fit without them.
            head = (
                not fits
                and (not admitted or req.rid in heads)
                and self.fits(grow, decoding, self.kv.sessions.releasable_pages(keep))
            )
            idle = not (items or running)  # nothing else would free the room
            while not fits and self._pins_give_way(end, items, head):
                # The pins that give way to it first; when idle, the kept ones too.
                sessions = self.kv.sessions
                if not (sessions.release_soonest(keep) or idle and sessions.release_soonest()):
                    break
                fits = self.fits(grow, decoding)
            if not fits or not self.kv.make_room(grow):
                if match is not None:
                    self.kv.cache.unlock(match.node)
                break
            started = self.reqs.programs is not None and self.reqs.programs.admitted(req, start)
            if gate is not None and started:
                gate[0] += 1  # one more program under way
            self.kv.admit(req, match.node if match else None, prefix_pages)
            self.kv.grow(req, grow)
            self.reqs.move(req, ReqStatus.PREFILLING)
            items.append((req, end))
            admitted.append(cand)
            budget -= end - req.kv_len
            if end < req.seq_len:
                self.stats.chunked_prompts += 1
                break  # one prompt between chunks at a time

    @staticmethod
    def _has_prompt(items: list[tuple[Req, int]]) -> bool:
        """Whether the step holds a prompt (not only jump-forward tokens of running ones)."""
        return any(r.status is ReqStatus.PREFILLING for r, _ in items)

    def _gang_fits(
        self, gang: list[Candidate], running: list[Req], items: list, head: bool
    ) -> bool:
        """Whether a call's waiting requests (a fork's branches, a select's choices: the
        program goes on only once all are done) may go in together: each prompt's uncached
        pages (its cached prefix locked meanwhile: it is not room for itself), table rows and
        the decode reserve of all of them fit beside what runs and is admitted, with the room
        of the pins that would give way to them at the `head` of the order, or nothing else
        runs (else nothing would free the room; they then go in as far as they fit). A shared
        prefix the cache does not hold yet is counted once per request. The prefill budget,
        or a shared prefix computed by the first of them, may still split their prefill over
        consecutive steps."""
        admitted = [r for r, _ in items]
        if not (running or admitted):
            return True
        if len(running) + len(admitted) + len(gang) > self.max_running:
            return False
        if self.kv.table.free_slots < len(gang):
            return False
        cache, alloc = self.kv.cache, self.kv.allocator
        matches = [
            cache.match_prefix(c.req.cache_tokens(match_limit(c.req))) if c.use_cache else None
            for c in gang
        ]
        grow = 0
        for c, m in zip(gang, matches):
            grow += alloc.pages_for(c.req.seq_len) - (len(m.pages) if m else 0)
            if m is not None:
                cache.lock(m.node)
        try:
            decoding = running + admitted + [c.req for c in gang]
            if self.fits(grow, decoding):
                return True
            if not head:
                return False
            keep = self._pins_kept_from(gang[0])
            return self.fits(grow, decoding, self.kv.sessions.releasable_pages(keep))
        finally:
            for m in matches:
                if m is not None:
                    cache.unlock(m.node)

    def _program_gate(self) -> list[int] | None:
        """The policy's program admission (`SchedulePolicy.program_gate`): [programs under
        way, how many may be], or None (no gate)."""
        return self.policy.program_gate(
            self.reqs.programs, self.kv.sessions, self.kv.allocator.capacity_tokens
        )

    def _waits_to_start(self, cand: Candidate, gate: list[int] | None, busy: bool) -> bool:
        """Whether `cand` waits for a program under way to end before it starts its own: the
        gate is full and the policy holds it back (`holds_start`), unless nothing else runs
        (`busy` false: it would not wait for anything)."""
        if gate is None or not busy or gate[0] < gate[1]:
            return False
        return self.policy.holds_start(cand, self.reqs.programs, self.reqs.clock())

    def _pins_kept_from(self, cand: Candidate):
        """The pins that do not give way to `cand` (`SchedulePolicy.pins_kept_from`): a
        predicate on a pin's program, or None (every pin may give way)."""
        return self.policy.pins_kept_from(cand, self.reqs.programs, self.reqs.clock())

    def _pins_give_way(self, end: int, items: list[tuple[Req, int]], head: bool = False) -> bool:
        """Whether session pins may be released (the soonest to expire first, one at a time
        until it fits) for a request that does not fit with its KV up to `end` (a waiting
        request's first chunk, or a prompt's next chunk). `head`: the request is the first in
        policy order this step and would fit were every pin released (`releasable_pages`: a
        pin on a running request's prefix frees nothing); pins then give way
        (after the unpinned cache, before anyone waits for them). Otherwise only when nothing
        runs and nothing else is in this step, so nothing else would ever free the room (the
        scheduler would stall); then the request and the pins hold all KV, so it fits once
        enough pins are gone. Never for a request longer than the pool (admission refuses
        longer prompts: the context length is capped at the pool's size)."""
        if self.kv.allocator.pages_for(end) > self.kv.allocator.capacity_pages:
            return False
        return head or not (items or self.reqs.count(ReqStatus.RUNNING))

    def _jumped_items(self) -> list[tuple[Req, int]]:
        """Extend items computing the KV of jump-forward tokens; a request that cannot get the
        pages for them is retracted (it resumes later, output kept)."""
        items = []
        for req in self.reqs.view(ReqStatus.JUMPED):
            grow = self.kv.pages_to_grow(req, req.seq_len)
            if self.kv.make_room(grow, release_pins=True):
                self.kv.grow(req, grow)
                items.append((req, req.seq_len))
            else:
                self.decode.retract(req)
        return items

    def _chunk_end(self, start: int, req: Req, budget: int) -> int:
        """Where a prefill starting at `start` stops within `budget` tokens: the whole rest,
        or a chunk ending on a page boundary (so the next chunk starts on a fresh page)."""
        if req.seq_len - start <= budget:
            return req.seq_len
        aligned = (start + budget) // self.page_size * self.page_size
        return aligned if aligned > start else min(req.seq_len, start + self.page_size)

    def admits_now(self) -> bool:
        """Whether a prefill step now would admit a waiting request: the first in policy
        order, the one `plan` tries first (it stops at the first that does not fit), with its
        cached prefix and, when chunking, only its first chunk, in the room the pins would
        give. Under a backlog that must wait for KV, decode steps keep running ahead."""
        waiting = self.reqs.view(ReqStatus.WAITING)
        running = self.reqs.view(ReqStatus.RUNNING)
        if not waiting or len(running) >= self.max_running:
            return False
        if self.kv.table.free_slots == 0:
            return False
        policy = self.policy.for_queue(len(waiting))
        # A policy that looks nothing up and keeps arrival order: the head is the first
        # candidate.
        alone = policy.keeps_arrival_order and not policy.looks_up_prefixes
        considered = [waiting[0]] if alone else waiting
        programs, now = self.reqs.programs, self.reqs.clock()
        gate = self._program_gate()
        ordered = candidates(considered, self.kv.cache, policy, programs, now)
        cand = next((c for c in ordered if not self._waits_to_start(c, gate, bool(running))), None)
        if cand is None:
            return False
        req = cand.req
        gang = gangs_of(ordered).get(call_key(req)) if policy.by_program else None
        if gang is not None and not self._gang_fits(gang, running, [], head=True):
            return False
        cached, match = 0, None
        if cand.use_cache:
            match = self.kv.cache.match_prefix(req.cache_tokens(match_limit(req)))
            cached = len(match.pages)
        start = cached * self.page_size
        end = req.seq_len
        chunks = self.chunked and req.params.prompt_logprobs is None
        if end - start > self.budget and chunks:
            end = self._chunk_end(start, req, self.budget)
        grow = self.kv.allocator.pages_for(end) - cached
        decoding = running + [req]
        # Locked as `_admit` locks it: the head's cached prefix is not room for the head.
        if match is not None:
            self.kv.cache.lock(match.node)
        try:
            # Failing that, the head would take the room of the pins that give way to it.
            if self.fits(grow, decoding):
                return True
            keep = self._pins_kept_from(cand)
            return self.fits(grow, decoding, self.kv.sessions.releasable_pages(keep))
        finally:
            if match is not None:
                self.kv.cache.unlock(match.node)

    def fits(self, grow: int, decoding: list[Req], pinned: int = 0) -> bool:
        """Whether `grow` new pages fit in free and evictable pages (and `pinned` pages that
        releasing session pins would make evictable) with the decode reserve of `decoding`
        (the running requests plus those being admitted); a request admitted alone needs no
        reserve."""
        room = self.kv.room + pinned
        reserve = self.decode.reserve(decoding)
        return grow + reserve <= room or (len(decoding) == 1 and grow <= room)
