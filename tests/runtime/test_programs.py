"""Programs in the runtime (issue 23): per-program accounting (service, calls and their
positions, pinned KV), the `program` policy (least attained service with aging, a program's
requests together), pins whose TTL follows a program's tool calls and that give way before a
running request is retracted, and the constant prefix of a `run_batch` computed once."""

from __future__ import annotations

import random

import pytest

import braid
from braid.runtime.cache.memory_pool import PageAllocator
from braid.runtime.cache.radix_cache import RadixCache
from braid.runtime.errors import ParamError
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.scheduler import policy
from braid.runtime.scheduler.policies import create_policy, lpm, program_srpt
from braid.runtime.scheduler.policies import program as program_policy
from braid.runtime.scheduler.programs import (
    PIN_TTL_FIRST_S,
    PREFILL_WEIGHT,
    PROGRAM_SHARE,
    SEQUENCES_KEPT,
    ProgramTable,
)
from braid.runtime.scheduler.request import Req, ReqStatus
from braid.runtime.scheduler.scheduler import ACTIVE
from braid.runtime.scheduler.sessions import SessionPins
from braid.runtime.server.metrics import ServerMetrics
from braid.runtime.speculative.base import Proposer
from tests.conftest import local_scheduler, run_to_end

GREEDY = dict(temperature=0.0, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(
    rid: str,
    n: int = 4,
    session: str | None = None,
    program: str | None = None,
    position: int | None = None,
    ids: list[int] | None = None,
    max_new: int = 4,
) -> Req:
    return Req(
        rid=rid,
        input_ids=list(range(1, n + 1)) if ids is None else ids,
        params=braid.SamplingParams(max_tokens=max_new),
        seed=0,
        eos_ids=frozenset(),
        max_new_tokens=max_new,
        session_id=session,
        program_id=program,
        program_position=position,
    )


def _call(table: ProgramTable, req: Req, output: list[int]) -> Req:
    """`req` arrives, its prompt is computed (none of it cached), it samples `output` (the
    KV of each sample but the last computed by a decode step) and finishes."""
    table.arrive(req)
    table.serve(req, 0, req.prompt_len)
    for k in range(1, len(output)):
        table.serve(req, req.prompt_len + k - 1, req.prompt_len + k)
    req.output_ids = list(output)
    req.finish_reason = "stop"
    table.leave(req)
    return req


# ---- accounting -----------------------------------------------------------------------------
def test_programs_are_named_by_id_or_session_root_and_learn_their_pauses():
    clock = Clock()
    table = ProgramTable(max_ttl_s=100.0, clock=clock)
    a = _req("a", session="prog-1")
    fork = _req("f", session="prog-1.0")
    other = _req("o", program="agent-7")
    for r in (a, fork, other):
        table.arrive(r)
    assert table.get(a) is table.get(fork) and table.get(a).in_flight == 2
    assert table.get(other).id == "agent-7" and table.get(_req("x")) is None
    table.serve(a, 0, 10)
    table.serve(fork, 0, 5)
    assert table.service(a) == 15
    assert table.pin_ttl(a) == PIN_TTL_FIRST_S  # no pause seen yet
    table.leave(a)
    table.leave(fork)
    clock.now = 3.0  # a 3 s tool call
    nxt = _req("b", session="prog-1")
    table.arrive(nxt)
    assert table.pin_ttl(nxt) == 6.0  # twice the longest pause
    table.leave(nxt)
    clock.now = 50.0  # a 47 s pause
    table.arrive(nxt)
    assert table.pin_ttl(nxt) == 94.0
    table.leave(nxt)
    clock.now = 1000.0  # a 950 s pause: capped by max_ttl_s
    table.arrive(n2 := _req("c", session="prog-1"))
    assert table.pin_ttl(n2) == 100.0
    n2.session_ttl_s = 7.5  # the client's own TTL wins over the adaptive one ...
    assert table.pin_ttl(n2) == 7.5
    n2.session_ttl_s = 500.0  # ... up to max_ttl_s
    assert table.pin_ttl(n2) == 100.0
    assert table.stats()["programs_in_flight"] == 2.0


def test_a_programs_calls_are_counted_by_session_and_position():
    table = ProgramTable()

    def info():
        return {i.id: i for i in table.infos({})}

    gen = _req("g", session="p", position=0)
    table.arrive(gen)
    assert (info()["p"].calls, info()["p"].calls_served, info()["p"].last_position) == (1, 0, 0)
    table.leave(gen)
    assert "p" not in info()  # nothing in flight, nothing pinned: not listed
    # A select: three requests of one call; the first may finish before the others arrive.
    c0, c1, c2 = (_req(f"c{i}", session="p", position=1) for i in range(3))
    table.arrive(c0)
    table.leave(c0)
    table.arrive(c1)
    table.arrive(c2)
    p = info()["p"]
    assert (p.calls, p.calls_served, p.last_position, p.in_flight) == (2, 1, 1, 2)
    table.leave(c1)
    table.leave(c2)
    # A fork's two branches: a call each, at the same position.
    branches = [_req(f"b{i}", session=f"p.{i}", position=2) for i in range(2)]
    for b in branches:
        table.arrive(b)
    p = info()["p"]
    assert (p.calls, p.calls_served, p.last_position) == (4, 2, 2)
    # Without a position, each request is a call of its own.
    loose = [_req(f"x{i}", session="p") for i in range(2)]
    for r in loose:
        table.arrive(r)
    for r in branches + loose:
        table.leave(r)
    p = table.infos({"p": (64, 1)})[0]
    assert (p.calls, p.calls_served, p.last_position, p.in_flight) == (6, 6, 2, 0)
    assert (p.pinned_tokens, p.pinned_sessions) == (64, 1)  # listed while it holds a pin


def test_tokens_computed_again_are_not_service():
    """A session's next prompt repeats its last sequence: tokens of it computed again (the
    cache lost them, or the request was retracted) are not the program's service."""
    table = ProgramTable()
    first = _req("s0", n=8, session="p.0")
    table.arrive(first)
    table.serve(first, 0, 8)  # the prompt
    first.output_ids = [20, 21, 22]
    table.serve(first, 8, 9)  # decode steps give KV to every sample but the last
    table.serve(first, 9, 10)
    table.leave(first)
    assert table.service(first) == 10
    nxt = _req("s1", n=8, session="p.0")
    nxt.input_ids = list(range(1, 9)) + [20, 21, 22, 30, 31]
    table.arrive(nxt)
    assert nxt.program_seen == 10  # 1..8, 20, 21 had KV; 22 never did
    table.serve(nxt, 0, 13)  # the cache lost all of it
    assert table.service(nxt) == 10 + 3 and table.stats()["program_tokens_recomputed"] == 10
    table.serve(nxt, 0, 13)  # retracted and computed once more: all of it again
    table.serve(nxt, 13, 14)
    assert table.service(nxt) == 14 and table.stats()["program_tokens_recomputed"] == 23
    table.leave(nxt)
    other = _req("s2", n=6, session="p.0")  # a prompt that is not the sequence so far
    other.input_ids = [9, 9, 9, 9, 9, 9]
    table.arrive(other)
    table.serve(other, 0, 6)
    assert other.program_seen == 6 and table.service(other) == 20
    stranger = _req("t0", n=13, session="q.0")  # another program has seen nothing
    stranger.input_ids = list(nxt.input_ids)
    table.arrive(stranger)
    assert stranger.program_seen == 0


def test_a_program_whose_cache_was_flushed_is_charged_only_for_new_tokens(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512, schedule_policy="program")
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)
    rng = random.Random(7)
    prompt = [rng.randrange(1, 500) for _ in range(30)]
    s.handle(GenerateReq("a/0", prompt, sp, 0, session_id="a.0", program_position=0))
    out = run_to_end(s)["a/0"]
    (info,) = s.program_infos()
    assert info.service == 30 + 4 - 1
    # Its pin and its cached KV are gone (the session is not closed: it goes on).
    assert s.kv.sessions.close("a.0") and s.flush_cache()
    s.handle(GenerateReq("a/1", prompt + out + [5, 6], sp, 0, session_id="a.0"))
    run_to_end(s)
    (info,) = s.program_infos()
    stats = s.control("stats")
    assert stats["program_tokens_recomputed"] == 30 + 4 - 1
    assert info.service == (30 + 4 - 1) + (1 + 2 + 4 - 1)  # the last sample, 2 new, decodes
    s.check_invariants()


def test_fork_branches_and_the_call_after_a_select_repeat_what_their_program_computed():
    """A fork's branches (sessions of their own) repeat their parent's text, and the call after
    a select goes on from the chosen choice, which need not be the last to finish: what the
    program computed of either is not service when the cache has lost it."""
    table = ProgramTable()
    parent = _call(table, _req("p0", session="p", position=0, ids=list(range(1, 21))), [50, 51])
    branches = [
        _req(f"b{i}", session=f"p.{i}", position=1, ids=parent.tokens() + [60 + i] * 3)
        for i in range(2)
    ]
    for b in branches:
        table.arrive(b)
    assert [b.program_seen for b in branches] == [21, 21]  # all but the parent's last sample
    before = table.service(parent)
    for b in branches:
        table.serve(b, 0, b.prompt_len)  # the parent's text was evicted: computed again
    assert table.service(parent) - before == 2 * (1 + 3)
    assert table.stats()["program_tokens_recomputed"] == 2 * 21
    # A select's three choices: one call; the program picks the second, the third ends last.
    prompt = [7] * 10
    choices = [_req(f"c{i}", session="s", position=0, ids=prompt + [80 + i] * 4) for i in range(3)]
    for c in choices:
        _call(table, c, [90 + int(c.rid[1:])])
    nxt = _req("s1", session="s", position=1, ids=choices[1].tokens() + [5, 5, 5])
    table.arrive(nxt)
    assert nxt.program_seen == 14  # the second choice's prompt, not just the shared 10


def test_a_program_remembers_a_bounded_set_of_sequences_and_none_of_closed_sessions(
    tiny_model_dirs,
):
    table = ProgramTable()
    n = SEQUENCES_KEPT + 4
    for i in range(n):  # a fork of many branches
        _call(table, _req(f"b{i}", session=f"p.{i}", position=1, ids=[i + 1] * 8), [99])
    p = table.get(_req("x", session="p"))

    def sessions() -> list[str | None]:
        return [q.session for q in p.sequences]

    assert sessions() == [f"p.{i}" for i in range(4, n)]  # the oldest went first
    nxt = _req("b4.1", session="p.4", position=2, ids=[5] * 8 + [99, 3])
    _call(table, nxt, [98])
    assert sessions().count("p.4") == 1 and len(p.sequences) == SEQUENCES_KEPT  # replaced
    table.close_session("p.5")
    assert "p.5" not in sessions() and len(p.sequences) == SEQUENCES_KEPT - 1
    # Only the program policy orders by service: other policies remember no sequence.
    for name, remembers in (("program", True), ("lpm", False)):
        s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy=name)
        assert s.programs.remember is remembers
        sp = braid.SamplingParams(max_tokens=2, **GREEDY)
        s.handle(GenerateReq("a/0", list(range(1, 9)), sp, 0, session_id="a.1"))
        req = s.requests.get("a/0")
        run_to_end(s)
        assert len(s.programs.get(req).sequences) == int(remembers)
        s.close_session("a.1")
        assert s.programs.get(req).sequences == []


def test_an_aborted_request_leaves_only_what_was_computed_of_it():
    table = ProgramTable()
    first = _call(table, _req("a0", session="p", ids=list(range(1, 11))), [50, 51])
    nxt = _req("a1", session="p", ids=first.tokens() + list(range(60, 80)))
    table.arrive(nxt)
    assert nxt.program_seen == 11
    table.serve(nxt, 11, 16)  # one chunk, then the client aborts it
    nxt.finish_reason = "abort"
    table.leave(nxt)
    retry = _req("a2", session="p", ids=list(nxt.input_ids))
    table.arrive(retry)
    assert retry.program_seen == 16  # not the 31 tokens of its prompt but the last
    retry.finish_reason, retry.error = "abort", "grammar: refused"  # failed before computing
    table.leave(retry)
    again = _req("a3", session="p", ids=list(nxt.input_ids))
    table.arrive(again)
    assert again.program_seen == 16


class _Oracle(Proposer):
    """Drafts the tokens a plain run gave each request (by rid)."""

    name = "ORACLE"

    def __init__(self, futures: dict[str, list[int]]) -> None:
        self.futures = futures

    @classmethod
    def from_config(cls, config, target):  # built by the test itself
        raise NotImplementedError

    def propose(self, reqs, limits) -> list[list[int]]:
        return [
            self.futures.get(r.rid, [])[len(r.output_ids) : len(r.output_ids) + k]
            for r, k in zip(reqs, limits)
        ]


def test_a_verify_step_charges_the_drafts_it_keeps(tiny_model_dirs):
    """With speculative decoding a step keeps several tokens' KV: the program is charged for
    all of them, as for the same tokens decoded one a step."""
    cfg = dict(kv_tokens=512, schedule_policy="program", dtype="float32")
    sp = braid.SamplingParams(max_tokens=16, **GREEDY)
    prompt = list(range(3, 23))
    plain = local_scheduler(tiny_model_dirs["llama"], **cfg)
    plain.handle(GenerateReq("r", prompt, sp, 0, session_id="p"))
    want = run_to_end(plain)["r"]
    s = local_scheduler(tiny_model_dirs["llama"], speculative_algorithm="NGRAM", **cfg)
    s.proposer = s.decode.drafter.proposer = _Oracle({"r": want})
    s.kv.on_release = s.proposer.release
    s.handle(GenerateReq("r", prompt, sp, 0, session_id="p"))
    got = run_to_end(s)["r"]
    assert s.stats.spec_accepted_tokens > 8
    (info,) = s.program_infos()
    assert info.service == len(prompt) + len(got) - 1 == plain.program_infos()[0].service
    # The next call repeats the whole sequence but its last sample: nothing of it is new.
    s.handle(GenerateReq("r2", prompt + got + [5], sp, 0, session_id="p"))
    assert s.requests.get("r2").program_seen == len(prompt) + len(got) - 1
    s.abort_all()


def test_the_recompute_metric_says_what_it_counts():
    text = ServerMetrics().render({"program_tokens_recomputed": 3.0}, [])
    (help_line,) = [
        line
        for line in text.splitlines()
        if line.startswith("# HELP braid_program_tokens_recomputed_total")
    ]
    assert "overlap schedule" in help_line and "retraction" in help_line


def test_programs_are_listed_by_pinned_tokens_then_service():
    table = ProgramTable()
    for rid, program, service in (("a", "busy", 500), ("b", "idle-pinned", 10), ("c", "new", 0)):
        r = _req(rid, program=program)
        table.arrive(r)
        table.serve(r, 0, service)
        if program == "idle-pinned":
            table.leave(r)
    pinned = {"idle-pinned": (32, 1), "gone": (16, 2)}  # a pin outliving its program's entry
    infos = table.infos(pinned)
    assert [i.id for i in infos] == ["idle-pinned", "gone", "busy", "new"]
    assert [i.pinned_tokens for i in infos] == [32, 16, 0, 0]
    assert infos[1].calls == 0 and infos[1].pinned_sessions == 2
    assert infos[2].service == 500 and infos[2].in_flight == 1


def test_releasable_pages_leave_out_what_a_running_request_holds():
    alloc = PageAllocator(129, 1)
    cache = RadixCache(alloc)
    pins = SessionPins(cache, max_pages=64)
    shared, own = [1] * 8, [1] * 8 + [2] * 4
    cache.insert(own, alloc.alloc(12))
    cache.insert([3] * 6, alloc.alloc(6))
    pins.pin("a", own)
    pins.pin("b", [3] * 6)
    assert pins.releasable_pages() == 18 == pins.pinned_pages
    running = cache.match_prefix(shared).node  # a request whose prefix is a's first 8 pages
    cache.lock(running)
    assert pins.releasable_pages() == 10  # a's last 4 and b's 6: the shared 8 stay held
    pins.pin("c", shared)  # a second pin on the shared pages changes nothing
    assert pins.releasable_pages() == 10
    cache.unlock(running)
    assert pins.releasable_pages() == 18


def test_pins_are_counted_per_program():
    alloc = PageAllocator(129, 1)
    cache = RadixCache(alloc)
    pins = SessionPins(cache, max_pages=64)
    for token, session, program, n in (
        (1, "p", None, 8),
        (2, "p.0", None, 4),
        (3, "s", "agent", 6),
    ):
        tokens = [token] * n
        cache.insert(tokens, alloc.alloc(n))
        pins.pin(session, tokens, program=program)
    assert pins.by_program() == {"p": (12, 2), "agent": (6, 1)}  # (pages, sessions)
    pins.close("p.0")
    assert pins.by_program() == {"p": (8, 1), "agent": (6, 1)}


def test_a_program_ended_with_requests_in_flight_ends_when_the_last_leaves():
    table = ProgramTable(clock=Clock())
    a, b = _req("a", program="p", position=0), _req("b", program="p", position=0)
    table.arrive(a)
    table.arrive(b)
    assert table.end("p")  # known: it ends once its requests are done
    assert not table.end("p")  # told once
    assert table.stats()["programs_known"] == 1 and table.ended == 0
    table.leave(a)
    assert table.stats()["programs_known"] == 1
    table.leave(b)
    assert table.stats()["programs_known"] == 0 and table.ended == 1
    assert not table.end("p") and not table.end("unknown")
    # A request arriving after the end (not yet done) means the program goes on.
    c, d = _req("c", program="q", position=0), _req("d", program="q", position=1)
    table.arrive(c)
    table.serve(c, 0, 40)
    assert table.end("q")
    table.arrive(d)
    table.leave(c)
    table.leave(d)
    assert table.stats()["programs_known"] == 1 and table.service(d) == 40


def test_closing_a_root_session_releases_its_forks_pins(tiny_model_dirs):
    """A client that closes only a program's root session leaves no fork pinned (nor a
    session of another program whose name starts alike)."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512, schedule_policy="program")
    sp = braid.SamplingParams(max_tokens=2, **GREEDY)
    rng = random.Random(8)
    for session in ("trip", "trip.0", "trip.1", "trip.0.0", "tripod"):
        prompt = [rng.randrange(1, 500) for _ in range(24)]
        s.handle(GenerateReq(f"r-{session}", prompt, sp, 0, session_id=session))
    run_to_end(s)
    assert s.control("stats")["pinned_sessions"] == 5
    assert s.close_session("trip")
    assert s.control("stats")["pinned_sessions"] == 1  # "tripod" only
    assert [i.id for i in s.program_infos()] == ["tripod"]
    s.check_invariants()


def test_a_session_closed_while_its_request_runs_pins_nothing_when_it_ends(tiny_model_dirs):
    """Closing a session (or its root) while one of its requests runs leaves no pin behind
    when that request ends; a fork's close does not reach its siblings, and a later request
    of the same session pins again."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512, schedule_policy="program")
    sp = braid.SamplingParams(max_tokens=6, **GREEDY)
    rng = random.Random(9)

    def send(rid: str, session: str) -> None:
        prompt = [rng.randrange(1, 500) for _ in range(24)]
        s.handle(GenerateReq(rid, prompt, sp, 0, session_id=session))

    for session in ("solo", "root.0", "root.1", "pair.0", "pair.1"):
        send(f"r-{session}", session)
    s.step()  # admitted and running
    assert s.requests.count(*ACTIVE) == 5
    assert not s.close_session("solo")  # nothing was pinned yet
    assert not s.close_session("root")
    assert not s.close_session("pair.0")
    run_to_end(s)
    stats = s.control("stats")
    assert stats["pinned_sessions"] == 1 and list(s.kv.sessions._pins) == ["pair.1"], stats
    send("r-solo-again", "solo")
    run_to_end(s)
    assert list(s.kv.sessions._pins) == ["pair.1", "solo"]
    s.check_invariants()


def test_check_invariants_counts_each_pins_lock(tiny_model_dirs):
    """A pin holds one lock on its path: check_invariants fails when that lock is lost and
    when a lock no request or pin holds is left behind."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256)
    sp = braid.SamplingParams(max_tokens=2, **GREEDY)
    s.handle(GenerateReq("a", list(range(1, 25)), sp, 0, session_id="a"))
    run_to_end(s)
    (node,) = s.kv.sessions.nodes()
    s.kv.cache.unlock(node)  # the pin's lock lost
    with pytest.raises(AssertionError):
        s.check_invariants()
    s.kv.cache.lock(node)
    s.check_invariants()
    s.kv.cache.lock(node)  # a lock nobody holds
    with pytest.raises(AssertionError):
        s.check_invariants()
    s.kv.cache.unlock(node)
    assert s.close_session("a")
    s.check_invariants()


def test_a_schedulers_program_list_shows_positions_service_and_pins(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512, schedule_policy="program")
    sp = braid.SamplingParams(max_tokens=3, **GREEDY)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 500) for _ in range(24)]
    s.handle(GenerateReq("agent/0", prompt, sp, 0, session_id="agent", program_position=0))
    (info,) = s.program_infos()
    assert (info.id, info.in_flight, info.calls, info.last_position) == ("agent", 1, 1, 0)
    run_to_end(s)
    (info,) = s.program_infos()  # listed for its pin, with nothing in flight
    assert (info.in_flight, info.calls_served, info.pinned_sessions) == (0, 1, 1)
    assert info.pinned_tokens == s.control("stats")["pinned_tokens"] >= 24
    assert info.service == 24 + 3 - 1  # the prompt, then a decode step per later token
    # The next call sends two requests (a select's choices), both at position 1.
    for k in range(2):
        ids = prompt + [7, 8, k + 1]
        s.handle(GenerateReq(f"agent/1/{k}", ids, sp, 0, session_id="agent", program_position=1))
    run_to_end(s)
    (info,) = s.program_infos()
    assert (info.calls, info.calls_served, info.last_position) == (2, 2, 1)
    with pytest.raises(ValueError, match="program_position"):
        s.handle(GenerateReq("bad", prompt, sp, 0, session_id="agent", program_position=-1))
    assert s.close_session("agent")  # the program's end
    assert s.program_infos() == [] and s.control("stats")["pinned_programs"] == 0
    s.check_invariants()


def test_program_policy_breaks_a_levels_tie_by_the_cached_prefix():
    """Two programs at one level: the one whose context is still cached goes first, though it
    started waiting later; a program at a lower level still goes before both."""
    alloc = PageAllocator(257, 1)
    cache = RadixCache(alloc)
    table = ProgramTable(clock=Clock())
    fresh, warm, light = (
        _req("fresh", n=40, program="a"),
        _req("warm", program="b", ids=[7] * 40),
        _req("light", n=40, program="c"),
    )
    cache.insert([7] * 30, alloc.alloc(30))  # b's context so far
    for r, service in ((fresh, 300), (warm, 300), (light, 0)):  # a and b: level 1
        table.arrive(r)
        table.serve(r, 0, service)
    order = policy.candidates([fresh, warm, light], cache, create_policy("program"), table, now=0.0)
    assert [c.req.rid for c in order] == ["light", "warm", "fresh"]
    assert order[1].matched_tokens == 30
    many = [_req(f"q{i}", program=f"p{i}") for i in range(lpm.LPM_MAX_QUEUE + 1)]
    for r in many:  # level 1 too
        table.arrive(r)
        table.serve(r, 0, 300)
    order = policy.candidates(many + [warm], cache, create_policy("program"), table, now=0.0)
    assert order[0].req is warm  # prefixes are looked up however long the queue


def test_program_policy_orders_by_attained_service_keeps_programs_together_and_ages():
    alloc = PageAllocator(257, 1)
    cache = RadixCache(alloc)
    clock = Clock()
    table = ProgramTable(clock=clock)
    heavy1, light, heavy2, loner = (
        _req("h1", program="heavy"),
        _req("l1", program="light"),
        _req("h2", program="heavy"),
        _req("solo"),
    )
    for r in (heavy1, light, heavy2, loner):
        table.arrive(r)
    table.serve(heavy1, 0, 5000)  # level 3
    table.serve(light, 0, 100)  # level 0
    waiting = [heavy1, light, heavy2, loner]
    order = [
        c.req.rid
        for c in policy.candidates(waiting, cache, create_policy("program"), table, now=0.0)
    ]
    # light and the lone request are level 0 (light waited first); heavy's two stay together.
    assert order == ["l1", "solo", "h1", "h2"]
    # Aging: after 3 levels' worth of waiting, heavy is level 0 too and came first.
    for r in waiting:
        r.waiting_since = 0.0
    heavy1.waiting_since = -3 * program_policy.PROGRAM_AGING_S
    order = [
        c.req.rid
        for c in policy.candidates(waiting, cache, create_policy("program"), table, now=0.0)
    ]
    assert order == ["h1", "h2", "l1", "solo"]
    assert [c.req.rid for c in policy.candidates(waiting, cache, create_policy("fcfs"))] == [
        "h1",
        "l1",
        "h2",
        "solo",
    ]


@pytest.mark.parametrize("policy_name", ["program", "lpm"])
def test_a_calls_branches_are_admitted_together_or_wait_together(tiny_model_dirs, policy_name):
    """Under `program` the three branches of one fork call (one program, one position) go in
    together: while a runner runs and the pool holds two of them but not three, none goes in
    (lpm admits two), and the step after the runner ends admits all three. With nothing else
    running, a call too large for the pool goes in as far as it fits (no stall)."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy=policy_name)
    rng = random.Random(21)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    s.handle(GenerateReq("runner", ids(100), braid.SamplingParams(max_tokens=40, **GREEDY), 0))
    s.step()
    sp = braid.SamplingParams(max_tokens=2, **GREEDY)
    for i in range(3):
        s.handle(GenerateReq(f"g/{i}", ids(50), sp, 0, session_id=f"g.{i}", program_position=1))
    running = s.requests.view(ReqStatus.RUNNING)
    branches = s.requests.view(ReqStatus.WAITING)
    assert [r.rid for r in running] == ["runner"] and len(branches) == 3
    assert s.prefill.fits(100, running + branches[:2])  # two fit beside the runner ...
    assert not s.prefill.fits(150, running + branches)  # ... three do not
    assert s.prefill.admits_now() is (policy_name == "lpm")

    def waiting() -> set[str]:
        return {r.rid for r in s.requests.view(ReqStatus.WAITING)}

    while waiting() == {"g/0", "g/1", "g/2"}:  # until a step admits some
        runner_ran = s.requests.get("runner") is not None
        s.step()
        s.check_invariants()
    if policy_name == "lpm":
        assert runner_ran and waiting() == {"g/2"}  # two went in beside the runner
    else:
        assert not runner_ran and not waiting()  # all three, once the runner had ended
    run_to_end(s)
    for i in range(3):  # alone, three that cannot fit together still all run
        s.handle(GenerateReq(f"h/{i}", ids(100), sp, 0, session_id=f"g.{i}", program_position=2))
    assert set(run_to_end(s)) == {"h/0", "h/1", "h/2"}


def test_pins_give_way_to_a_call_at_the_head_as_to_one_request(tiny_model_dirs):
    """Two paused programs hold pins; a runner runs. A fork call of two branches that fits
    only once the pins go is at the head of the order: the pins give way to it and both
    branches go in together, in one step, beside the runner."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512, schedule_policy="program")
    rng = random.Random(3)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    sp = braid.SamplingParams(max_tokens=2, **GREEDY)
    for session in ("x", "y"):
        s.handle(GenerateReq(f"pin-{session}", ids(110), sp, 0, session_id=session))
    run_to_end(s)
    assert s.control("stats")["pinned_sessions"] == 2
    s.handle(GenerateReq("runner", ids(100), braid.SamplingParams(max_tokens=60, **GREEDY), 0))
    s.step()
    for i in range(2):
        s.handle(GenerateReq(f"g/{i}", ids(90), sp, 0, session_id=f"g.{i}", program_position=1))
    branches = s.requests.view(ReqStatus.WAITING)
    running = s.requests.view(ReqStatus.RUNNING)
    assert not s.prefill.fits(180, running + branches)  # not without the pins' room
    while {r.rid for r in s.requests.view(ReqStatus.WAITING)} == {"g/0", "g/1"}:
        s.step()
        s.check_invariants()
    assert not s.requests.view(ReqStatus.WAITING)  # both went in, in one step ...
    assert s.requests.get("runner") is not None  # ... beside the runner
    assert s.control("stats")["pins_released_for_room"] >= 1
    run_to_end(s)


def test_a_calls_output_counts_once_all_its_requests_have_finished():
    """srpt's mean output per call: a call of two samples counts once both have finished,
    with their output together."""
    table = ProgramTable(clock=Clock())
    a = _req("s/0/0", session="s", position=0, max_new=64)
    b = _req("s/0/1", session="s", position=0, max_new=64)
    table.arrive(a)
    table.arrive(b)
    finish = [(a, 3), (b, 5)]
    nxt = _req("s/1", session="s", position=1, max_new=64)
    for r, out in finish:
        r.output_ids = [7] * out
        r.finish_reason = "stop"
        table.leave(r)
        if r is a:  # one sample done: the call is not served, nothing counted yet
            assert table.get(a).decoded == 0 and table.get(a).calls_served == 0
    table.arrive(nxt)
    assert table.get(nxt).decoded == 8 and table.get(nxt).calls_served == 1
    assert table.remaining_work(nxt, 0) == 8.0  # no ended program: this call only


def test_program_srpt_orders_by_predicted_remaining_work_and_ages():
    """`program-srpt`: a program's remaining work is its output per served call times the
    calls the ended programs suggest it has left, plus a tenth per uncached prompt token; the
    program predicted to need least goes first, and waiting lowers a program's key."""
    alloc = PageAllocator(257, 1)
    cache = RadixCache(alloc)
    table = ProgramTable(clock=Clock())
    for calls, pid in ((2, "e1"), (4, "e2"), (6, "e3")):  # ended programs: 2, 4 and 6 calls
        for k in range(calls):
            _call(table, _req(f"{pid}/{k}", program=pid, position=k), [5])
        assert table.end(pid)
    assert table.calls_left(0) == 4.0  # (2 + 4 + 6) / 3
    assert table.calls_left(2) == 3.0  # (4 - 2 + 6 - 2) / 2
    assert table.calls_left(6) == 1.0  # no ended program went further: this call only

    def served(pid: str, outputs: list[int]) -> Req:
        """A program that has had one call served per entry of `outputs` (its tokens), then
        sends the next, which waits."""
        for k, out in enumerate(outputs):
            _call(table, _req(f"{pid}/{k}", program=pid, position=k, max_new=64), [7] * out)
        nxt = _req(f"{pid}/{len(outputs)}", program=pid, position=len(outputs), max_new=64)
        table.arrive(nxt)
        return nxt

    chatty = served("chatty", [40])  # 40 a call, about 3 calls left
    terse = served("terse", [2])
    late = served("late", [10] * 5)  # past every ended program but the longest
    new = _req("new/0", program="new", position=0, max_new=64)
    table.arrive(new)
    assert table.remaining_work(chatty, 0) == 40 + 2 * 40
    assert table.remaining_work(terse, 0) == 2 + 2 * 2
    assert table.remaining_work(late, 0) == 10.0
    assert table.remaining_work(terse, 100) == 6 + 100 * PREFILL_WEIGHT
    prior = table.remaining_work(new, 0) / table.calls_left(0)  # every program's output a call
    assert 1 < prior < 40
    capped = _req("capped", program="capped", max_new=1)
    table.arrive(capped)
    assert table.remaining_work(capped, 0) == 4 * 1  # this call's and 3 more, at most 1 each
    # A request of no program expects no later call: its own output and prompt only.
    assert table.remaining_work(_req("plain", max_new=9), 20) == 9 + 20 * PREFILL_WEIGHT

    waiting = [chatty, new, late, terse]
    order = policy.candidates(waiting, cache, create_policy("program-srpt"), table, now=0.0)
    assert [c.req.rid for c in order] == ["terse/1", "late/5", "new/0", "chatty/1"]
    # chatty has waited long enough to halve its work five times: it goes first.
    chatty.waiting_since = -5 * program_srpt.SRPT_AGING_S
    order = policy.candidates(waiting, cache, create_policy("program-srpt"), table, now=0.0)
    assert order[0].req is chatty


# ---- the policy in a running scheduler, against a reference simulation -------------------------
# Heavy programs generate many tokens per step, light ones few: least attained service lets
# the light programs through first; fcfs does not.
WORKLOAD = {  # program -> (steps, new prompt tokens per step, output tokens per step)
    "H1": (3, 10, 150),
    "H2": (3, 10, 150),
    "L1": (4, 6, 4),
    "L2": (4, 6, 4),
    "L3": (4, 6, 4),
}


def _drive(
    s,
    seed: int,
    clock: Clock | None = None,
    on_step=None,
    workload: dict[str, tuple[int, int, int]] | None = None,
):
    """Run `workload` (WORKLOAD if None) on scheduler `s`: each program's next step is sent when
    its previous one finishes, its prompt the program's text so far plus new tokens. Returns
    (the order programs finished in, each step's output tokens, the requests each scheduler
    step computed, in the order it returned them)."""
    workload = WORKLOAD if workload is None else workload
    rngs = {p: random.Random(f"{seed}/{p}") for p in workload}  # a step's tokens: not order's
    context = {p: [] for p in workload}
    step_no = {p: 0 for p in workload}
    outputs: dict[tuple[str, int], list[int]] = {}
    done: list[str] = []
    batches: list[list[str]] = []

    def send(p: str) -> None:
        steps, new, out = workload[p]
        context[p] = context[p] + [rngs[p].randrange(1, 500) for _ in range(new)]
        sp = braid.SamplingParams(max_tokens=out, **GREEDY)
        s.handle(GenerateReq(f"{p}/{step_no[p]}", list(context[p]), sp, 0, session_id=p))

    for p in workload:
        send(p)
    while s.has_work:
        outs = s.step()
        batches.append([out.rid for out in outs])
        for out in outs:
            outputs.setdefault(tuple(out.rid.split("/")), []).extend(out.new_token_ids)
            if out.finish_reason:
                p, k = out.rid.split("/")
                context[p] += outputs[(p, k)]
                step_no[p] += 1
                if step_no[p] < workload[p][0]:
                    send(p)
                else:
                    done.append(p)
        if clock is not None:
            clock.now += 0.1
        if on_step is not None:
            on_step()
        s.check_invariants()
    return done, outputs, batches


def _simulate(
    workload: dict[str, tuple[int, int, int]], rows: int, policy_name: str = "program"
) -> tuple[list[str], list[list[str]]]:
    """The scheduler's steps under `policy_name` ("program" or "fcfs") with `rows` requests
    running at once, from the workload alone: (the order programs finish in, the requests each
    step computes, in the order the step returns them). The pool holds every program's context,
    programs share no prefix (their tokens are drawn apart) and a step's prompts fit the
    prefill budget: nothing is evicted, chunked or retracted, and a program's cached prefix is
    its own.

    A step admits waiting requests in policy order into the free rows (an extend, sampling
    each one's first token) unless the step before was an extend and requests run: then, or
    when nothing can be admitted, it is a decode step of every running request, one token
    each (mixed chunks are off: an extend decodes none of them). A request finishes at its
    max_tokens, in the step's order, and its program's next step joins the queue behind those
    waiting.

    `program`: service = the prompt tokens a prefill computes (the new ones, and the previous
    output's last token, which has no KV yet) + one per decode step; no aging; within a
    level, the longest cached prefix first (a program's sequence so far less its last sample,
    none before its first step); then queue order. `fcfs`: queue order."""
    service = {p: 0 for p in workload}
    context = {p: 0 for p in workload}  # the program's tokens so far
    step_no = {p: 0 for p in workload}
    waiting = list(workload)  # arrival order
    running: dict[str, int] = {}  # request -> tokens it has yet to generate, admission order
    extended = False
    done, steps = [], []

    def key(p: str) -> tuple[int, int, int]:
        level = sum(service[p] >= t for t in program_policy.PROGRAM_LEVELS)  # thresholds passed
        cached = context[p] - 1 if step_no[p] else 0
        return level, -cached, waiting.index(p)

    while waiting or running:
        extended = not (extended and running) and bool(waiting) and len(running) < rows
        if extended:
            order = sorted(waiting, key=key) if policy_name == "program" else waiting
            admitted = order[: rows - len(running)]
            for p in admitted:
                waiting.remove(p)
                new, out = workload[p][1:]
                service[p] += new + (1 if step_no[p] else 0)
                context[p] += new
                running[f"{p}/{step_no[p]}"] = out
            batch = [f"{p}/{step_no[p]}" for p in admitted]
        else:
            batch = list(running)
            for rid in batch:
                service[rid.split("/")[0]] += 1
        steps.append(batch)
        for rid in batch:
            running[rid] -= 1
            if running[rid]:
                continue
            del running[rid]
            p = rid.split("/")[0]
            context[p] += workload[p][2]
            step_no[p] += 1
            if step_no[p] < workload[p][0]:
                waiting.append(p)
            else:
                done.append(p)
    return done, steps


def _one_at_a_time(tiny_model_dirs, policy_name: str):
    """A scheduler that runs one request at a time under `policy_name`."""
    return local_scheduler(
        tiny_model_dirs["llama"],
        kv_tokens=4096,
        max_running_requests=1,
        schedule_policy=policy_name,
    )


@pytest.fixture(scope="module")
def fcfs_run(tiny_model_dirs):
    done, outputs, _ = _drive(_one_at_a_time(tiny_model_dirs, "fcfs"), seed=1)
    return done, outputs


def test_program_policy_finishes_programs_as_the_simulation_predicts(
    tiny_model_dirs, fcfs_run, monkeypatch
):
    monkeypatch.setattr(program_policy, "PROGRAM_AGING_S", 1e9)  # the reference has no aging
    s = _one_at_a_time(tiny_model_dirs, "program")
    done, outputs, _ = _drive(s, seed=1)
    expected, _ = _simulate(WORKLOAD, rows=1)
    assert done == expected
    assert done[:3] == ["L1", "L2", "L3"]  # the light programs are not stuck behind heavy ones
    fcfs_done, fcfs_outputs = fcfs_run
    assert fcfs_done != done  # fcfs interleaves by arrival: a heavy program finishes earlier
    assert outputs == fcfs_outputs  # the same tokens, in another order
    stats = s.control("stats")
    assert stats["programs_known"] == len(WORKLOAD) and stats["programs_in_flight"] == 0


def test_program_srpt_finishes_the_light_programs_first_with_fcfs_tokens(tiny_model_dirs, fcfs_run):
    """Before any program has ended, each program's first call is predicted by its max_tokens
    and its later calls by its own output: the light programs finish before either heavy one,
    with the tokens fcfs gave."""
    s = _one_at_a_time(tiny_model_dirs, "program-srpt")
    done, outputs, _ = _drive(s, seed=1)
    assert sorted(done[:3]) == ["L1", "L2", "L3"] and sorted(done[3:]) == ["H1", "H2"]
    fcfs_done, fcfs_outputs = fcfs_run
    assert fcfs_done[:3] != done[:3]
    assert outputs == fcfs_outputs


# Eight programs on three rows. The heavy ones (long prompts, long outputs) pass the first
# service level after two steps, the medium and light ones never do; within a level a program
# whose context is cached goes before one that has not started.
CONCURRENT = {
    "H1": (3, 120, 40),
    "L1": (4, 6, 4),
    "H2": (3, 120, 40),
    "M1": (4, 30, 12),
    "L2": (4, 6, 4),
    "H3": (2, 120, 40),
    "L3": (4, 6, 4),
    "M2": (3, 30, 12),
}
ROWS = 3


def test_program_policy_with_concurrent_programs_finishes_as_the_simulation_predicts(
    tiny_model_dirs, monkeypatch
):
    """With more programs than rows, every step (which requests it admits or decodes, so the
    step each program finishes at) is the simulation's, under `program` and under fcfs; the
    two orders differ, the tokens do not."""
    monkeypatch.setattr(program_policy, "PROGRAM_AGING_S", 1e9)  # the reference has no aging

    def run(policy_name: str):
        s = local_scheduler(
            tiny_model_dirs["llama"],
            device="cpu",  # float32, and no overlap schedule: a step returns its own tokens
            kv_tokens=4096,
            max_running_requests=ROWS,
            schedule_policy=policy_name,
        )
        return _drive(s, seed=1, workload=CONCURRENT)

    done, outputs, steps = run("program")
    expected_done, expected_steps = _simulate(CONCURRENT, ROWS)
    assert done == expected_done
    assert steps == expected_steps
    assert sorted(done[-3:]) == ["H1", "H2", "H3"]  # the heavy programs finish last
    fcfs_done, fcfs_outputs, fcfs_steps = run("fcfs")
    assert fcfs_steps == _simulate(CONCURRENT, ROWS, "fcfs")[1]  # the steps' model holds there too
    assert fcfs_done != done
    assert outputs == fcfs_outputs  # the same tokens, in another order


def test_a_waiting_heavy_program_is_not_starved_by_a_stream_of_light_ones(
    tiny_model_dirs, monkeypatch
):
    """A heavy program's next step waits behind an endless stream of fresh light programs:
    without aging it is never admitted while they keep coming; with aging the program
    finishes, within the bound its level gap sets."""

    def run(aging_s: float) -> tuple[int | None, int | None]:
        """(the step heavy/1 was admitted at, the step it finished at), None for never."""
        monkeypatch.setattr(program_policy, "PROGRAM_AGING_S", aging_s)
        s = local_scheduler(
            tiny_model_dirs["llama"],
            kv_tokens=4096,
            max_running_requests=1,
            schedule_policy="program",
        )
        clock = Clock()
        s.requests.clock = clock
        sp_heavy = braid.SamplingParams(max_tokens=300, **GREEDY)
        s.handle(GenerateReq("heavy/0", list(range(1, 11)), sp_heavy, 0, session_id="heavy"))
        fresh = iter(range(10_000))

        def light() -> None:
            sp = braid.SamplingParams(max_tokens=3, **GREEDY)
            i = next(fresh)
            s.handle(GenerateReq(f"light{i}/0", [7, 8, 9, i % 400 + 1], sp, 0, session_id=f"l{i}"))

        light()
        light()
        admitted_at = finished_at = None
        tokens = []  # heavy/1's
        for n in range(400):
            for out in s.step():
                if out.rid == "heavy/1":
                    tokens += out.new_token_ids
                if out.finish_reason and out.rid == "heavy/1":
                    finished_at = n
                    assert out.error is None and len(tokens) == 5
                elif out.finish_reason and out.rid == "heavy/0":
                    s.handle(
                        GenerateReq(
                            "heavy/1",
                            list(range(1, 11)) + [5],
                            braid.SamplingParams(max_tokens=5, **GREEDY),
                            0,
                            session_id="heavy",
                        )
                    )
                elif out.finish_reason:
                    light()  # the stream never ends
            clock.now += 0.1
            if admitted_at is None and s.requests.get("heavy/1") is not None:
                if s.requests.get("heavy/1").status.value != "waiting":
                    admitted_at = n
        s.abort_all()
        return admitted_at, finished_at

    assert run(1e9) == (None, None)  # starved: the light stream always wins
    # Service after step 0: ~310 tokens, level 1: one PROGRAM_AGING_S of waiting (5 steps of
    # 0.1 s) lifts it to level 0, then it waits for the request running to finish (3 tokens)
    # and runs its 5 tokens alone (one request at a time).
    admitted, finished = run(0.5)
    assert admitted is not None and admitted < 300 + 5 + 3 + 5
    assert finished is not None and finished <= admitted + 5


# ---- pins across tool calls ---------------------------------------------------------------
def test_pins_follow_their_ttl_and_give_way_to_running_requests():
    alloc = PageAllocator(129, 1)
    cache = RadixCache(alloc)
    clock = Clock()
    pins = SessionPins(cache, max_pages=64, ttl_s=100.0, clock=clock)
    for s, ttl in (("a", 5.0), ("b", 50.0), ("c", 500.0)):
        tokens = [ord(s)] * 8
        cache.insert(tokens, alloc.alloc(8))
        pins.pin(s, tokens, ttl)
    clock.now = 6.0
    assert pins.expire() == 1 and pins.expired == 1  # a's 5 s are up
    assert pins.release_soonest() and pins.released_for_room == 1  # b before c
    assert pins.nodes() == [cache.match_prefix([ord("c")] * 8).node]
    clock.now = 99.0
    assert pins.expire() == 0  # c's TTL was capped at the table's 100 s
    clock.now = 101.0
    assert pins.expire() == 1 and len(pins) == 0


def test_a_pinned_step_survives_a_flood_within_its_ttl_and_not_after(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy="program")
    clock = Clock()
    s.kv.sessions.clock = clock
    s.programs.clock = clock
    rng = random.Random(4)
    agent = [rng.randrange(1, 500) for _ in range(40)]  # its pin: at most 64 pages
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)

    def run(rid: str, ids: list[int], session: str | None = None) -> Req:
        s.handle(GenerateReq(rid, ids, sp, 0, session_id=session))
        req = s.requests.get(rid)
        while s.has_work:
            s.step()
            s.check_invariants()
        return req

    step0 = run("agent/0", agent, "agent")
    assert s.control("stats")["pinned_tokens"] >= 40

    def flood(tag: str) -> None:
        for i in range(8):  # 8 x 40 tokens through a 256-token pool
            run(f"{tag}{i}", [rng.randrange(1, 500) for _ in range(40)])

    flood("a")
    nxt = agent + step0.output_ids + [9, 9]
    hit = run("agent/1", nxt, "agent")
    assert hit.cached_tokens >= 40  # the pin held through the flood
    clock.now += PIN_TTL_FIRST_S + 1  # the tool call took longer than the pin lasts
    flood("b")
    assert s.control("stats")["pins_expired"] >= 1
    late = run("agent/2", nxt + hit.output_ids + [3], "agent")
    assert late.cached_tokens < 40


def test_a_pin_gives_way_to_a_waiting_request_when_nothing_else_would_free_room(
    tiny_model_dirs,
):
    """A long prompt waits ahead of the pinned program's next call and needs the pin's room,
    with nothing running: the pin gives way at once (the scheduler used to stall)."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy="fcfs")
    rng = random.Random(9)
    agent = [rng.randrange(1, 500) for _ in range(40)]
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)
    s.handle(GenerateReq("agent/0", agent, sp, 0, session_id="agent"))
    step0 = s.requests.get("agent/0")
    run_to_end(s)
    long = [rng.randrange(1, 500) for _ in range(230)]
    s.handle(GenerateReq("long", long, sp, 0))
    s.handle(GenerateReq("agent/1", agent + step0.output_ids + [9], sp, 0, session_id="agent"))
    tokens = run_to_end(s)
    assert len(tokens["long"]) == len(tokens["agent/1"]) == 4
    assert s.control("stats")["pins_released_for_room"] == 1


def _finish_order(s) -> list[str]:
    """Step `s` until idle, checking its accounting each step; the requests in the order
    they finished."""
    finished = []
    while s.has_work:
        finished += [out.rid for out in s.step() if out.finish_reason]
        s.check_invariants()
    return finished


def test_a_pin_gives_way_to_the_head_of_the_queue_while_others_run(tiny_model_dirs):
    """A 170-token prompt fits beside a running request only in the pinned program's room:
    it is admitted while that request still runs, and the pin goes (a pin used to keep the
    queue's head waiting for as long as anything ran: under a queue, pins holding half the
    pool for paused programs halved what could run)."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy="fcfs")
    rng = random.Random(12)
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)
    s.handle(GenerateReq("agent/0", [rng.randrange(1, 500) for _ in range(40)], sp, 0, "agent"))
    run_to_end(s)
    assert s.control("stats")["pinned_tokens"] >= 40
    runner = braid.SamplingParams(max_tokens=40, **GREEDY)
    s.handle(GenerateReq("runner", [rng.randrange(1, 500) for _ in range(20)], runner, 0))
    s.step()  # the runner is admitted and runs
    s.handle(GenerateReq("big", [rng.randrange(1, 500) for _ in range(170)], sp, 0))
    finished = _finish_order(s)
    assert finished == ["big", "runner"]  # big did not wait for the runner's end
    stats = s.control("stats")
    assert stats["pins_released_for_room"] == 1 and stats["retractions"] == 0


@pytest.mark.parametrize("agent_tokens,kept", [(4, True), (23, False)])
def test_under_srpt_a_pin_gives_way_only_to_a_request_predicted_to_need_less(
    tiny_model_dirs, agent_tokens, kept
):
    """The same queue as above under program-srpt: a new program's 170-token prompt is
    predicted 4 output tokens plus a tenth of its uncached prompt (21). A paused agent that
    decodes 4 tokens a call is predicted less and keeps its pin (srpt would serve it first:
    evicting its context would have it computed again), so the prompt waits for the runner;
    one that decodes 23 a call gives way, as under fcfs."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy="program-srpt")
    rng = random.Random(12)
    sp = braid.SamplingParams(max_tokens=agent_tokens, **GREEDY)
    s.handle(GenerateReq("agent/0", [rng.randrange(1, 500) for _ in range(40)], sp, 0, "agent"))
    run_to_end(s)
    assert s.control("stats")["pinned_sessions"] == 1
    assert s.programs.paused_work("agent") == pytest.approx(agent_tokens)
    runner = braid.SamplingParams(max_tokens=40, **GREEDY)
    s.handle(GenerateReq("runner", [rng.randrange(1, 500) for _ in range(20)], runner, 0))
    s.step()  # the runner is admitted and runs
    big = [rng.randrange(1, 500) for _ in range(170)]
    sp4 = braid.SamplingParams(max_tokens=4, **GREEDY)
    s.handle(GenerateReq("big", big, sp4, 0, program_id="big", program_position=0))
    # The overlap schedule's question (may a prefill admit now?) gets the same answer.
    assert s.prefill.admits_now() is not kept
    finished = _finish_order(s)
    stats = s.control("stats")
    if kept:
        assert finished == ["runner", "big"] and stats["pins_released_for_room"] == 0
        assert stats["pinned_sessions"] == 1
    else:
        assert finished == ["big", "runner"] and stats["pins_released_for_room"] == 1
    assert stats["retractions"] == 0


def test_under_srpt_a_kept_pin_gives_way_once_nothing_else_would_free_the_room(tiny_model_dirs):
    """The kept pin of a short agent does not give way to a longer new program while a runner
    runs; once the runner is done, nothing else would free the room the 215-token prompt
    needs, and the kept pin goes (the scheduler must not stall)."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy="program-srpt")
    rng = random.Random(13)
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)
    s.handle(GenerateReq("agent/0", [rng.randrange(1, 500) for _ in range(40)], sp, 0, "agent"))
    run_to_end(s)
    runner = braid.SamplingParams(max_tokens=20, **GREEDY)
    s.handle(GenerateReq("runner", [rng.randrange(1, 500) for _ in range(20)], runner, 0))
    s.step()
    big = [rng.randrange(1, 500) for _ in range(215)]
    s.handle(GenerateReq("big", big, sp, 0, program_id="big", program_position=0))
    finished = _finish_order(s)
    stats = s.control("stats")
    assert finished == ["runner", "big"] and stats["pins_released_for_room"] == 1
    assert stats["pinned_sessions"] == 0 and stats["retractions"] == 0


def test_programs_under_way_are_counted_and_capped_by_the_kv_they_reach():
    table = ProgramTable()
    assert table.program_cap(1000) is None  # no program has ended: nothing to size it by
    a0 = _req("a/0", n=100, session="a", position=0)
    table.arrive(a0)
    assert table.starts(a0) and table.under_way(()) == 0  # waiting, never admitted
    table.admitted(a0, 30)  # its first 30 tokens were cached (a shared system prompt)
    assert not table.starts(a0) and table.under_way(()) == 1
    a0.output_ids, a0.finish_reason = [7] * 20, "stop"
    table.leave(a0)
    assert table.under_way(()) == 0 and table.under_way({"a"}) == 1  # paused: only if pinned
    a1 = _req("a/1", session="a", position=1, ids=a0.tokens() + [8] * 30)
    table.arrive(a1)
    assert not table.starts(a1) and table.under_way(()) == 1  # its next call waits
    table.admitted(a1, 100)
    a1.output_ids, a1.finish_reason = [9] * 10, "stop"
    table.leave(a1)
    assert table.end("a")
    # Its own KV at its peak: 160 tokens of its longest sequence less the 30 it found cached.
    assert table.program_cap(1000) == int(PROGRAM_SHARE * 1000 / 130)
    assert table.program_cap(100) == 1  # never below one


@pytest.mark.parametrize("then", ["runner ends", "b ends", "c waited"])
def test_under_srpt_a_new_program_waits_while_the_programs_under_way_fill_the_pool(
    tiny_model_dirs, then
):
    """A program that ended reached 124 tokens of its own, so in a 256-token pool one program
    is under way at a time. With b paused (pinned) and a runner running, a new program c
    waits though it fits; b's next call does not. c starts once nothing else runs, as soon as
    b ends, or once srpt's aging has put its key below 0 (no starvation)."""
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, schedule_policy="program-srpt")
    clock = Clock()
    s.requests.clock = s.programs.clock = s.kv.sessions.clock = clock
    rng = random.Random(14)
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    s.handle(GenerateReq("a/0", ids(120), sp, 0, session_id="a"))
    run_to_end(s)
    s.close_session("a")  # a ends (too long to have been pinned): the programs' KV is known
    assert s.programs.program_cap(256) == 1
    s.handle(GenerateReq("b/0", ids(30), sp, 0, session_id="b", session_ttl_s=500.0))
    b0 = s.requests.get("b/0")
    run_to_end(s)
    assert s.control("stats")["pinned_sessions"] == 1
    runner = braid.SamplingParams(max_tokens=30, **GREEDY)
    s.handle(GenerateReq("runner", ids(20), runner, 0))
    s.step()  # the runner runs
    s.handle(GenerateReq("c/0", ids(30), sp, 0, session_id="c"))
    assert not s.prefill.admits_now()  # c waits, and the overlap schedule is told so
    s.handle(GenerateReq("b/1", b0.tokens() + [9, 9], sp, 0, session_id="b", session_ttl_s=500.0))
    assert s.prefill.admits_now()  # b is under way: its next call goes in
    finished = []
    while "b/1" not in finished:
        finished += [out.rid for out in s.step() if out.finish_reason]
        s.check_invariants()
    assert finished == ["b/1"]
    assert not s.prefill.admits_now()  # b is paused again, pinned
    if then == "b ends":
        assert s.close_session("b")  # c may start while the runner runs
    elif then == "c waited":
        # c's predicted work: 4 tokens (every program's mean output per call so far) times
        # the calls left (1); log2(1 + 4 + 3) = 3, less one per SRPT_AGING_S waited.
        clock.now += 3 * program_srpt.SRPT_AGING_S - 1
        assert not s.prefill.admits_now()
        clock.now += 2
    assert s.prefill.admits_now() is (then != "runner ends")
    finished += _finish_order(s)
    if then == "runner ends":
        assert finished == ["b/1", "runner", "c/0"]
    else:
        assert finished == ["b/1", "c/0", "runner"]
    assert s.control("stats")["retractions"] == 0


def test_pins_kept_for_programs_stay_out_of_the_releasable_pages():
    alloc = PageAllocator(65, 1)
    cache = RadixCache(alloc)
    pins = SessionPins(cache, max_pages=64)
    for session, tokens in (("a", [1, 2, 3, 4]), ("b", [1, 2, 9, 9, 9]), ("c", [7, 7])):
        cache.insert(tokens, alloc.alloc(len(tokens)))
        pins.pin(session, tokens)
    # Shared prefix [1, 2] is held by a and b: releasable only when both go.
    assert pins.releasable_pages() == 4 + 3 + 2  # a's [1..4] path, b's tail, c
    assert pins.releasable_pages(keep=lambda p: p == "a") == 3 + 2  # b's tail, c
    assert pins.releasable_pages(keep=lambda p: p in ("a", "b")) == 2
    assert pins.release_soonest(keep=lambda p: p != "b") and set(pins.by_program()) == {"a", "c"}
    assert not pins.release_soonest(keep=lambda p: True)
    assert pins.released_for_room == 1


def test_pins_give_way_one_at_a_time_to_a_prompt_between_chunks_when_nothing_runs(
    tiny_model_dirs,
):
    """Two pins hold ~96 of 256 tokens; a 200-token prompt is admitted by its first chunk and
    its third chunk does not fit, with nothing running: the pin that expires first gives way,
    and only it (the scheduler used to stall). A prompt longer than the pool is refused at
    admission, costing no pin."""
    s = local_scheduler(
        tiny_model_dirs["llama"], kv_tokens=256, chunked_prefill_size=64, schedule_policy="fcfs"
    )
    rng = random.Random(11)
    sp = braid.SamplingParams(max_tokens=4, **GREEDY)
    for rid, n in (("first", 60), ("second", 30)):
        s.handle(GenerateReq(rid, [rng.randrange(1, 500) for _ in range(n)], sp, 0, session_id=rid))
        run_to_end(s)
    assert s.control("stats")["pinned_sessions"] == 2
    with pytest.raises(ParamError):
        s.handle(GenerateReq("huge", [7] * 300, sp, 0))
    s.handle(GenerateReq("long", [rng.randrange(1, 500) for _ in range(200)], sp, 0))
    tokens = run_to_end(s)
    assert len(tokens["long"]) == 4
    stats = s.control("stats")
    assert stats["pins_released_for_room"] == 1 and stats["pinned_sessions"] == 1
    assert set(s.kv.sessions.by_program()) == {"second"}  # the later pin, expiring later


def test_pins_are_released_before_a_running_request_is_retracted(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=200)
    rng = random.Random(8)
    sp = braid.SamplingParams(max_tokens=2, **GREEDY)
    for i in range(4):  # four sessions pin ~25 tokens each: ~100 of 200, the limit
        s.handle(GenerateReq(f"p{i}", [rng.randrange(1, 500) for _ in range(24)], sp, 0, f"s{i}"))
    while s.has_work:
        s.step()
    pinned = s.control("stats")["pinned_tokens"]
    assert pinned >= 75
    # One request whose KV needs more than the unpinned room as it decodes.
    long = braid.SamplingParams(max_tokens=150, **GREEDY)
    s.handle(GenerateReq("big", [rng.randrange(1, 500) for _ in range(20)], long, 0))
    outs = []
    while s.has_work:
        outs += s.step()
        s.check_invariants()
    big = [o for o in outs if o.rid == "big" and o.finish_reason]
    assert big[0].finish_reason == "length" and big[0].error is None
    stats = s.control("stats")
    assert stats["pins_released_for_room"] >= 1 and stats["retractions"] == 0


# ---- pre-caching ------------------------------------------------------------------------------
def test_run_batch_computes_the_constant_prefix_once(tmp_path, caplog):
    """run_batch computes the batch's constant prefix once before its programs; a program's
    first run computes its own before its first call (once: later runs skip it); a program
    that cannot be traced runs as it is, saying so at debug level."""
    from braid.lang.backends.engine import EngineBackend
    from braid.lang.config import global_config
    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    path, _ = build_tiny_constrained_model(tmp_path / "m")

    @braid.function
    def prog(s, i):
        s += "the cat sat on the mat and the dog sat on the log. " * 8
        s += f"question {i}:"
        s += braid.gen("a", max_tokens=1, temperature=0)

    @braid.function
    def lone(s):
        s += "a bird flew over the tree and a fish swam under the boat. " * 8
        s += "answer:"
        s += braid.gen("a", max_tokens=1, temperature=0)

    @braid.function
    def peeks(s, i):
        s += "the sun rose over the hill and the moon set behind the sea. " * 4
        s += braid.gen("x", max_tokens=1, temperature=0)
        if s["x"]:  # a generated value read in Python: traced up to here
            s += f" {i}"

    @braid.function
    def breaks(s, i):
        # Works on the real argument, fails (TypeError) on the tracer's: no prefix at all.
        s += "tea " + (i if isinstance(i, str) else 1)

    def run(precache: bool) -> tuple[int, int, list[int], int, int]:
        """(prefill tokens computed, prefix tokens, each program's cached prompt tokens, the
        cached tokens of lone's first run, lone's prefix tokens)."""
        with braid.LLM(path, kv_tokens=8192, schedule_policy="fcfs", show_progress=False) as llm:
            backend = EngineBackend(llm)
            prefix = len(llm.tokenizer.encode(prog.constant_prefix(backend, {"i"})))
            before = llm.stats()["prefill_tokens_computed"]
            old = global_config.enable_precache_with_tracing
            global_config.enable_precache_with_tracing = precache
            try:
                states = prog.run_batch([{"i": i} for i in range(64)], backend=backend)
                computed = llm.stats()["prefill_tokens_computed"] - before
                first = lone.run(backend=backend).get_meta_info("a")["cached_tokens"]
                computed_before = llm.stats()["prefill_tokens_computed"]
                again = lone.run(backend=backend).get_meta_info("a")
                # The second run computes only its last prompt token and no prefix again.
                assert again["cached_tokens"] == again["prompt_tokens"] - 1
                assert llm.stats()["prefill_tokens_computed"] - computed_before == 1
                for odd in (peeks, breaks):
                    with caplog.at_level("DEBUG", logger="braid.lang.program"):
                        odd_states = odd.run_batch([{"i": "a"}, {"i": "b"}], backend=backend)
                    assert all(st.error() is None for st in odd_states)
            finally:
                global_config.enable_precache_with_tracing = old
            metas = [st.get_meta_info("a") for st in states]
            cached = [m["cached_tokens"] for m in metas]
            own = sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas)
            lone_prefix = len(llm.tokenizer.encode(lone.constant_prefix(backend, set())))
            return computed - own, prefix, cached, first, lone_prefix

    beyond, prefix, cached, first, lone_prefix = run(True)
    assert prefix > 100 and lone_prefix > 100
    # Every program found the prefix cached: it was computed once, before them. Past each
    # program's own tokens (its prompt less what it found cached), exactly the prefix was
    # computed: once, not per program, nor twice.
    assert min(cached) >= prefix - 1
    assert beyond == prefix
    assert first >= lone_prefix - 1  # computed before lone's first call
    logged = caplog.text
    assert "peeks: traced up to where it reads a run-time value" in logged
    assert "breaks: no shared prefix (tracing raised" in logged
    # Without pre-caching, the first program admitted computes the prefix itself.
    _, _, cached, first, _ = run(False)
    assert min(cached) < prefix // 2
    assert first < lone_prefix // 2
