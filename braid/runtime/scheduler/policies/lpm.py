"""`lpm` (longest prefix match first): the waiting queue ordered by how much of each request
the prefix cache already holds (arrival order among equals), so a request whose context is
cached runs before the cache loses it."""

from __future__ import annotations

from braid.runtime.scheduler.policies import POLICIES
from braid.runtime.scheduler.policies.fcfs import FcfsPolicy
from braid.runtime.scheduler.policy import Candidate, SchedulePolicy
from braid.runtime.scheduler.programs import ProgramTable

# Past this many waiting requests, lpm's per-request matching costs more than it saves.
LPM_MAX_QUEUE = 128


@POLICIES.register
class LpmPolicy(SchedulePolicy):
    name = "lpm"
    looks_up_prefixes = True

    def for_queue(self, num_waiting: int) -> SchedulePolicy:
        return FcfsPolicy() if num_waiting > LPM_MAX_QUEUE else self

    def order(
        self, cands: list[Candidate], programs: ProgramTable | None, now: float
    ) -> list[Candidate]:
        return sorted(cands, key=lambda c: -c.matched_tokens)  # stable: arrival order
