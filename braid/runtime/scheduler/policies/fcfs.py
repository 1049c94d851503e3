"""`fcfs`: waiting requests in arrival order, looking up no prefix before admission."""

from __future__ import annotations

from braid.runtime.scheduler.policies import POLICIES
from braid.runtime.scheduler.policy import SchedulePolicy


@POLICIES.register
class FcfsPolicy(SchedulePolicy):
    name = "fcfs"
    defers_sharers = False
