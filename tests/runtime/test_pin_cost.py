"""Pins only where they pay (`scheduler/pin_cost.py`): a paused program's KV is pinned while
the pool holds more tokens than the device prefills during the program's expected pause;
until a rate and a pause are known, and when the client set a TTL, always."""

from __future__ import annotations

import random

import pytest

import braid
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.scheduler.pin_cost import PinCost
from braid.runtime.scheduler.programs import ProgramTable
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.test_programs import GREEDY, Clock, _call, _req


def test_a_pin_pays_while_the_pool_outholds_what_the_pause_would_prefill():
    cost = PinCost(capacity_tokens=4096)
    assert cost.prefill_rate is None
    assert cost.pays(10.0)  # no rate yet
    cost.observe_prefill(2000, 1.0)
    assert cost.prefill_rate == 2000
    assert cost.pays(None)  # no pause known yet
    assert cost.pays(2.0)  # 4000 tokens prefilled in the pause < 4096
    assert cost.declined == 0
    assert not cost.pays(2.1)  # 4200 > 4096
    assert cost.declined == 1


def test_the_rate_follows_the_recent_prefills():
    cost = PinCost(capacity_tokens=4096)
    cost.observe_prefill(100, 1.0)
    cost.observe_prefill(0, 1.0)  # nothing computed: not a measurement
    cost.observe_prefill(100, 0.0)
    assert cost.prefill_rate == 100
    for _ in range(200):
        cost.observe_prefill(10_000, 1.0)
    assert 9_900 < cost.prefill_rate < 10_000


def test_a_programs_expected_pause_is_its_own_else_every_programs():
    clock = Clock()
    table = ProgramTable(clock=clock)
    a0 = _req("a/0", session="a")
    assert table.expected_pause(a0) is None
    _call(table, a0, [5])
    clock.now += 2.0
    _call(table, _req("a/1", session="a"), [5])
    clock.now += 4.0
    a2 = _call(table, _req("a/2", session="a"), [5])
    assert table.expected_pause(a2) == pytest.approx(3.0)  # its pauses: 2 s and 4 s
    b0 = _call(table, _req("b/0", session="b"), [5])
    # b has not paused yet: every program's pauses, the later weighing a little more.
    assert 3.0 < table.expected_pause(b0) < 3.1


@pytest.mark.parametrize("rate,pinned", [(1e9, False), (1e-3, True)])
def test_under_a_queue_the_scheduler_pins_a_finished_call_only_where_it_pays(
    tiny_model_dirs, rate, pinned
):
    s = local_scheduler(
        tiny_model_dirs["llama"],
        kv_tokens=256,
        schedule_policy="program",
        max_running_requests=1,
    )
    clock = Clock()
    s.kv.sessions.clock = clock
    s.programs.clock = clock
    # A device that prefills a billion tokens a second (or a thousandth of one): the timed
    # steps of this run add too little to move it.
    s.pin_cost.observe_prefill(max(1, int(rate * 1000)), 1000.0)
    rng = random.Random(1)
    prompt = [rng.randrange(1, 500) for _ in range(40)]
    sp = braid.SamplingParams(max_tokens=3, **GREEDY)

    def call(rid: str, ids: list[int], ttl: float | None = None, queue: bool = False):
        s.handle(GenerateReq(rid, ids, sp, 0, session_id="agent", session_ttl_s=ttl))
        if queue:  # another request, which waits while the call runs (one runs at a time)
            s.handle(GenerateReq(f"other-{rid}", [rng.randrange(1, 500) for _ in range(8)], sp, 0))
        req = s.requests.get(rid)
        while not req.finished:
            s.step()
            s.check_invariants()
        pinned_now = s.control("stats")["pinned_tokens"] >= 40
        run_to_end(s)
        return req.output_ids, pinned_now

    out, pinned_now = call("agent/0", prompt, queue=True)
    assert pinned_now  # no pause known yet: pinned, queue or not
    clock.now += 1.0  # the tool call
    prompt += out + [7]
    out, pinned_now = call("agent/1", prompt)
    assert pinned_now  # a pause is known, but nothing waits: pinned
    clock.now += 1.0
    prompt += out + [8]
    out, pinned_now = call("agent/2", prompt, queue=True)
    assert pinned_now == pinned
    assert s.control("stats")["pins_declined"] == (0 if pinned else 1)
    clock.now += 1.0
    _, pinned_now = call("agent/3", prompt + out + [9], ttl=5.0, queue=True)
    assert pinned_now  # the client asked for this pin: made under the queue too
