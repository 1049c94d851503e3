"""Programs: which requests belong to one braid program run, and what the runtime learns of
each, for the `program` scheduling policy and for pinning a program's KV across its tool calls.

A request names its program (`GenerateReq.program_id`, else the root of its `session_id`: a
program's forks have sessions "<root>.<i>"). Per program the table keeps the service it has
received (prompt and output tokens computed for it: Autellix's attained service), its requests
in flight, and the pauses between a call finishing and its next call arriving (the program's
tool calls or Python work), from which `pin_ttl` sets how long its KV stays pinned after a
call (as Continuum: a little longer than its tool calls have taken). A program ends when its
root session is closed, or after `idle_s` with nothing in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from braid.runtime.scheduler.request import Req

# Pauses between calls remembered per program, and how far the pin outlasts the longest.
PAUSES_KEPT = 8
PIN_TTL_FACTOR = 2.0
PIN_TTL_MIN_S = 1.0
# A program's first pin, before any pause is known (capped by the configured session TTL).
PIN_TTL_FIRST_S = 30.0


def program_of(req: Req) -> str | None:
    """The program `req` belongs to: its `program_id`, else its session's root, else none."""
    if req.program_id is not None:
        return req.program_id
    if req.session_id is not None:
        return req.session_id.split(".", 1)[0]
    return None


@dataclass
class Program:
    id: str
    started: float
    service: int = 0  # tokens computed for its requests
    in_flight: int = 0
    calls: int = 0
    idle_since: float | None = None  # when its last request in flight left
    pauses: deque = field(default_factory=lambda: deque(maxlen=PAUSES_KEPT))


class ProgramTable:
    """The programs with requests in flight or recently so. `max_ttl_s` caps a pin's TTL
    (the `session_ttl_s` setting); `idle_s`: a program quiet this long is forgotten."""

    def __init__(
        self,
        max_ttl_s: float = 600.0,
        idle_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_ttl_s = max_ttl_s
        self.idle_s = idle_s
        self.clock = clock
        self._programs: dict[str, Program] = {}
        self.ended = 0  # programs closed or forgotten

    def get(self, req: Req) -> Program | None:
        pid = program_of(req)
        return None if pid is None else self._programs.get(pid)

    def arrive(self, req: Req) -> None:
        """`req` entered the scheduler: count it; a pause since the program's last call ended
        is one of its tool calls."""
        pid = program_of(req)
        if pid is None:
            return
        now = self.clock()
        p = self._programs.get(pid)
        if p is None:
            p = self._programs[pid] = Program(pid, now)
        elif p.in_flight == 0 and p.idle_since is not None:
            p.pauses.append(now - p.idle_since)
        p.in_flight += 1
        p.calls += 1
        p.idle_since = None

    def leave(self, req: Req) -> None:
        """`req` finished or was aborted."""
        p = self.get(req)
        if p is None:
            return
        p.in_flight -= 1
        if p.in_flight == 0:
            p.idle_since = self.clock()

    def serve(self, req: Req, tokens: int) -> None:
        """`tokens` of `req` were computed (prefill or decode)."""
        p = self.get(req)
        if p is not None:
            p.service += tokens

    def service(self, req: Req) -> int:
        """The service `req`'s program has received (a request of no program: its own
        tokens so far)."""
        p = self.get(req)
        return p.service if p is not None else req.kv_len

    def pin_ttl(self, req: Req) -> float:
        """How long the KV of `req`'s program stays pinned after this call: PIN_TTL_FACTOR x
        its longest recent pause between calls (at least PIN_TTL_MIN_S), PIN_TTL_FIRST_S
        before any pause is known; the request's own `session_ttl_s` where the client set
        one; never more than `max_ttl_s`."""
        if req.session_ttl_s is not None:
            return min(req.session_ttl_s, self.max_ttl_s)
        p = self.get(req)
        if p is None or not p.pauses:
            return min(PIN_TTL_FIRST_S, self.max_ttl_s)
        return min(self.max_ttl_s, max(PIN_TTL_MIN_S, PIN_TTL_FACTOR * max(p.pauses)))

    def end(self, program_id: str) -> bool:
        """Forget a program (its root session was closed); whether it was known."""
        p = self._programs.get(program_id)
        if p is None or p.in_flight:
            return False
        del self._programs[program_id]
        self.ended += 1
        return True

    def expire(self) -> int:
        """Forget programs idle for `idle_s`; how many."""
        cutoff = self.clock() - self.idle_s
        stale = [
            pid
            for pid, p in self._programs.items()
            if p.in_flight == 0 and p.idle_since is not None and p.idle_since < cutoff
        ]
        for pid in stale:
            del self._programs[pid]
        self.ended += len(stale)
        return len(stale)

    def stats(self) -> dict[str, float]:
        return {
            "programs_in_flight": float(sum(1 for p in self._programs.values() if p.in_flight)),
            "programs_known": float(len(self._programs)),
            "programs_ended": float(self.ended),
        }

    def __len__(self) -> int:
        return len(self._programs)
