"""Bad input raises ValueError naming the problem, and the engine keeps serving with no KV
slot lost."""

from __future__ import annotations

import pytest

from braid import SamplingParams
from tests.conftest import assert_kv_all_free_or_cached, local_scheduler


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(stop_regex="("), "stop_regex"),
        (dict(stop_regex="a*"), "stop_regex"),
        (dict(stop_regex=[""]), "stop_regex"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=100), "logprobs"),
        (dict(seed="x"), "seed"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={1: 1000.0}), "logit_bias"),
        (dict(logit_bias={1.7: 5.0}), "logit_bias"),  # not cut to 1
        (dict(logit_bias={True: 5.0}), "logit_bias"),
        (dict(temperature=True), "temperature"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1], regex="a"), "allowed_token_ids"),
        (dict(bad_words=["ok", "  "]), "bad_words"),
        (dict(bad_words="word"), "bad_words"),
        (dict(bad_words=["x"], choice=["a", "b"]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(bad_words=["w"] * 513), "at most 512"),
        (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


_assert_all_kv_free = assert_kv_all_free_or_cached


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        ("", None, "empty"),
        ([[]], None, "empty"),
        ([], None, "empty"),
        (["ok", ""], None, "prompt 1"),
        ([[1, 2, 10**9]], None, "vocabulary"),
        ([[1] * 9000], None, "context length"),
        (["hello"], SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
        (["hello"], SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        (["hello"], SamplingParams(allowed_token_ids=[1, 10**7]), "allowed_token_ids"),
        (["hello"], SamplingParams(bad_words_token_ids=[[1, 10**7]]), "bad_words"),
        # allowed_token_ids that leave nothing to sample: all banned, or all stop tokens
        # under min_tokens (SmolLM2's EOS <|im_end|> is 2).
        (["hello"], SamplingParams(allowed_token_ids=[2], min_tokens=1), "min_tokens"),
        (["hello"], SamplingParams(allowed_token_ids=[28120], bad_words=["hello"]), "ban every"),
        # Past the context, cut to its last 100 tokens: accepted.
        ([[1] * 9000], SamplingParams(truncate_prompt_tokens=100, max_tokens=2), None),
        # A cut longer than the context (as vLLM's, refused).
        (
            ["hello"],
            SamplingParams(truncate_prompt_tokens=8193),
            r"truncate_prompt_tokens: 8193 is greater than the context length \(8192\)",
        ),
        (["a", "b"], [SamplingParams()], "sampling_params"),
        ([3.5], None, "prompt 0"),
        ([[1, 2.0, 3]], None, "token ids must be integers"),
        ([[1, True, 3]], None, "token ids must be integers"),
        ([{"prompt_token_ids": [1, "2"]}], None, "token ids must be integers"),
        # What the scheduler refuses (a grammar it cannot compile) raises too, naming the
        # prompt and the field, with the batch's other prompts fine.
        (
            ["a", "b"],
            [SamplingParams(max_tokens=2), SamplingParams(regex=r"(a)\1")],
            r"prompt 1: regex",
        ),
        (["hello"], SamplingParams(json_schema={"type": "nonsense"}), "prompt 0: json_schema"),
    ],
)
def test_bad_requests_fail_cleanly_and_engine_keeps_serving(smollm2, prompts, params, match):
    if match is None:  # a control: the same shape of call, accepted
        smollm2.generate(prompts, params, use_tqdm=False)
    else:
        with pytest.raises(ValueError, match=match) as e:
            smollm2.generate(prompts, params, use_tqdm=False)
        if "regex" in match or "json_schema" in match:
            assert e.value.param in ("regex", "json_schema"), e.value
    _assert_all_kv_free(smollm2)
    ok = smollm2.generate(["2 + 2 ="], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3
    _assert_all_kv_free(smollm2)


def test_token_ids_of_other_integer_types_give_the_same_tokens_as_ints(smollm2):
    import enum

    import numpy as np

    class Token(enum.IntEnum):
        TWO = 17

    ids = [28, 955, 28, 17, 446]
    sp = SamplingParams(temperature=0, max_tokens=4)
    want = smollm2.generate([ids], sp, use_tqdm=False)[0]
    for other in (list(np.array(ids)), [*ids[:3], Token.TWO, ids[4]]):
        got = smollm2.generate([other], sp, use_tqdm=False)[0]
        assert got.prompt_token_ids == ids and all(type(t) is int for t in got.prompt_token_ids)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _assert_all_kv_free(smollm2)


def test_small_kv_pool_caps_the_context(tiny_model_dirs):
    """A pool smaller than the model's context caps the context: a prompt that cannot fit is
    rejected, and generation stops at the cap with finish_reason "length"."""
    import braid

    with braid.LLM(tiny_model_dirs["llama"], kv_tokens=64, show_progress=False) as llm:
        assert llm.context_length == 64
        with pytest.raises(ValueError, match="context length"):
            llm.generate([[1] * 64], SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.generate([[1] * 40], SamplingParams(max_tokens=100), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 24
        assert out[0].outputs[0].finish_reason == "length"
        _assert_all_kv_free(llm)


def test_prompt_logprobs_are_one_per_prompt_position(smollm2):
    """A `logprob_start_len` past the prompt scores nothing: one None per position, never
    more entries than the prompt has."""
    sp = SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0)
    for start, scored in ((0, 1), (50, 0)):
        (out,) = smollm2.generate(["Hi there"], sp.replace(logprob_start_len=start), use_tqdm=False)
        n = len(out.prompt_token_ids)
        assert len(out.prompt_logprobs) == n
        assert sum(lp is not None for lp in out.prompt_logprobs) == (n - 1 if scored else 0)
    _assert_all_kv_free(smollm2)


def test_bad_chat_messages(smollm2):
    for messages, match in [
        ([], "non-empty"),
        ([{"content": "no role"}], "role"),
        ("just a string", "non-empty list"),
        # What SmolLM2's template would render anyway, refused by name.
        ([{"role": "", "content": "x"}], r"messages\[0\]\.role: must not be empty"),
        ([{"role": "user"}], r"messages\[0\]\.content: required for a user message"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: must be a string"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool", "content": "4", "tool_call_id": 5}],
            r"messages\[1\]\.tool_call_id: must be a string",
        ),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "x"}],
            r"messages\[1\]\.tool_calls: a list",
        ),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{}]}],
            r"messages\[1\]\.tool_calls\[0\]\.function\.name",
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": []}],
            r"messages\[0\]\.tool_calls: a list, on assistant messages only",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            smollm2.chat(messages, use_tqdm=False)
    # A template's own roles, and Hugging Face's tool results by name, are taken.
    ok = [{"role": "observation", "content": "x"}, {"role": "tool", "name": "f", "content": "4"}]
    assert smollm2.chat(ok, SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids
    _assert_all_kv_free(smollm2)


def test_profiling_refusals_name_the_problem_and_a_relative_dir_is_the_callers(
    smollm2, tmp_path, monkeypatch
):
    """`start_profile` without a directory (none passed, no BRAID_TORCH_PROFILER_DIR in the
    engine's environment), into one that cannot be created, twice, and `stop_profile` with none
    running: each a ValueError that says why, the engine serving on. A relative directory is
    the caller's, not the scheduler process's."""
    with pytest.raises(ValueError, match="BRAID_TORCH_PROFILER_DIR"):
        smollm2.start_profile()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="cannot create .*a_file/profiles"):
        smollm2.start_profile(str(tmp_path / "a_file" / "profiles"))
    with pytest.raises(ValueError, match="no profile is running"):
        smollm2.stop_profile()
    monkeypatch.chdir(tmp_path)
    smollm2.start_profile("profiles")
    with pytest.raises(ValueError, match="already running"):
        smollm2.start_profile("profiles")
    out = smollm2.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    files = smollm2.stop_profile()
    assert len(out[0].outputs[0].token_ids) == 2
    assert sorted(files) == sorted(str(p) for p in (tmp_path / "profiles").iterdir())
    assert len(files) == 2
    _assert_all_kv_free(smollm2)


def test_failure_mid_generation_frees_every_slot(tiny_model_dirs):
    """A forward that raises (an OOM, a kernel error) fails the requests in flight with the
    error and leaves no KV held; the scheduler then serves the next request."""
    from braid.runtime.ipc.to_scheduler import GenerateReq
    from braid.runtime.scheduler.process import SchedulerLoop

    sched = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512)
    loop = SchedulerLoop(sched)
    real_forward = sched.runner.forward
    calls = {"n": 0}

    def failing_forward(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return real_forward(batch)

    sched.runner.forward = failing_forward
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7])):
        loop.handle(GenerateReq(rid, prompt, SamplingParams(max_tokens=10), 0))
    errors = {}
    for _ in range(10):
        for batch in loop.step():
            for out in batch.outputs:
                if out.error:
                    errors[out.rid] = out.error
    assert set(errors) == {"a", "b"} and "injected failure" in errors["a"]
    sched.check_invariants()
    assert not sched.has_work
    loop.handle(GenerateReq("c", [1, 2, 3], SamplingParams(max_tokens=5), 0))
    got = [o for _ in range(8) for b in loop.step() for o in b.outputs]
    assert sum(len(o.new_token_ids) for o in got) == 5 and got[-1].finish_reason == "length"
    sched.check_invariants()


def test_failure_in_the_first_prefill_fails_the_admitted_requests(tiny_model_dirs):
    """Requests admitted in a step that raises are not yet running: they must still get their
    error and give their KV back."""
    from braid.runtime.ipc.to_scheduler import GenerateReq
    from braid.runtime.scheduler.process import SchedulerLoop

    sched = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512)
    loop = SchedulerLoop(sched)
    real_forward = sched.runner.forward

    def boom(batch):
        raise RuntimeError("no memory")

    sched.runner.forward = boom
    loop.handle(GenerateReq("x", [1, 2, 3, 4], SamplingParams(max_tokens=4), 0))
    outs = [o for b in loop.step() for o in b.outputs]
    assert [(o.rid, o.finish_reason) for o in outs] == [("x", "abort")]
    assert "no memory" in outs[0].error
    sched.check_invariants()
    assert not sched.has_work and len(sched.requests) == 0
    sched.runner.forward = real_forward
    loop.handle(GenerateReq("y", [1, 2, 3, 4], SamplingParams(max_tokens=2), 0))
    outs = [o for _ in range(4) for b in loop.step() for o in b.outputs]
    assert outs[-1].finish_reason == "length"


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_takes():
    """-1 (vLLM's "as many as the model takes") keeps what leaves room for max_tokens (one
    token when it is None); a prompt with images is refused whatever its length."""
    from braid.runtime.offline_prompts import Prompt, truncated

    params = SamplingParams(truncate_prompt_tokens=-1, max_tokens=None)
    assert params.prompt_keep(64) == 63 and SamplingParams().prompt_keep(64) is None
    assert params.replace(max_tokens=10).prompt_keep(64) == 54
    assert params.replace(max_tokens=100).prompt_keep(64) == 1
    cut = truncated(Prompt("t", list(range(100)), [], "salt"), params, 0, 64)
    assert cut == Prompt("t", list(range(37, 100)), [], "salt")
    assert truncated(Prompt("t", [1, 2]), params, 0, 64).ids == [1, 2]
    with pytest.raises(ValueError, match="not with images"):
        truncated(Prompt("t", [1, 2], ["an image"]), params, 0, 64)


def test_use_tqdm_takes_a_bar_factory(smollm2):
    """vLLM's `use_tqdm` may be a callable that makes the progress bar."""
    from tqdm import tqdm

    made = []

    def bar(**kwargs):
        made.append(kwargs)
        return tqdm(**kwargs)

    smollm2.generate(["Hi", "Ho"], SamplingParams(max_tokens=1), use_tqdm=bar)
    smollm2.embed(["Hi"], use_tqdm=bar)
    assert [(m["total"], m["desc"], m["disable"]) for m in made] == [
        (2, "Generating", False),
        (1, "Embedding", False),
    ]


def test_ctrl_c_during_generate_aborts_its_requests(smollm2):
    """A KeyboardInterrupt in the caller's thread (Ctrl-C) cancels the call on the engine's
    loop, which aborts what it started: nothing runs on after it, and the next generate does
    not wait behind 16 requests of 400 tokens (which kept running before)."""
    import os
    import signal
    import threading
    import time

    # Python's own Ctrl-C handler, whatever an earlier test of this process left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        try:
            smollm2.generate([f"Story {i}:" for i in range(16)], long, use_tqdm=False)
            time.sleep(5)  # the interrupt lands here if generate returned first (it should not)
        finally:
            signal.signal(signal.SIGINT, previous)
    stats = smollm2.stats()
    assert stats["running_requests"] == 0 and stats["queued_requests"] == 0, stats
    out = smollm2.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert_kv_all_free_or_cached(smollm2)


def test_an_llm_nobody_holds_stops_its_processes(tiny_model_dirs):
    """`del llm` (or its last reference dropped) stops the runtime's processes, as vLLM's
    engine does when collected; they ran on until shutdown() or the interpreter's exit."""
    import gc
    import time
    import weakref

    import braid

    llm = braid.LLM(tiny_model_dirs["llama"], kv_tokens=256, show_progress=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    procs, held = list(llm.tm.procs.values()), weakref.ref(llm)
    assert procs and all(p.is_alive() for p in procs)
    del llm
    gc.collect()
    assert held() is None
    deadline = time.monotonic() + 20
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_alive() for p in procs)


def test_an_llm_released_on_its_loops_thread_does_not_block_it():
    """The finalizer may run on the loop's own thread (a coroutine there dropped the last
    reference, or the garbage collector ran there): waiting there for the shutdown, which the
    same loop must run, blocked the loop for good."""
    import asyncio
    import time

    from braid.runtime.front_loop import FrontLoop, release

    ran = []

    class Manager:
        async def shutdown(self):
            await asyncio.sleep(0.01)
            ran.append(True)

    front = FrontLoop()

    async def release_here():
        release(front, Manager(), None)

    front.submit(release_here()).result(timeout=5)
    deadline = time.monotonic() + 5
    while front._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ran and not front._thread.is_alive()


def test_a_script_that_never_shuts_down_exits_quietly(tiny_model_dirs):
    """At the interpreter's exit the finalizer does not run (its thread pools are gone: a
    RuntimeError traceback); the runtime's processes end with their parent."""
    import subprocess
    import sys

    script = (
        "import braid\n"
        f"llm = braid.LLM({str(tiny_model_dirs['llama'])!r}, kv_tokens=256, show_progress=False)\n"
        "print(llm.generate([[1, 2, 3]], braid.SamplingParams(max_tokens=2), use_tqdm=False)"
        "[0].outputs[0].token_ids)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_an_llm_shut_down_refuses_every_call_and_ends_one_in_flight(tiny_model_dirs):
    """`shutdown()` while another thread's generate runs ends that generate with an error
    (it waited for ever), and every call after it is the same error (stats, flush_cache,
    check_invariants and programs waited for ever on the stopped loop)."""
    import threading
    import time

    import braid

    llm = braid.LLM(tiny_model_dirs["llama"], kv_tokens=256, show_progress=False)
    outcome: dict[str, BaseException] = {}
    sp = SamplingParams(max_tokens=200, ignore_eos=True)

    def generate() -> None:
        try:
            llm.generate([[1, 2, 3]] * 64 * 4, sp, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - what it raised is the point
            outcome["error"] = e

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not llm.stats()["running_requests"]:
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.05)
    llm.shutdown()
    thread.join(30)
    assert not thread.is_alive(), "the generate in flight never returned"
    assert isinstance(outcome.get("error"), RuntimeError), outcome
    assert "has been shut down" in str(outcome["error"])
    for call in (llm.stats, llm.flush_cache, llm.check_invariants, llm.programs):
        with pytest.raises(RuntimeError, match="has been shut down"):
            call()
