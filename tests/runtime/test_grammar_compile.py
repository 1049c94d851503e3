"""Grammars compile off the scheduler's critical path: a constrained request waits (unadmitted)
while its grammar compiles and other requests keep running; a compile that fails or overruns
its time limit fails that request alone, with a clear message, and the runtime keeps serving
with no KV slot lost. Runs on a tiny random Llama with a real byte-level BPE tokenizer, where
`\\w{0,500}` (every Unicode word character, 500 times) takes seconds to compile."""

from __future__ import annotations

import re
import time

import pytest

from braid import SamplingParams
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler, PendingGrammars
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

SLOW = r"\w{0,500}"  # seconds to compile on the tiny vocabulary
SLOWER = r"\w{0,1000}"  # several seconds: far longer than a short request on the tiny model
PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-grammar"))


def _scheduler(tiny, **config):
    path, eos = tiny
    sched = local_scheduler(path, frozenset({eos}), kv_tokens=2048, **config)
    # Load the vocabulary first, so that time limits measure compiles alone.
    sched.grammar_waiting.compiler.submit("regex", "warm").result()
    return sched


def _drain(sched) -> tuple[dict[str, list[int]], dict[str, str], dict[str, str]]:
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    errors: dict[str, str] = {}
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
            if out.error:
                errors[out.rid] = out.error
        sched.check_invariants()
    return ids, finish, errors


FREE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def free_alone(tiny):
    sched = local_scheduler(tiny[0], frozenset({tiny[1]}), kv_tokens=2048)
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    return run_to_end(sched)["free"]


def test_overrunning_compile_fails_with_a_clear_error_and_serving_continues(tiny, free_alone):
    sched = _scheduler(tiny, grammar_compile_timeout_s=0.3)
    sched.handle(GenerateReq("slow", PROMPT, SamplingParams(regex=SLOW, max_tokens=4), 0))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    ids, finish, errors = _drain(sched)
    assert finish["slow"] == "abort" and ids.get("slow", []) == []
    assert "regex: grammar compilation timed out after 0.3 s" in errors["slow"]
    assert "--grammar-compile-timeout" in errors["slow"]
    assert finish["free"] == "length" and ids["free"] == free_alone
    # The runtime keeps serving constrained requests (a spare worker took over).
    yes_no = SamplingParams(temperature=1.0, seed=3, max_tokens=8, regex="(yes|no)")
    sched.handle(GenerateReq("after", PROMPT, yes_no, 3))
    ids, finish, errors = _drain(sched)
    assert finish["after"] == "stop" and not errors
    assert re.fullmatch("(yes|no)", load_tokenizer(tiny[0]).decode(ids["after"][:-1]))
    usage = sched.usage()
    assert usage["kv_free_tokens"] + usage["kv_cached_tokens"] == usage["kv_capacity_tokens"]


def test_compile_error_fails_just_that_request(tiny, free_alone):
    sched = _scheduler(tiny)
    # Python's re accepts a backreference; outlines-core cannot build an automaton for it.
    sched.handle(GenerateReq("bad", PROMPT, SamplingParams(regex=r"(a)\1", max_tokens=4), 0))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    ok = SamplingParams(temperature=1.0, seed=1, max_tokens=8, choice=["red", "green"])
    sched.handle(GenerateReq("ok", PROMPT, ok, 1))
    ids, finish, errors = _drain(sched)
    assert finish["bad"] == "abort" and "regex: cannot be compiled" in errors["bad"]
    assert finish["free"] == "length" and ids["free"] == free_alone
    assert finish["ok"] == "stop" and "ok" not in errors


def test_free_request_runs_while_a_grammar_compiles(tiny, free_alone):
    sched = _scheduler(tiny)
    slow = SamplingParams(temperature=1.0, seed=2, max_tokens=6, regex=SLOWER)
    sched.handle(GenerateReq("slow", PROMPT, slow, 2))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    free_ids: list[int] = []
    steps = steps_while_compiling = 0
    while True:
        compiling = [r.rid for r in sched.grammar_waiting] == ["slow"]
        outs = {o.rid: o for o in sched.step()}
        steps += 1
        free = outs["free"]  # the free request gains a token at every step
        free_ids += free.new_token_ids
        steps_while_compiling += compiling
        if free.finish_reason:
            break
    # One prefill and 11 decodes, as when alone, all while the other grammar compiled.
    assert free_ids == free_alone and steps == len(free_alone) == steps_while_compiling
    assert [r.rid for r in sched.grammar_waiting] == ["slow"]
    ids, finish, errors = _drain(sched)
    assert finish["slow"] in ("stop", "length") and not errors and 1 <= len(ids["slow"]) <= 6


def test_abort_while_waiting_for_a_grammar(tiny):
    sched = _scheduler(tiny)
    sched.handle(GenerateReq("slow", PROMPT, SamplingParams(regex=SLOW, max_tokens=4), 0))
    outs = sched.handle(AbortReq("slow"))
    assert [(o.rid, o.finish_reason) for o in outs] == [("slow", "abort")]
    assert not sched.has_work
    sched.check_invariants()


# ---- the pool itself -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tokenizer(tiny):
    return load_tokenizer(tiny[0])


def test_identical_specs_share_one_compile_and_a_cached_one_is_ready_at_once(tiny_tokenizer):
    pool = AsyncGrammarCompiler(lambda: GrammarCompiler(tiny_tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = pool.submit("json_schema", schema)
    same = pool.submit("json_schema", dict(reversed(list(schema.items()))))
    assert same is first or same.result() is first.result()
    grammar = first.result(timeout=30)
    again = pool.submit("json_schema", schema)
    assert again.done() and again.result() is grammar
    assert pool.compiler.misses == 1


def test_compile_error_fails_its_future_naming_the_field(tiny_tokenizer):
    pool = AsyncGrammarCompiler(lambda: GrammarCompiler(tiny_tokenizer))
    with pytest.raises(ValueError, match="regex: cannot be compiled"):
        pool.submit("regex", r"(?=a)a").result(timeout=30)
    assert pool.submit("regex", "a+").result(timeout=30) is not None


def test_an_overrunning_compile_gets_a_spare_worker(tiny_tokenizer):
    pool = AsyncGrammarCompiler(lambda: GrammarCompiler(tiny_tokenizer), workers=1)
    pool.submit("regex", "warm").result(timeout=30)
    pending: PendingGrammars[str] = PendingGrammars(pool, timeout_s=0.2)
    pending.add("slow", "regex", SLOW)
    slow_future = pool.submit("regex", SLOW)  # the same compile, shared
    time.sleep(0.3)
    ready, failed = pending.poll()
    assert ready == [] and failed[0][0] == "slow" and "timed out after 0.2 s" in failed[0][1]
    pending.add("quick", "regex", "(yes|no)")
    deadline = time.monotonic() + 5
    while not ready and time.monotonic() < deadline:
        pending.wait(0.05)
        ready, failed = pending.poll()
    assert [item for item, _ in ready] == ["quick"] and not failed
    assert not slow_future.done()  # the one worker is still on the slow grammar
    slow_future.result(timeout=60)


def test_the_time_limit_is_a_validated_config_field_and_a_serve_flag():
    from braid.runtime.config import EngineConfig
    from braid.runtime.server.cli import build_parser

    for bad in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
            EngineConfig(grammar_compile_timeout_s=bad)
    args = build_parser().parse_args(
        ["serve", "--grammar-compile-timeout", "5", "--disable-jump-forward"]
    )
    assert (args.grammar_compile_timeout, args.disable_jump_forward) == (5.0, True)
    args = build_parser().parse_args(["serve"])
    assert (args.grammar_compile_timeout, args.disable_jump_forward) == (30.0, False)
