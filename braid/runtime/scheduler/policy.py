"""What the scheduling policies share: the `SchedulePolicy` interface the prefill planner
calls, a waiting request as a `Candidate` (with its cached prefix when the policy looks it
up), which prefix may come from the cache, a program call's gang, and in-batch prefix sharing.
The policies themselves are in `policies/` (a registry: `--schedule-policy NAME`).

Every policy but fcfs defers a request that shares an uncached prefix with one already in this
step's batch, so the shared part is computed once (the first request computes and caches it;
the deferred one hits it a step later).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from braid.runtime.cache.radix_cache import MatchResult, PrefixCache
from braid.runtime.scheduler.programs import ProgramTable, program_of
from braid.runtime.scheduler.request import Req
from braid.runtime.scheduler.sessions import SessionPins

# A request sharing at least this many uncached tokens with one already admitted this step waits.
IN_BATCH_SHARE_THRESHOLD = 32


class SchedulePolicy:
    """How the prefill planner picks waiting requests: the order (`order`), and what the
    planner does around it, each a class attribute or a method a policy overrides.

    `looks_up_prefixes`: candidates carry their cached prefix (`Candidate.match`), which the
    order reads. `defers_sharers`: a request sharing an uncached prefix with one admitted this
    step waits a step (`shares_uncached_prefix`). `by_program`: a program call's requests (a
    fork's branches, a select's choices) are admitted together (`gangs_of`).
    `remembers_sequences`: the program table keeps programs' sequences, so a program's service
    counts only tokens it had not had computed before. `takes_priorities`: requests may carry
    a `priority` (any other policy refuses one other than 0); `retract_victim` picks what a
    decode step short of pages retracts. `keeps_arrival_order`: without prefix lookups the
    head of the queue is the first candidate (`PrefillPlanner.admits_now` looks at it alone).
    """

    name = ""
    looks_up_prefixes = False
    defers_sharers = True
    by_program = False
    remembers_sequences = False
    takes_priorities = False  # requests may carry a `priority` other than 0
    keeps_arrival_order = True  # `order` leaves candidates that look nothing up as they came

    def retract_victim(self, running: list[Req]) -> int:
        """The index in `running` (the running requests in admission order, then a prompt
        between chunks if there is one) of the request to retract when decoding runs out of
        pages: the last."""
        return len(running) - 1

    def for_queue(self, num_waiting: int) -> SchedulePolicy:
        """The policy to apply to a queue of `num_waiting` requests (lpm gives way to fcfs
        past a length where its matching costs more than it saves)."""
        return self

    def order(
        self, cands: list[Candidate], programs: ProgramTable | None, now: float
    ) -> list[Candidate]:
        """`cands` (in arrival order) in the order to admit them; `programs` and `now` (the
        request table's clock) for the policies that order by program and age requests."""
        return cands

    def program_gate(
        self, programs: ProgramTable | None, pins: SessionPins, capacity_tokens: int
    ) -> list[int] | None:
        """Program admission: [programs under way, how many may be], or None (no gate), given
        the session pins held and the pool's size."""
        return None

    def holds_start(self, cand: Candidate, programs: ProgramTable, now: float) -> bool:
        """Under a closed gate (`program_gate` full), whether `cand` waits rather than start
        a program."""
        return False

    def pins_kept_from(
        self, cand: Candidate, programs: ProgramTable | None, now: float
    ) -> Callable[[str], bool] | None:
        """The session pins that do not give way to `cand`: a predicate on a pin's program, or
        None (every pin may give way)."""
        return None


@dataclass
class Candidate:
    req: Req
    use_cache: bool  # False: prompt logprobs need logits at every prompt position
    match: MatchResult | None  # the cached prefix, looked up only when the policy sorts by it
    page_size: int

    @property
    def matched_tokens(self) -> int:
        return 0 if self.match is None else len(self.match.pages) * self.page_size


def match_limit(req: Req) -> int:
    """How many leading tokens may come from the cache: all but the last, which must be
    computed to give logits; with prompt logprobs, none before the first scored position's
    predecessor (whose logits score it); with unverified jump-forward tokens, none from the
    predecessor of the first (whose logits verify it); none for an embedding pooled over more
    than its last token (the cache holds KV, not the hidden states pooling reads)."""
    if req.embed is not None and req.embed.pooling != "last":
        return 0
    if req.params.prompt_logprobs is not None and not req.admitted_once:
        return max(0, min(req.seq_len - 1, req.params.logprob_start_len - 1))
    return req.seq_len - 1 - req.unverified


def candidates(
    waiting: list[Req],
    cache: PrefixCache,
    policy: SchedulePolicy,
    programs: ProgramTable | None = None,
    now: float = 0.0,
) -> list[Candidate]:
    """The waiting requests in the order `policy` (as `for_queue` gave it) wants them
    prefilled, each with its cached prefix if the policy looks it up (the scheduler matches
    again on admission, since making room for earlier admissions may evict)."""
    out = []
    for req in waiting:
        use_cache = match_limit(req) > 0
        match = None
        if use_cache and policy.looks_up_prefixes:
            match = cache.match_prefix(req.cache_tokens(match_limit(req)))
        out.append(Candidate(req, use_cache, match, cache.page_size))
    return policy.order(out, programs, now)


def call_key(req: Req) -> tuple[str, int] | None:
    """The program call `req` is one request of (its program and position: a fork's
    branches and a select's choices share both), or None (no program, or no position)."""
    program = program_of(req)
    if program is None or req.program_position is None:
        return None
    return program, req.program_position


def gangs_of(cands: list[Candidate]) -> dict[tuple[str, int], list[Candidate]]:
    """The calls with more than one waiting request among `cands`: call -> its requests
    (the program policies admit them together)."""
    calls: dict[tuple[str, int], list[Candidate]] = {}
    for c in cands:
        key = call_key(c.req)
        if key is not None:
            calls.setdefault(key, []).append(c)
    return {k: v for k, v in calls.items() if len(v) > 1}


def shares_uncached_prefix(c: Candidate, admitted: list[Candidate]) -> bool:
    """True if `c` shares a long prefix, beyond what it matched in the cache, with a request
    already admitted this step (which will have cached it by the next step)."""
    tokens = c.req.cache_tokens(match_limit(c.req))
    for a in admitted:
        common = len(os.path.commonprefix([tokens, a.req.cache_tokens(match_limit(a.req))]))
        if common - c.matched_tokens >= IN_BATCH_SHARE_THRESHOLD:
            return True
    return False
