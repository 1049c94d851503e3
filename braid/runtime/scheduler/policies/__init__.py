"""Scheduling policies: the order in which the prefill planner admits waiting requests, in a
registry of lazily imported `policy.SchedulePolicy` classes (`--schedule-policy NAME`).

- `lpm`: longest cached prefix first (the default).
- `fcfs`: arrival order.
- `program`: by program, least attained service first (Autellix), with aging.
- `program-srpt`: by program, shortest predicted remaining work first, with aging; gates new
  programs by the pool's room and keeps the pins of programs it would serve first.
- `priority`: by each request's `priority` (lower first, vLLM's), which also decides what a
  decode step short of pages retracts.

A new policy is a `SchedulePolicy` subclass in a module of this package, declared in
`POLICIES`' table and registered with `@POLICIES.register`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.scheduler.policy import SchedulePolicy

POLICIES: Registry[type[SchedulePolicy]] = Registry(
    "schedule_policy",
    {
        "lpm": "braid.runtime.scheduler.policies.lpm",
        "fcfs": "braid.runtime.scheduler.policies.fcfs",
        "program": "braid.runtime.scheduler.policies.program",
        "program-srpt": "braid.runtime.scheduler.policies.program_srpt",
        "priority": "braid.runtime.scheduler.policies.priority",
    },
)


def policy_names() -> list[str]:
    """The names `create_policy` accepts, sorted; listing them imports no policy."""
    return POLICIES.names()


def create_policy(name: str) -> SchedulePolicy:
    """The policy registered as `name`; `ValueError` naming the setting and the known names if
    `name` is unknown."""
    return POLICIES.get(name)()


def check_priority(value: Any, schedule_policy: str, where: str = "priority") -> int:
    """A request's `priority` checked before it is sent: a 64-bit integer, and 0 unless
    `schedule_policy` takes priorities; `ParamError` naming `where` otherwise."""
    import operator

    from braid.runtime.errors import ParamError

    try:  # any integer type (numpy's too), not a bool
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or not -(2**63) <= number < 2**63:
        raise ParamError.at(where, f"must be a 64-bit integer, got {value!r}")
    if number and not POLICIES.get(schedule_policy).takes_priorities:
        raise ParamError.at(
            where,
            f"needs the priority schedule policy (schedule_policy='priority', --schedule-policy "
            f"priority); this engine runs {schedule_policy!r}",
        )
    return number
