"""`program`: requests ordered by program (Autellix's least attained service). Requests of the
program that has received the least service so far come first, at a level of PROGRAM_LEVELS,
so a short agent's next step is not stuck behind long ones; a request rises one level for every
PROGRAM_AGING_S it waits (no starvation). Within a level, the program whose waiting request has
the longest cached prefix goes first (the cache match as the tie-break: a program whose context
is still cached costs only its new tokens, and running it before the cache loses that context
saves computing it again), then the program that started waiting first. A program's waiting
requests stay together, the longest cached prefix first, and the requests of one call (a fork's
branches, a select's choices: same program, same position, `policy.call_key`) are admitted as
a gang: while anything else runs, they go in only when all of them fit (`PrefillPlanner.
_gang_fits`; the pins give way to them as to one request at the head), since the program's join
waits for every branch and a branch admitted alone only holds KV. The prefill budget, or a
prefix they share that the cache does not hold yet (computed by the first, the others a step
later), may still split their prefill over consecutive steps. Unlike lpm it looks up every
waiting request's prefix however long the queue.
"""

from __future__ import annotations

import bisect

from braid.runtime.scheduler.policies import POLICIES
from braid.runtime.scheduler.policy import Candidate, SchedulePolicy
from braid.runtime.scheduler.programs import ProgramTable, program_of

# Attained-service thresholds (tokens computed for the program) between the priority levels,
# and the wait that lifts a request one level. Aging bounds starvation (a request waits at
# most about 5 x PROGRAM_AGING_S longer than a new program's), and must not decide the order
# under an ordinary backlog: at 2 s a level, with waits of 20-80 s past the CPU's throughput,
# it ordered by wait alone (as fcfs: p50 35.4 s against fcfs' 34.2 and lpm's 24.9,
# `benchmarks/agents.py --programs 64 --mix heavy --rates 2`); at 30 s, 28.9 s.
PROGRAM_LEVELS = (256, 1024, 4096, 16384, 65536)
PROGRAM_AGING_S = 30.0


def program_level(service: int) -> int:
    """The priority level of a program that has received `service` tokens (0 first)."""
    return bisect.bisect_right(PROGRAM_LEVELS, service)


@POLICIES.register
class ProgramPolicy(SchedulePolicy):
    name = "program"
    looks_up_prefixes = True
    by_program = True
    remembers_sequences = True

    def key(self, c: Candidate, programs: ProgramTable | None, now: float) -> float:
        """A candidate's place: its program's service level, less one per PROGRAM_AGING_S
        it has waited."""
        waited = max(0.0, now - c.req.waiting_since)
        service = programs.service(c.req) if programs is not None else c.req.kv_len
        return program_level(service) - int(waited / PROGRAM_AGING_S)

    def order(
        self, cands: list[Candidate], programs: ProgramTable | None, now: float
    ) -> list[Candidate]:
        """By each program's best (lowest) key, then its longest cached prefix, then its first
        waiting request; within a program, the longest cached prefix first."""
        best: dict[object, tuple[float, int, int]] = {}  # program -> (key, -matched, first)
        groups = []
        for i, c in enumerate(cands):
            group = program_of(c.req) or ("request", c.req.rid)
            key = self.key(c, programs, now)
            level, matched, first = best.get(group, (key, -c.matched_tokens, i))
            best[group] = (min(level, key), min(matched, -c.matched_tokens), first)
            groups.append(group)
        order = sorted(
            range(len(cands)),
            key=lambda i: (*best[groups[i]], -cands[i].matched_tokens, i),
        )
        return [cands[i] for i in order]
