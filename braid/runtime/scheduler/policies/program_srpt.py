"""`program-srpt`: requests ordered by program, as `program` orders them, by the work each
program is predicted to ask for yet (shortest remaining first, which least attained service
approximates without a prediction): the program's output tokens per call so far times the
calls it is expected to send yet (from the recently ended programs' call counts), plus a tenth
for each prompt token the cache does not hold (`ProgramTable.remaining_work`). A program's key
is log2 of that work less one per SRPT_AGING_S waited (no starvation: waiting doubles the work
it may jump over every SRPT_AGING_S); programs stay together, calls go in as gangs and in-batch
sharers wait, as for `program`. (The cached prefix is already in the key, so the tie-break by
it seldom applies.)

With program sessions (pins), a paused program's pin gives way only to a request predicted to
need less work than the program (`pins_kept_from`), and a program starts only while fewer
programs are under way than the pool holds (`program_gate`, `holds_start`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from braid.runtime.scheduler.policies import POLICIES
from braid.runtime.scheduler.policies.program import ProgramPolicy
from braid.runtime.scheduler.policy import Candidate
from braid.runtime.scheduler.programs import ProgramTable, program_of
from braid.runtime.scheduler.sessions import SessionPins

# The wait that halves a program's predicted work in the order.
SRPT_AGING_S = 30.0


@POLICIES.register
class ProgramSrptPolicy(ProgramPolicy):
    name = "program-srpt"
    remembers_sequences = False  # the key is a prediction, not the service received

    def key(self, c: Candidate, programs: ProgramTable | None, now: float) -> float:
        """log2 of the candidate's program's predicted remaining work (a request of no
        program: its own output and uncached prompt), less one per SRPT_AGING_S waited."""
        req = c.req
        waited = max(0.0, now - req.waiting_since)
        uncached = req.seq_len - c.matched_tokens
        if programs is None:
            work = float(max(0, req.remaining_new_tokens))
        else:
            work = programs.remaining_work(req, uncached)
        return math.log2(1.0 + work) - waited / SRPT_AGING_S

    def program_gate(
        self, programs: ProgramTable | None, pins: SessionPins, capacity_tokens: int
    ) -> list[int] | None:
        """While programs hold pins: [programs under way (`ProgramTable.under_way`), how many
        may be (`program_cap`)]; None otherwise (no gate: without pins nothing keeps a paused
        program's context, so holding new ones back saves nothing)."""
        if programs is None:
            return None
        pinned = pins.by_program()
        if not pinned:
            return None
        cap = programs.program_cap(capacity_tokens)
        return None if cap is None else [programs.under_way(pinned), cap]

    def holds_start(self, cand: Candidate, programs: ProgramTable, now: float) -> bool:
        """`cand` would start a program, and has not waited so long that aging put its key
        below any program's with no work left (below 0: no starvation, should the programs
        under way never end)."""
        return programs.starts(cand.req) and self.key(cand, programs, now) >= 0

    def pins_kept_from(
        self, cand: Candidate, programs: ProgramTable | None, now: float
    ) -> Callable[[str], bool] | None:
        """Those of programs predicted to ask for less work yet than `cand`'s (the order srpt
        itself would serve them in; evicting their context for `cand` would have them
        computed again when they come back first)."""
        if programs is None:
            return None
        # The head's place in the order, aging included: a head that has waited long enough
        # outranks the pins too (no starvation).
        key = self.key(cand, programs, now)
        mine = program_of(cand.req)

        def keep(program: str) -> bool:
            theirs = programs.paused_work(program)
            return program != mine and theirs is not None and math.log2(1.0 + theirs) < key

        return keep
