"""Programs: which requests belong to one braid program run, and what the runtime learns of
each, for the `program` scheduling policy and for pinning a program's KV across its tool calls.

A request names its program (`GenerateReq.program_id`, else the root of its `session_id`: a
program's forks have sessions "<root>.<i>") and its call's position in the program
(`GenerateReq.program_position`). Per program the table keeps the service it has received
(prompt and output tokens computed for it: Autellix's attained service; tokens computed again,
because the cache evicted them or the request was retracted, are not service: the program did
not ask for them, and charging it would push the programs the cache failed further back, where
they wait and lose their KV again), its requests in flight, its calls (received, served, the
last position), and the pauses between a call finishing and its next call arriving (the
program's tool calls or Python work), from which
`pin_ttl` sets how long its KV stays pinned after a call (as Continuum: a little longer than
its tool calls have taken). A program ends when its root session is closed (or, for a run
without sessions, at the control op `end_program`), or after `idle_s` with nothing in flight.
For `program-srpt` it also keeps its output per served call and, once ended, its call count
(`remaining_work`), and the tokens it found cached when it started and its longest sequence:
its own KV at its peak, whose mean over the ended programs sizes how many programs may be
under way at once (`program_cap`).

A call is what one gen or select of the program sends: a gen's samples and a select's choices
are several requests of one call, with the same session and position. A request starts a new
call unless its session's previous request had the same position; a request without a
position is a call of its own. A run without sessions sends its program id and positions but
no session, so the branches of one of its forks at one position count as one call (whose
output is theirs together). Positions count a program's calls along its chains of
dependent calls: a fork's branches each go on from the parent's next position, and after a join
the parent goes on from the furthest branch (`braid/lang/executor.py`). A call's position is so
its depth in the program's graph of calls (Autellix's view of a program): the most calls on
any chain that finished before it; branches running side by side share positions. Positions are
kept for accounting, not used for ordering: the `program` policy's attained service already
grows with each call a program has had served.

What a program had computed before: a request's own KV (computed again after a retraction, or
after a step gave some of it back: the overlap schedule's row of a request that jumped forward,
rejected jump-forward tokens), and, with `remember` (the scheduler sets it for the
`program` policy, the one that orders by service), the leading tokens its prompt shares with
any of its program's remembered sequences. A program remembers at most SEQUENCES_KEPT
finished sequences (the oldest goes first): per session, those of its latest call (a select's
choices, a gen's samples; a request without a position replaces all of its session's), none of
a closed session, each only as far as its KV was computed (`Req.program_seen`; an aborted
request's prompt may not have been). So a fork branch's prompt repeating its parent's text,
and the next call after a select repeating the chosen choice, count what the program had
computed as recomputed, not as new service; a prompt repeating a sequence the program computed
but no longer remembers (or one still in flight) is charged again. Without `remember` (other
policies, where service is only reported), nothing is remembered across requests: a session's
next prompt computed again counts as service. The lookup costs an arriving request at most
SEQUENCES_KEPT x log2(prompt) slice compares of its prompt, in C.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from braid.runtime.cache.radix_cache import common_prefix_len
from braid.runtime.ipc.to_tokenizer import ProgramInfo
from braid.runtime.scheduler.pin_cost import DecayedRatio
from braid.runtime.scheduler.request import Req

# Pauses between calls remembered per program, and how far the pin outlasts the longest.
PAUSES_KEPT = 8
PIN_TTL_FACTOR = 2.0
PIN_TTL_MIN_S = 1.0
# A program's first pin, before any pause is known (capped by the configured session TTL).
PIN_TTL_FIRST_S = 30.0
# Programs listed (`ProgramTable.infos`) beyond those holding pins.
PROGRAMS_LISTED = 64
# Finished sequences remembered per program (with `ProgramTable.remember`).
SEQUENCES_KEPT = 8
# Ended programs whose call counts predict how many calls a program has left.
LENGTHS_KEPT = 256
# A prompt token to compute against an output token, in device time (`remaining_work`): a
# prefill computes tokens 5-10 times as fast as a decode step of 16 rows generates them, on
# the H200 with 8B shapes (20-40 thousand a second against at most 16 x the batch-1 rate of
# 235, the step being memory-bound) and on the 2-core CPU with SmolLM2 (1-3 thousand against
# 333; `pin_cost.py`, docs/benchmarks.md).
PREFILL_WEIGHT = 0.1
# Program admission (`ProgramTable.program_cap`): the share of the pool the programs under way
# are planned to fill at their peak (the rest: the shared prefix, the decode reserve).
PROGRAM_SHARE = 0.9


def program_of(req: Req) -> str | None:
    """The program `req` belongs to: its `program_id`, else its session's root, else none."""
    if req.program_id is not None:
        return req.program_id
    if req.session_id is not None:
        return req.session_id.split(".", 1)[0]
    return None


def _call_of(req: Req) -> tuple[str | None, int | None]:
    """The call `req` is part of: its session and position, else (no position) itself."""
    if req.program_position is None:
        return req.rid, None
    return req.session_id, req.program_position


@dataclass(frozen=True)
class SeenSequence:
    """A finished request's sequence as far as its KV was computed, with its call."""

    session: str | None
    position: int | None
    tokens: array  # 32-bit token ids: half a list's pointers, and no int objects

    def supersedes(self, other: SeenSequence) -> bool:
        """Whether `other` is of an earlier call of this one's session (this one replaces it):
        not when both carry the same position (two requests of one call)."""
        if other.session != self.session:
            return False
        return self.position is None or other.position != self.position


@dataclass
class Program:
    id: str
    started: float
    service: int = 0  # tokens computed for its requests
    decoded: int = 0  # output tokens of its served calls
    in_flight: int = 0
    calls: int = 0  # calls received
    last_position: int | None = None  # the highest position a request carried
    idle_since: float | None = None  # when its last request in flight left
    pauses: deque = field(default_factory=lambda: deque(maxlen=PAUSES_KEPT))
    # Each session's latest position (a request with the same one is the same call) and the
    # calls with requests in flight (how many each).
    positions: dict[str | None, int] = field(default_factory=dict)
    open_calls: dict[tuple[str | None, int | None], int] = field(default_factory=dict)
    # Output tokens of each open call's finished requests (added to `decoded` once it is served).
    call_output: dict[tuple[str | None, int | None], int] = field(default_factory=dict)
    # Its latest finished sequences, oldest first (see the module's docstring): what a new
    # request's prompt repeats of one of them was computed before.
    sequences: list[SeenSequence] = field(default_factory=list)
    # Program admission: the tokens its first request found cached when admitted (None: not
    # admitted yet), and the longest sequence of its requests (its KV at its peak).
    first_cached: int | None = None
    peak: int = 0
    ending: bool = False  # told to end with requests in flight: it ends when the last leaves

    @property
    def calls_served(self) -> int:
        """Calls whose requests have all finished."""
        return self.calls - len(self.open_calls)


class ProgramTable:
    """The programs with requests in flight or recently so. `max_ttl_s` caps a pin's TTL
    (the `session_ttl_s` setting); `idle_s`: a program quiet this long is forgotten;
    `remember`: keep programs' finished sequences, so a prompt repeating one is not charged
    again (see the module's docstring)."""

    def __init__(
        self,
        max_ttl_s: float = 600.0,
        idle_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        remember: bool = True,
    ) -> None:
        self.max_ttl_s = max_ttl_s
        self.idle_s = idle_s
        self.clock = clock
        self.remember = remember
        self._programs: dict[str, Program] = {}
        self.ended = 0  # programs closed or forgotten
        self.recomputed = 0  # tokens computed again for a program (not service)
        self._pauses = DecayedRatio()  # every program's pauses, the recent weighing more
        self._per_call = DecayedRatio()  # output tokens per call, every program's
        self._lengths: deque[int] = deque(maxlen=LENGTHS_KEPT)  # ended programs' calls
        self._calls_left: dict[int, float] = {}  # calls_left by calls served, until one ends
        self._footprint = DecayedRatio()  # ended programs' own KV at their peak, in tokens

    def get(self, req: Req) -> Program | None:
        pid = program_of(req)
        return None if pid is None else self._programs.get(pid)

    def arrive(self, req: Req) -> None:
        """`req` entered the scheduler: count it (and its call, if it starts one); a pause
        since the program's last call ended is one of its tool calls."""
        pid = program_of(req)
        if pid is None:
            return
        now = self.clock()
        p = self._programs.get(pid)
        if p is None:
            p = self._programs[pid] = Program(pid, now)
        elif p.in_flight == 0 and p.idle_since is not None:
            p.pauses.append(now - p.idle_since)
            self._pauses.add(p.pauses[-1])
        p.in_flight += 1
        p.idle_since = None
        p.ending = False  # a request after the end: the program goes on
        pos = req.program_position
        if pos is None or p.positions.get(req.session_id) != pos:
            p.calls += 1
        if pos is not None:
            p.positions[req.session_id] = pos
            p.last_position = pos if p.last_position is None else max(p.last_position, pos)
        call = _call_of(req)
        p.open_calls[call] = p.open_calls.get(call, 0) + 1
        if p.sequences:
            prompt = array("i", req.input_ids)
            req.program_seen = max(common_prefix_len(q.tokens, prompt) for q in p.sequences)

    def leave(self, req: Req) -> None:
        """`req` finished or was aborted."""
        p = self.get(req)
        if p is None:
            return
        p.in_flight -= 1
        call = _call_of(req)
        left = p.open_calls.pop(call, 0) - 1
        if left > 0:
            p.open_calls[call] = left
        output = p.call_output.pop(call, 0) + len(req.output_ids)
        if left > 0:
            p.call_output[call] = output
        else:  # the call is served: its output counts towards the program's mean per call
            p.decoded += output
            self._per_call.add(output)
        if p.in_flight == 0:
            p.idle_since = self.clock()
        p.peak = max(p.peak, req.seq_len)
        if p.ending and p.in_flight == 0:
            self._ended(self._programs.pop(p.id))
            return
        # What was computed of it (an aborted request's prompt may not have been), never the
        # last sample (whose KV only a step run ahead computes).
        done = min(req.program_seen, req.seq_len - 1)
        if self.remember and done > 0:
            new = SeenSequence(req.session_id, req.program_position, array("i", req.tokens(done)))
            p.sequences = [q for q in p.sequences if not new.supersedes(q)] + [new]
            del p.sequences[:-SEQUENCES_KEPT]

    def serve(self, req: Req, start: int, end: int) -> None:
        """The KV of `req`'s tokens `start`..`end` was computed (a prefill chunk, or a decode
        step's one token): service, except where the program had them computed before."""
        p = self.get(req)
        if p is None:
            return
        again = max(0, min(end, req.program_seen) - start)
        p.service += end - start - again
        self.recomputed += again
        req.program_seen = max(req.program_seen, end)

    def close_session(self, session: str) -> None:
        """`session` was closed: its program forgets its sequences and position (a program
        named by `program_id` rather than by its sessions' root keeps them until they age out
        or the program ends)."""
        p = self._programs.get(session.split(".", 1)[0])
        if p is None:
            return
        p.sequences = [q for q in p.sequences if q.session != session]
        p.positions.pop(session, None)

    def service(self, req: Req) -> int:
        """The service `req`'s program has received (a request of no program: its own
        tokens so far)."""
        p = self.get(req)
        return p.service if p is not None else req.kv_len

    def calls_left(self, served: int) -> float:
        """The calls a program that has had `served` calls served is expected to send yet,
        the one it waits on included: the mean of N - served over the recently ended programs
        of N > served calls (1 where none is known)."""
        known = self._calls_left.get(served)
        if known is None:  # asked per waiting request and step: computed once per program end
            left = [n - served for n in self._lengths if n > served]
            known = self._calls_left[served] = sum(left) / len(left) if left else 1.0
        return known

    def remaining_work(self, req: Req, uncached: int) -> float:
        """The work `req`'s program is expected to ask for yet, in output tokens (the
        `program-srpt` policy's key): this call's output, at most what `req` may still
        generate, plus each later call's, at the program's mean output per served call (before
        one: every program's, capped by this request's max_tokens), plus PREFILL_WEIGHT per
        prompt token `req` still needs computed (`uncached`: what the cache does not hold). A
        request of no program is its own output and prompt only."""
        p = self.get(req)
        may = max(0, req.remaining_new_tokens)
        if p is None:  # a request of no program: no later call to expect
            return may + PREFILL_WEIGHT * uncached
        prior = self._per_call.value
        per_call = float(may) if prior is None else min(float(may), prior)
        served = 0
        if p.calls_served:
            served = p.calls_served
            per_call = p.decoded / served
        this_call = min(float(may), per_call)
        later = (self.calls_left(served) - 1.0) * per_call
        return this_call + later + PREFILL_WEIGHT * uncached

    def paused_work(self, program_id: str) -> float | None:
        """The work a program between calls is expected to ask for yet, in output tokens, as
        `remaining_work` counts it (its mean output per served call times the calls it is
        expected to send yet); None for a program not known or never served."""
        p = self._programs.get(program_id)
        if p is None or not p.calls_served:
            return None
        return self.calls_left(p.calls_served) * p.decoded / p.calls_served

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

    def expected_pause(self, req: Req) -> float | None:
        """How long `req`'s program is expected to pause after this call: the mean of its
        recent pauses, else of every program's (recent ones weigh more); None before any."""
        p = self.get(req)
        if p is not None and p.pauses:
            return sum(p.pauses) / len(p.pauses)
        return self._pauses.value

    def end(self, program_id: str) -> bool:
        """Forget a program (its root session was closed, or `end_program`), at once or, with
        requests in flight (their aborts may still be on their way), when the last leaves
        (unless another arrives first: then it goes on); whether it was known and not told
        already."""
        p = self._programs.get(program_id)
        if p is None or p.ending:
            return False
        if p.in_flight:
            p.ending = True
            return True
        self._ended(self._programs.pop(program_id))
        return True

    def _ended(self, p: Program) -> None:
        self.ended += 1
        if p.calls:
            self._lengths.append(p.calls)
            self._calls_left.clear()
        if p.first_cached is not None and p.peak > p.first_cached:
            self._footprint.add(p.peak - p.first_cached)

    def admitted(self, req: Req, cached: int) -> bool:
        """`req` was admitted with `cached` tokens of its prompt from the cache: its program's
        first admission starts it (what it found cached then is not its own KV). Whether it
        did."""
        if not self.starts(req):
            return False
        self.get(req).first_cached = cached
        return True

    def starts(self, req: Req) -> bool:
        """Whether admitting `req` would start its program (a program known here, none of
        whose requests has been admitted yet)."""
        p = self.get(req)
        return p is not None and p.first_cached is None

    def under_way(self, pinned: Collection[str]) -> int:
        """Programs started and not done: with requests in flight (running, or a next call
        waiting) or holding pins (`pinned`: the programs that do)."""
        return sum(
            1
            for pid, p in self._programs.items()
            if p.first_cached is not None and (p.in_flight or pid in pinned)
        )

    def program_cap(self, capacity_tokens: int) -> int | None:
        """How many programs may be under way at once in a pool of `capacity_tokens`: as many
        as fill PROGRAM_SHARE of it at the recently ended programs' mean KV at their peak (past
        what they found cached when they started); None before a program has ended."""
        footprint = self._footprint.value
        if footprint is None or footprint <= 0:
            return None
        return max(1, int(PROGRAM_SHARE * capacity_tokens / footprint))

    def expire(self) -> int:
        """Forget programs idle for `idle_s`; how many."""
        cutoff = self.clock() - self.idle_s
        stale = [
            pid
            for pid, p in self._programs.items()
            if p.in_flight == 0 and p.idle_since is not None and p.idle_since < cutoff
        ]
        for pid in stale:
            self._ended(self._programs.pop(pid))
        return len(stale)

    def infos(self, pinned: dict[str, tuple[int, int]]) -> list[ProgramInfo]:
        """The programs in flight or holding pins, most pinned tokens first, then most
        service: every one holding pins, and up to PROGRAMS_LISTED in all. `pinned`: program
        -> (pinned tokens, pinned sessions), as `SessionPins.by_program` gives them (a pin
        may outlive its program's entry here: it is listed with what is known)."""
        out = []
        for pid in {pid for pid, p in self._programs.items() if p.in_flight} | set(pinned):
            tokens, sessions = pinned.get(pid, (0, 0))
            p = self._programs.get(pid) or Program(pid, 0.0)
            out.append(
                ProgramInfo(
                    pid,
                    p.in_flight,
                    p.calls,
                    p.calls_served,
                    p.last_position,
                    p.service,
                    tokens,
                    sessions,
                )
            )
        out.sort(key=lambda i: (-i.pinned_tokens, -i.service, i.id))
        return out[: max(PROGRAMS_LISTED, len(pinned))]

    def stats(self) -> dict[str, float]:
        return {
            "programs_in_flight": float(sum(1 for p in self._programs.values() if p.in_flight)),
            "programs_known": float(len(self._programs)),
            "programs_ended": float(self.ended),
            "program_tokens_recomputed": float(self.recomputed),
        }

    def __len__(self) -> int:
        return len(self._programs)
