"""Continuous batching: requests join and leave the running batch between steps, output does not
depend on who else is running, and the scheduler's message interface keeps KV accounted."""

from __future__ import annotations

import re

import pytest

import braid
from braid import SamplingParams
from braid.runtime.forward_batch import ForwardMode
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from tests.conftest import local_scheduler

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture()
def tiny(tiny_model_dirs):
    with braid.LLM(
        tiny_model_dirs["qwen3"], kv_tokens=512, max_running_requests=2, show_progress=False
    ) as llm:
        yield llm


@pytest.fixture()
def sched(tiny_model_dirs):
    return local_scheduler(tiny_model_dirs["qwen3"], kv_tokens=512, max_running_requests=2)


def test_more_requests_than_slots_give_the_same_tokens_as_alone(tiny):
    prompts = [[i + 1] * (3 + 4 * i) for i in range(5)]
    params = [SamplingParams(max_tokens=4 + 3 * i, **GREEDY) for i in range(5)]
    alone = [
        tiny.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params)
    ]
    together = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert [len(t) for t in alone] == [4, 7, 10, 13, 16]


def test_new_requests_are_prefilled_between_decode_steps(sched):
    modes = []
    real_forward = sched.runner.forward

    def spy(batch):
        modes.append((batch.mode, batch.batch_size, {r.rid for r in sched.running}))
        return real_forward(batch)

    sched.runner.forward = spy
    sched.handle(GenerateReq("a", [1, 2, 3], SamplingParams(max_tokens=3, **GREEDY), 1))
    sched.handle(GenerateReq("b", [4, 5, 6], SamplingParams(max_tokens=8, **GREEDY), 2))
    sched.handle(GenerateReq("c", [7, 8], SamplingParams(max_tokens=4, **GREEDY), 3))
    finished = {}
    while sched.has_work:
        for out in sched.step():
            if out.finish_reason:
                finished[out.rid] = out.finish_reason
        sched.check_invariants()
    assert finished == {"a": "length", "b": "length", "c": "length"}
    # "c" waits for a slot (max 2 running), then is prefilled while "b" is still decoding.
    extend_steps = [m for m in modes if m[0] is ForwardMode.EXTEND]
    assert extend_steps[0][1] == 2
    assert any(m[1] == 1 and m[2] == {"b"} for m in extend_steps[1:])
    # After a prefill, the running requests decode before the next prefill.
    for prev, cur in zip(modes, modes[1:]):
        if prev[0] is ForwardMode.EXTEND and prev[2]:
            assert cur[0] is ForwardMode.DECODE
    assert (
        sched.kv.allocator.free_pages + sched.kv.cache.total_pages
        == sched.kv.allocator.capacity_pages
    )


def test_abort_frees_a_running_and_a_waiting_request(sched):
    sp = SamplingParams(max_tokens=50, **GREEDY)
    for rid in ("x", "y", "z"):
        sched.handle(GenerateReq(rid, [1, 2, 3, 4], sp, 0))
    sched.step()
    sched.step()
    assert {r.rid for r in sched.running} == {"x", "y"} and [r.rid for r in sched.waiting] == ["z"]
    outs = sched.handle(AbortReq("x")) + sched.handle(AbortReq("z"))
    assert [(o.rid, o.finish_reason) for o in outs] == [("x", "abort"), ("z", "abort")]
    assert sched.handle(AbortReq("unknown")) == []
    sched.check_invariants()
    sched.abort_all()
    sched.check_invariants()
    assert (
        sched.kv.allocator.free_pages + sched.kv.cache.total_pages
        == sched.kv.allocator.capacity_pages
    )


def test_max_tokens_zero_prefills_and_caches_without_generating(sched):
    prompt = [9, 8, 7, 6, 5, 4, 3, 2]
    sp = SamplingParams(max_tokens=0, prompt_logprobs=1, logprob_start_len=2)
    sched.handle(GenerateReq("prefill", prompt, sp, 1))
    outs = []
    while sched.has_work:
        outs += sched.step()
        sched.check_invariants()
    (out,) = outs
    assert out.new_token_ids == [] and out.finish_reason == "length" and out.logprobs is None
    assert [lp is None for lp in out.prompt_logprobs] == [True, True] + [False] * 6
    # The prompt's KV went to the prefix cache: the same prompt now hits it.
    sched.handle(GenerateReq("again", prompt + [1], SamplingParams(max_tokens=1, **GREEDY), 2))
    again = []
    while sched.has_work:
        again += sched.step()
    assert again[-1].cached_tokens == len(prompt)


def test_retractions_are_logged_once_per_interval(tiny_model_dirs, caplog):
    """KV running short for decoding retracts requests with one WARNING (SGLang logs them);
    they were counted in the stats only. More within 10 s wait for the next line."""
    import logging

    from tests.conftest import run_to_end

    sched = local_scheduler(tiny_model_dirs["qwen3"], kv_tokens=64)
    for i in range(4):
        sched.handle(GenerateReq(str(i), [i + 1] * 8, SamplingParams(max_tokens=30, **GREEDY), i))
    with caplog.at_level(logging.WARNING, logger="braid"):
        tokens = run_to_end(sched)
    assert sorted(len(t) for t in tokens.values()) == [30] * 4
    lines = [r.getMessage() for r in caplog.records if "retracted to the queue" in r.getMessage()]
    assert sched.stats.retractions > 1 and len(lines) == 1, (sched.stats.retractions, lines)
    assert lines[0].startswith("KV cache ran short for decoding: 1 request(s) of ")


def test_a_working_scheduler_logs_its_throughput(tiny_model_dirs, caplog):
    """One INFO line every interval while requests run (braid serve asks for 10 s; 0 here):
    running and queued requests, KV use, prefill and generation rates. Nothing said how busy
    a server was. Off unless asked (the offline LLM, as vLLM's)."""
    import logging

    from braid.runtime.ipc.to_scheduler import ControlReq
    from braid.runtime.scheduler.process import SchedulerLoop

    loop = SchedulerLoop(local_scheduler(tiny_model_dirs["qwen3"], kv_tokens=256))
    assert loop.throughput.every_s is None
    assert loop.handle(ControlReq(1, "log_throughput", "0"))[0].ok
    for i in range(2):
        loop.handle(GenerateReq(str(i), [i + 1] * 8, SamplingParams(max_tokens=3, **GREEDY), i))
    with caplog.at_level(logging.INFO, logger="braid"):
        while loop.scheduler.has_work:
            loop.step()
    lines = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]
    assert re.fullmatch(
        r"2 running, 0 queued; KV \d+\.\d% used; last 0 s: prefill \d+\.\d tok/s, "
        r"generation \d+\.\d tok/s",
        lines[0],
    ), lines
    assert len(lines) >= 3 and lines[-1].startswith("0 running")


def _finish_order(s) -> list[str]:
    finished = []
    while s.has_work:
        finished += [out.rid for out in s.step() if out.finish_reason]
        s.check_invariants()
    return finished


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_priority_policy_admits_lower_values_first(tiny_model_dirs, policy):
    """One request runs at a time: under `priority` they finish by value, arrival order among
    equals (vLLM's order); fcfs, the control, takes them in arrival order."""
    s = local_scheduler(
        tiny_model_dirs["qwen3"], kv_tokens=512, max_running_requests=1, schedule_policy=policy
    )
    sp = SamplingParams(max_tokens=3, **GREEDY)
    ranks = {"a": 5, "b": 0, "c": 5, "d": -1, "e": 0}
    for rid, rank in ranks.items():
        s.handle(GenerateReq(rid, [3, 4, 5], sp, 0, priority=rank if policy == "priority" else 0))
    want = ["d", "b", "e", "a", "c"] if policy == "priority" else list(ranks)
    assert _finish_order(s) == want


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_priority_policy_retracts_the_highest_value(tiny_model_dirs, policy):
    """KV runs short while three requests decode, the one of the highest value admitted first
    (it came first): under `priority` a retraction takes it, not the newest; fcfs, the
    control, takes the newest. Every request still gets its tokens."""
    s = local_scheduler(tiny_model_dirs["qwen3"], kv_tokens=64, schedule_policy=policy)
    ranks = {"a": 5, "b": 0, "c": 1}
    sp = SamplingParams(max_tokens=30, **GREEDY)
    for i, (rid, rank) in enumerate(ranks.items()):
        s.handle(GenerateReq(rid, [i + 1] * 8, sp, i, priority=rank * (policy == "priority")))
        s.step()  # admitted in arrival order
    picks = []
    choose = s.decode.victim

    def spy(running):
        i = choose(running)
        picks.append(([r.rid for r in running], running[i].rid))
        return i

    s.decode.victim = spy
    assert sorted(_finish_order(s)) == sorted(ranks)
    assert picks, "nothing was retracted: the pool no longer runs short"
    assert picks[0] == (["a", "b"], "a" if policy == "priority" else "b")
    for running, picked in picks:
        want = max(running, key=lambda r: (ranks[r], running.index(r)))
        assert picked == (want if policy == "priority" else running[-1]), (running, picked)


def test_a_priority_under_another_policy_is_refused(tiny_model_dirs, smollm2):
    from braid.runtime.errors import ParamError

    s = local_scheduler(tiny_model_dirs["qwen3"], kv_tokens=512)
    with pytest.raises(ParamError, match="priority: needs the priority schedule policy"):
        s.handle(GenerateReq("a", [3, 4], SamplingParams(max_tokens=2), 0, priority=1))
    assert not s.has_work
    # The offline API checks it before sending anything, and its form.
    for priority, field in [
        ([1], "priority[0]"),  # this engine runs lpm
        (1, "priority"),
        ([0, 0], "priority"),
        (["1"], "priority[0]"),
        ([True], "priority[0]"),
        ([2**63], "priority[0]"),
    ]:
        with pytest.raises(ParamError) as e:
            smollm2.generate(
                ["hi"], SamplingParams(max_tokens=1), use_tqdm=False, priority=priority
            )
        assert e.value.param == field, (priority, e.value)
    import numpy as np

    zero = [np.int64(0)]  # any integer type, as vLLM takes
    out = smollm2.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False, priority=zero)
    assert len(out[0].outputs[0].token_ids) == 1


def test_llm_generate_sends_each_prompts_priority(tiny_model_dirs):
    """Through the engine's processes: one request runs at a time, so the first to run finds
    nothing of the shared prefix cached and the others find it; priorities [2, 0, 1] run the
    second prompt first (without them the first would be)."""
    shared = [5] * 16
    prompts = [shared + [i + 1] * 3 for i in range(3)]
    sp = SamplingParams(max_tokens=2, **GREEDY)
    with braid.LLM(
        tiny_model_dirs["llama"],
        kv_tokens=512,
        max_running_requests=1,
        schedule_policy="priority",
        show_progress=False,
    ) as llm:
        out = llm.generate(prompts, sp, use_tqdm=False, priority=[2, 0, 1])
        assert [o.num_cached_tokens for o in out] == [16, 0, 16]
        assert llm.flush_cache()
        out = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.num_cached_tokens for o in out] == [0, 16, 16]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_lower_value_that_fits_is_admitted_while_the_earlier_one_waits(tiny_model_dirs, overlap):
    """A request decodes; then one that does not fit the pool (value 5) and one that does
    (value 0) arrive. The second runs beside the first, with the overlap schedule too (whose
    look at the queue once checked the earliest arrival alone, and kept decoding ahead until
    the running request ended)."""
    s = local_scheduler(
        tiny_model_dirs["qwen3"],
        kv_tokens=128,
        schedule_policy="priority",
        overlap_schedule=overlap,
    )
    s.handle(GenerateReq("r", [1] * 40, SamplingParams(max_tokens=40, **GREEDY), 0))
    s.step()
    s.step()
    s.handle(GenerateReq("low", [2] * 100, SamplingParams(max_tokens=2, **GREEDY), 1, priority=5))
    s.handle(GenerateReq("high", [3] * 4, SamplingParams(max_tokens=2, **GREEDY), 2, priority=0))
    assert s.prefill.admits_now()
    assert _finish_order(s) == ["high", "r", "low"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_prompt_between_chunks_is_retracted_by_its_value(tiny_model_dirs, policy):
    """KV runs short while a long prompt (value 0) is between chunks beside a decoding
    request (value 5): under `priority` the decoding one is retracted and the prompt keeps its
    chunks; fcfs, the control, retracts the prompt between chunks (the newest)."""
    s = local_scheduler(
        tiny_model_dirs["qwen3"],
        kv_tokens=64,
        chunked_prefill_size=8,
        schedule_policy=policy,
    )
    s.decode.new_token_ratio = 0.1  # admit optimistically: the prompt takes r's room
    rank = policy == "priority"
    r = SamplingParams(max_tokens=40, **GREEDY)
    s.handle(GenerateReq("r", [1] * 8, r, 0, priority=5 * rank))
    s.step()
    s.handle(GenerateReq("p", [2] * 60, SamplingParams(max_tokens=4, **GREEDY), 1))
    picks = []
    retract = s.decode.retract

    def spy(req):
        picks.append((req.rid, req.status.name))
        retract(req)

    s.decode.retract = spy
    assert sorted(_finish_order(s)) == ["p", "r"]
    assert picks, "nothing was retracted: the pool no longer runs short"
    assert picks[0] == (("r", "RUNNING") if rank else ("p", "PREFILLING")), picks
