"""The decode planner: a batch of every running request, retraction when decoding runs out of
pages, and the new-token ratio that admission reserves for future decodes.

Admission is optimistic: it reserves only a fraction (the ratio) of each running request's
remaining tokens, at most RESERVE_CLIP of them. The ratio decays while decoding goes well and
jumps back up after a retraction. When a decode step cannot get the pages it needs anyway,
session pins are released (the soonest to expire first), then a prompt between chunks is
retracted, then the newest running requests (their KV goes to the
prefix cache; they wait again at the head of the queue with their output kept), or those
the schedule policy names (`SchedulePolicy.retract_victim`: under `priority`, the highest
value, a prompt between chunks among them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from braid.runtime.scheduler.batch import StepPlan, build_decode
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.request import Req, ReqStatus, RequestTable
from braid.runtime.scheduler.stats import SchedulerStats
from braid.runtime.scheduler.verify import Drafter, build_verify

logger = logging.getLogger(__name__)
RETRACTION_LOG_S = 10.0

NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096


class DecodePlanner:
    def __init__(
        self,
        reqs: RequestTable,
        kv: KVManager,
        stats: SchedulerStats,
        device: torch.device,
        victim: Callable[[list[Req]], int],
        drafter: Drafter | None = None,
    ) -> None:
        self.reqs = reqs
        self.kv = kv
        self.stats = stats
        self.device = device
        self.drafter = drafter  # speculative decoding: drafts to verify with each step
        # Which running request a step short of pages retracts: the schedule policy's choice.
        self.victim = victim
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._held, self._logged_at = (0, 0), -RETRACTION_LOG_S  # retractions not logged yet

    def plan(self) -> tuple[StepPlan | None, Req | None]:
        """The decode step of every running request, after retracting what must go to make room
        for it (with speculative decoding a `VerifyPlan`, with the drafts whose pages can be
        made free);
        when a lone request cannot grow, no plan and that request (it cannot ever fit: the
        caller fails it)."""
        running = self.reqs.view(ReqStatus.RUNNING)
        retracted: list[Req] = []
        while running:
            need = sum(1 for r in running if r.kv_len % self.kv.page_size == 0)
            # Pinned program KV goes before any running request is retracted.
            if self.kv.make_room(need, release_pins=True):
                break
            # A prompt between chunks is the newest: by default it goes first (its chunks must
            # not starve running decodes).
            prefilling = self.reqs.first(ReqStatus.PREFILLING)
            pool = running + ([prefilling] if prefilling is not None else [])
            if len(pool) == 1:
                return None, running[0]
            i = self.victim(pool)
            retracted.append(pool[i] if i == len(running) else running.pop(i))
            self.retract(retracted[-1])
        if retracted:
            self._log_retractions(retracted)
        if not running:
            return None, None
        self.count_step(running)
        if self.drafter is not None:  # every decode step verifies (maybe no drafts)
            drafts = self.drafter.drafts(running)
            plan = build_verify(running, drafts, self.kv.allocator, self.kv.table, self.device)
            return plan, None
        return build_decode(running, self.kv.allocator, self.kv.table, self.device), None

    def plan_ahead(self, reqs: list[Req], input_ids: torch.Tensor, rows: list[int]) -> StepPlan:
        """The decode step after the one in flight for `reqs`, whose input tokens are that
        step's samples still on the device, its `rows` (the caller made sure the pages are
        free)."""
        self.count_step(reqs)
        plan = build_decode(reqs, self.kv.allocator, self.kv.table, self.device, input_ids)
        plan.batch.sample_rows = rows
        return plan

    def count_step(self, reqs: list[Req]) -> None:
        self.stats.decode_steps += 1
        if self.reqs.programs is not None:
            for r in reqs:
                self.reqs.programs.serve(r, r.kv_len, r.kv_len + 1)
        self.new_token_ratio = max(
            NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def reserve(self, reqs: list[Req]) -> int:
        """Pages to keep for the future decodes of `reqs`."""
        tokens = sum(min(r.remaining_new_tokens, RESERVE_CLIP) for r in reqs)
        return self.kv.allocator.pages_for(int(tokens * self.new_token_ratio))

    def _log_retractions(self, reqs: list[Req]) -> None:
        """One WARNING for a step's retractions (as SGLang logs them), at most one every
        `RETRACTION_LOG_S` seconds: the ones in between are counted into the next."""
        self._held = (self._held[0] + len(reqs), self._held[1] + sum(r.seq_len for r in reqs))
        now = time.monotonic()
        if now - self._logged_at < RETRACTION_LOG_S:
            return
        (n, tokens), self._held, self._logged_at = self._held, (0, 0), now
        logger.warning(
            "KV cache ran short for decoding: %d request(s) of %d tokens retracted to the "
            "queue (their KV cached; %d running)",
            n,
            tokens,
            len(self.reqs.view(ReqStatus.RUNNING)),
        )

    def retract(self, req: Req) -> None:
        """Free an admitted request's KV (into the cache) and queue it again at the head,
        output kept; admit more carefully for a while."""
        self.kv.release(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.reqs.move(req, ReqStatus.WAITING, front=True)
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, NEW_TOKEN_RATIO_INIT) + 0.1)
        logger.debug("retracted %s at %d tokens", req.rid, req.seq_len)
