"""`priority` (vLLM's priority scheduling): waiting requests by their `priority`, lower values
first, arrival order among equals; when a decode step runs out of pages, the running request
of the highest value (the newest among equals) is retracted. Requests that give no priority
have 0. No prefix is looked up before admission (as fcfs)."""

from __future__ import annotations

from braid.runtime.scheduler.policies import POLICIES
from braid.runtime.scheduler.policy import Candidate, SchedulePolicy
from braid.runtime.scheduler.programs import ProgramTable
from braid.runtime.scheduler.request import Req


@POLICIES.register
class PriorityPolicy(SchedulePolicy):
    name = "priority"
    takes_priorities = True
    keeps_arrival_order = False

    def order(
        self, cands: list[Candidate], programs: ProgramTable | None, now: float
    ) -> list[Candidate]:
        return sorted(cands, key=lambda c: c.req.priority)  # stable: arrival order

    def retract_victim(self, running: list[Req]) -> int:
        return max(range(len(running)), key=lambda i: (running[i].priority, i))
