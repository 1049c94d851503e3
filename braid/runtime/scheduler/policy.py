"""Which waiting requests to prefill next, and how many tokens of each.

`lpm` (longest prefix match first) orders the waiting queue by how much of each request the
prefix cache already holds, and defers a request that shares an uncached prefix with one
already in this batch, so the shared part is computed once (the first request computes and
caches it; the deferred one hits it a step later). `fcfs` takes requests in arrival order.

`program` orders by program (Autellix's least attained service): requests of the program that
has received the least service so far come first, at a level of PROGRAM_LEVELS, so a short
agent's next step is not stuck behind long ones; a request rises one level for every
PROGRAM_AGING_S it waits (no starvation). Within a level, the program whose waiting request has
the longest cached prefix goes first (the cache match as the tie-break: a program whose context
is still cached costs only its new tokens, and running it before the cache loses that context
saves computing it again), then the program that started waiting first. A program's waiting
requests stay together, the longest cached prefix first, and the requests of one call (a fork's
branches, a select's choices: same program, same position, `call_key`) are admitted as a gang:
while anything else runs, they go in only when all of them fit (`PrefillPlanner.
_gang_fits`; the pins give way to them as to one request at the head), since the
program's join waits for every branch and a branch admitted alone only holds KV. The prefill
budget, or a prefix they share that the cache does not hold yet (computed by the first, the
others a step later), may still split their prefill over consecutive steps. It defers in-batch
sharers as lpm does (a shared prefix not yet cached is computed once, by the first sharer), and
unlike lpm it looks up every waiting request's prefix however long the queue.

`program-srpt` orders by program too, by the work each program is predicted to ask for yet
(shortest remaining first, which least attained service approximates without a prediction):
the program's output tokens per call so far times the calls it is expected to send yet (from
the recently ended programs' call counts), plus a tenth for each prompt token the cache does
not hold (`ProgramTable.remaining_work`). A program's key is log2 of that work less one per
SRPT_AGING_S waited (no starvation: waiting doubles the work it may jump over every
SRPT_AGING_S); programs stay together and in-batch sharers wait, as for `program`. (The
cached prefix is already in the key, so the tie-break by it seldom applies.) With program
sessions (pins), a paused program's pin gives way only to a request predicted to need less
work than the program (`prefill.PrefillPlanner._pins_kept_from`), and a program starts only
while fewer programs are under way than the pool holds (`ProgramTable.program_cap`; the
planner's program admission).
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass

from braid.runtime.cache.radix_cache import MatchResult, PrefixCache
from braid.runtime.scheduler.programs import ProgramTable, program_of
from braid.runtime.scheduler.request import Req

# `program`: attained-service thresholds (tokens computed for the program) between its
# priority levels, and the wait that lifts a request one level. Aging bounds starvation (a
# request waits at most about 5 x PROGRAM_AGING_S longer than a new program's), and must not
# decide the order under an ordinary backlog: at 2 s a level, with waits of 20-80 s past the
# CPU's throughput, it ordered by wait alone (as fcfs: p50 35.4 s against fcfs' 34.2 and lpm's
# 24.9, `benchmarks/agents.py --programs 64 --mix heavy --rates 2`); at 30 s, 28.9 s.
PROGRAM_LEVELS = (256, 1024, 4096, 16384, 65536)
PROGRAM_AGING_S = 30.0
# `program-srpt`: the wait that halves a program's predicted work in the order.
SRPT_AGING_S = 30.0
PROGRAM_POLICIES = ("program", "program-srpt")

# Past this many waiting requests, lpm's per-request matching costs more than it saves.
LPM_MAX_QUEUE = 128
# A request sharing at least this many uncached tokens with one already admitted this step waits.
IN_BATCH_SHARE_THRESHOLD = 32


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


def effective_policy(policy: str, num_waiting: int) -> str:
    """lpm turns into fcfs past LPM_MAX_QUEUE waiting requests (`program` looks prefixes up
    however long the queue: see `candidates`)."""
    return "fcfs" if policy == "lpm" and num_waiting > LPM_MAX_QUEUE else policy


def program_level(service: int) -> int:
    """The priority level of a program that has received `service` tokens (0 first)."""
    return bisect.bisect_right(PROGRAM_LEVELS, service)


def candidates(
    waiting: list[Req],
    cache: PrefixCache,
    policy: str,
    programs: ProgramTable | None = None,
    now: float = 0.0,
) -> list[Candidate]:
    """The waiting requests in the order `policy` (an effective policy) wants them prefilled.
    lpm and program look up cached prefixes here (the scheduler matches again on admission,
    since making room for earlier admissions may evict); program reads `programs`' service,
    program-srpt its predicted remaining work, and both age requests by `now` (the request
    table's clock)."""
    out = []
    lookup = policy == "lpm" or policy in PROGRAM_POLICIES
    for req in waiting:
        use_cache = match_limit(req) > 0
        match = None
        if use_cache and lookup:
            match = cache.match_prefix(req.cache_tokens(match_limit(req)))
        out.append(Candidate(req, use_cache, match, cache.page_size))
    if policy == "lpm":
        out.sort(key=lambda c: -c.matched_tokens)  # stable: arrival order among equals
    elif policy in PROGRAM_POLICIES:
        out = _by_program(out, programs, now, srpt=policy == "program-srpt")
    return out


def aged_key(c: Candidate, programs: ProgramTable | None, now: float, srpt: bool) -> float:
    """A candidate's place under `program` (its program's service level) or `program-srpt`
    (log2 of its program's predicted remaining work), less its aging."""
    req = c.req
    waited = max(0.0, now - req.waiting_since)
    if srpt:
        uncached = req.seq_len - c.matched_tokens
        if programs is None:
            work = float(max(0, req.remaining_new_tokens))
        else:
            work = programs.remaining_work(req, uncached)
        return math.log2(1.0 + work) - waited / SRPT_AGING_S
    service = programs.service(req) if programs is not None else req.kv_len
    return program_level(service) - int(waited / PROGRAM_AGING_S)


def _by_program(
    cands: list[Candidate], programs: ProgramTable | None, now: float, srpt: bool = False
):
    """Order for the program policies: by each program's best (lowest) aged key, then its
    longest cached prefix, then its first waiting request; within a program, the longest
    cached prefix first."""
    best: dict[object, tuple[float, int, int]] = {}  # program -> (key, -matched, first)
    keys = []
    for i, c in enumerate(cands):
        group = program_of(c.req) or ("request", c.req.rid)
        aged = aged_key(c, programs, now, srpt)
        level, matched, first = best.get(group, (aged, -c.matched_tokens, i))
        best[group] = (min(level, aged), min(matched, -c.matched_tokens), first)
        keys.append(group)
    order = sorted(
        range(len(cands)),
        key=lambda i: (*best[keys[i]], -cands[i].matched_tokens, i),
    )
    return [cands[i] for i in order]


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
