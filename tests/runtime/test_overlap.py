"""Overlapped decode (`overlap_schedule`): the next decode step is queued before the current one
is read back. It must change nothing a caller sees: the same tokens, logprobs and finish
reasons as reading every step back at once, with every KV page accounted for after aborts,
stop tokens, length limits and requests joining mid-flight."""

from __future__ import annotations

import pytest
import torch

import braid
from braid import SamplingParams
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from tests.conftest import hf_greedy, local_scheduler

GREEDY = dict(temperature=0.0, ignore_eos=True)
ALLOWED = [3, 17, 40]


def _scheduler(path, overlap: bool, device: str = "cpu"):
    sched = local_scheduler(
        path, kv_tokens=1024, overlap_schedule=overlap, device=device, dtype="float32"
    )
    ran_ahead = []
    real = sched._run_ahead

    def counting(launched):
        step = real(launched)
        ran_ahead.append(step is not None)
        return step

    sched._run_ahead = counting
    return sched, ran_ahead


def _step(sched, got: dict[str, dict]) -> None:
    """One step, adding each request's new tokens, logprobs and finish reason to `got`."""
    for out in sched.step():
        g = got.setdefault(out.rid, {"ids": [], "lp": [], "finish": None})
        g["ids"] += out.new_token_ids
        g["lp"] += [lp.logprob for lp in out.logprobs or []]
        g["finish"] = out.finish_reason
    sched.check_invariants()


def _run(sched, got: dict[str, dict] | None = None) -> dict[str, dict]:
    """Step to the end."""
    got = {} if got is None else got
    while sched.has_work:
        _step(sched, got)
    return got


def _all_kv_free_or_cached(sched) -> None:
    a = sched.kv.allocator
    assert not sched.running and not sched.waiting and sched._launched is None
    assert a.free_pages + sched.kv.cache.total_pages == a.capacity_pages
    assert sched.kv.table.free_slots == sched.kv.table.size


def _mixed_requests(stop_token: int | None) -> list[GenerateReq]:
    reqs = [
        GenerateReq("greedy-5", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY), 0),
        # A one-token bad word: a fixed mask (no output read), so its steps run ahead too.
        GenerateReq(
            "greedy-17",
            [4, 5, 6, 7, 8],
            SamplingParams(max_tokens=17, bad_words_token_ids=[[3]], **GREEDY),
            0,
        ),
        # The draw's noise is indexed by output position: running ahead must keep the index.
        GenerateReq(
            "sampled",
            [9, 10, 11],
            SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, ignore_eos=True),
            1234,
        ),
        GenerateReq(
            "min-tokens",
            [12, 13],
            SamplingParams(max_tokens=9, min_tokens=6, temperature=0.0),
            0,
        ),
        GenerateReq(
            "logprobs",
            [14, 15, 16],
            # allowed_token_ids: a fixed mask too
            SamplingParams(max_tokens=8, logprobs=3, allowed_token_ids=ALLOWED, **GREEDY),
            0,
        ),
    ]
    if stop_token is not None:
        reqs.append(
            GenerateReq(
                "stops",
                [1, 2, 3],
                SamplingParams(max_tokens=12, stop_token_ids=[stop_token], temperature=0.0),
                0,
            )
        )
    return reqs


def _same_tokens_logprobs_and_finishes(path, device: str) -> None:
    plain, _ = _scheduler(path, overlap=False, device=device)
    for r in _mixed_requests(None):
        plain.handle(r)
    first = _run(plain)
    # Stop "stops" (same prompt as "greedy-5") at its 4th greedy token: the step run ahead
    # of that one is dropped.
    stop = first["greedy-5"]["ids"][3]
    plain, _ = _scheduler(path, overlap=False, device=device)
    over, ran_ahead = _scheduler(path, overlap=True, device=device)
    for s in (plain, over):
        for r in _mixed_requests(stop):
            s.handle(r)
    expected, got = _run(plain), _run(over)
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        assert (got[rid]["ids"], got[rid]["finish"]) == (want["ids"], want["finish"]), rid
        assert got[rid]["lp"] == pytest.approx(want["lp"], abs=1e-4), rid
    assert expected["stops"]["finish"] == "stop" and expected["stops"]["ids"][-1] == stop
    assert len(expected["stops"]["ids"]) <= 4
    assert expected["min-tokens"]["finish"] == "length"
    assert len(expected["logprobs"]["lp"]) == 8
    assert (
        set(expected["logprobs"]["ids"]) <= set(ALLOWED) and 3 not in expected["greedy-17"]["ids"]
    )
    assert sum(ran_ahead) >= 10, "decode steps should have run ahead"
    _all_kv_free_or_cached(over)
    # Same step count apart from the steps run ahead of a stop (length limits are foreseen).
    assert over.stats.decode_steps - plain.stats.decode_steps in (0, 1)


def test_overlap_gives_the_same_tokens_logprobs_and_finishes(tiny_model_dirs):
    _same_tokens_logprobs_and_finishes(tiny_model_dirs["qwen3"], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_on_cuda_gives_the_same_tokens_logprobs_and_finishes(tiny_model_dirs):
    """On CUDA the step ahead really runs while the host reads the last one back (triton
    backend, CUDA graphs, pinned copies)."""
    _same_tokens_logprobs_and_finishes(tiny_model_dirs["llama"], "cuda")


def test_a_penalised_request_makes_its_batch_wait(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    plain, _ = _scheduler(path, overlap=False)
    over, ran_ahead = _scheduler(path, overlap=True)
    sp = SamplingParams(max_tokens=10, repetition_penalty=1.3, **GREEDY)
    for s in (plain, over):
        s.handle(GenerateReq("pen", [5, 5, 6], sp, 0))
        s.handle(GenerateReq("free", [7, 8], SamplingParams(max_tokens=10, **GREEDY), 0))
    assert _run(over) == _run(plain)
    assert not any(ran_ahead), "penalties read the output on the host: no step may run ahead"
    _all_kv_free_or_cached(over)


def test_abort_while_a_step_runs_ahead_frees_its_kv(tiny_model_dirs):
    over, ran_ahead = _scheduler(tiny_model_dirs["qwen3"], overlap=True)
    sp = SamplingParams(max_tokens=40, **GREEDY)
    over.handle(GenerateReq("keep", [1, 2, 3, 4], sp, 0))
    over.handle(GenerateReq("drop", [5, 6, 7], sp, 0))
    got: dict[str, dict] = {}
    while not any(ran_ahead):
        _step(over, got)
    assert over._launched is not None
    outs = over.handle(AbortReq("drop"))
    assert [(o.rid, o.finish_reason) for o in outs] == [("drop", "abort")]
    over.check_invariants()
    got = _run(over, got)
    assert got["drop"]["finish"] is None, "the aborted request's run-ahead step was dropped"
    assert got["keep"]["finish"] == "length" and len(got["keep"]["ids"]) == 40
    _all_kv_free_or_cached(over)


def test_a_request_arriving_mid_flight_gets_the_tokens_it_gets_alone(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    alone, _ = _scheduler(path, overlap=False)
    late = GenerateReq("late", [9, 8, 7, 6], SamplingParams(max_tokens=9, **GREEDY), 0)
    alone.handle(late)
    expected = _run(alone)["late"]["ids"]
    over, ran_ahead = _scheduler(path, overlap=True)
    over.handle(GenerateReq("early", [1, 2], SamplingParams(max_tokens=30, **GREEDY), 0))
    got: dict[str, dict] = {}
    while not any(ran_ahead):
        _step(over, got)
    over.handle(late)
    got = _run(over, got)
    assert got["late"]["ids"] == expected
    assert len(got["early"]["ids"]) == 30
    _all_kv_free_or_cached(over)


@pytest.mark.parametrize("overlap", [None, True, False])
def test_overlap_setting_defaults_to_cuda_only(overlap):
    cfg = braid.runtime.config.EngineConfig(device="cpu", overlap_schedule=overlap)
    assert cfg.use_overlap_schedule is bool(overlap)
    cuda = braid.runtime.config.EngineConfig(device="cuda", overlap_schedule=overlap)
    assert cuda.use_overlap_schedule is (overlap is not False)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_overlap_setting_rejects_non_booleans(bad):
    with pytest.raises(ValueError, match="overlap_schedule"):
        braid.runtime.config.EngineConfig(overlap_schedule=bad)


def test_smollm2_with_overlap_matches_transformers(smollm2_dir, hf_smollm2):
    """Real weights, stops at EOS (so steps run ahead of a stop are dropped), batched."""
    with braid.LLM(smollm2_dir, kv_tokens=4096, overlap_schedule=True, show_progress=False) as llm:
        tok = llm.tokenizer
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2+2?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
        ids.append(tok.encode(chat, add_special_tokens=False))
        expected = [hf_greedy(hf_smollm2, p, 24) for p in ids]
        sp = SamplingParams(temperature=0.0, max_tokens=24)
        got = [o.outputs[0].token_ids for o in llm.generate(ids, sp, use_tqdm=False)]
        llm.check_invariants()
    assert got == expected
    assert any(len(t) < 24 for t in expected), "one prompt should stop at EOS"


def test_steps_run_ahead_while_a_backlog_waits_for_kv(tiny_model_dirs):
    """Requests that cannot be admitted until KV frees up do not stop the running ones from
    running ahead, and are admitted (not starved) once it does: same tokens as plain."""
    path = tiny_model_dirs["qwen3"]
    sp = SamplingParams(max_tokens=30, **GREEDY)
    reqs = [GenerateReq(f"r{i}", [1 + i] * 10, sp, 0) for i in range(4)]
    runs = []
    for overlap in (False, True):
        sched = local_scheduler(
            path, kv_tokens=96, overlap_schedule=overlap, device="cpu", dtype="float32"
        )
        ran_ahead_waiting = []
        real = sched._run_ahead

        def counting(launched, sched=sched, real=real, log=ran_ahead_waiting):
            step = real(launched)
            log.append(step is not None and bool(sched.waiting))
            return step

        sched._run_ahead = counting
        for r in reqs:
            sched.handle(r)
        runs.append((_run(sched), ran_ahead_waiting, sched))
    (plain, _, _), (over, ahead_waiting, sched) = runs
    assert {rid: g["ids"] for rid, g in over.items()} == {rid: g["ids"] for rid, g in plain.items()}
    assert all(len(g["ids"]) == 30 for g in over.values())
    assert sum(ahead_waiting) >= 5, "decode should run ahead while the backlog waits"
    _all_kv_free_or_cached(sched)


# ---- constrained rows: forward queued ahead, masks filled after the read-back -----------------
KEYED = r'\{"country_code": "[A-Z]{2}", "city": "[a-z ]{4,12}", "ok": (true|false)\}'


@pytest.fixture(scope="module")
def tiny_constrained(tmp_path_factory):
    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-overlap-grammar"))


def _constrained_requests(n: int) -> list[GenerateReq]:
    """Greedy and sampled regex rows (their grammars force `", "city": "` and `", "ok": `
    mid-output: jump-forward while a step runs ahead), beside unconstrained rows."""
    reqs = []
    for i in range(n):
        sp = [
            SamplingParams(max_tokens=32, temperature=0.0, regex=KEYED),
            SamplingParams(max_tokens=32, temperature=0.8, seed=i, regex=KEYED),
            SamplingParams(max_tokens=12 + i, **GREEDY),
        ][i % 3]
        reqs.append(GenerateReq(f"r{i}", [3, 4, 5 + i], sp, sp.seed or 0))
    return reqs


def _constrained_same_tokens(path, eos: int, jump: bool, device: str) -> None:
    runs = []
    for overlap in (False, True):
        sched = local_scheduler(
            path,
            frozenset({eos}),
            kv_tokens=1024,
            overlap_schedule=overlap,
            dtype="float32",
            device=device,
        )
        sched.grammars.jump_forward_enabled = jump
        for r in _constrained_requests(6):
            sched.handle(r)
        got = _run(sched)
        _all_kv_free_or_cached(sched)
        counters = sched.control("stats")
        assert counters["grammar_masked_rows"] > 0 and counters["grammar_mask_seconds"] > 0
        runs.append((got, sched.stats))
    (want, plain), (got, over) = runs
    assert got.keys() == want.keys() and len(got) == 6
    for rid, w in want.items():
        assert (got[rid]["ids"], got[rid]["finish"]) == (w["ids"], w["finish"]), rid
    assert plain.constrained_steps_ahead == 0
    # Each jump is an extend, which ends a run of steps queued ahead.
    assert over.constrained_steps_ahead >= (5 if jump else 20), over.constrained_steps_ahead
    assert (over.jump_forward_tokens > 0) == jump
    assert over.jump_forward_tokens == plain.jump_forward_tokens


@pytest.mark.parametrize("jump", [True, False])
def test_constrained_rows_run_ahead_with_the_same_tokens(tiny_constrained, jump):
    """The same tokens with overlap on and off, greedy and sampled, with jump-forward on (rows
    jumped while a step ran ahead are dropped and their KV recomputed) and off; constrained
    steps really were queued ahead, and every KV page is accounted for."""
    _constrained_same_tokens(*tiny_constrained, jump, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("jump", [True, False])
def test_constrained_rows_run_ahead_on_cuda(tiny_constrained, jump):
    """On CUDA the forward queued ahead (a CUDA graph) runs while the host fills the masks."""
    _constrained_same_tokens(*tiny_constrained, jump, "cuda")


def test_a_request_with_a_multi_token_bad_word_makes_its_batch_wait(tiny_model_dirs):
    """A bad word of two tokens reads the output on the host (as penalties do): no step runs
    ahead, and the tokens are those of reading every step back. A one-token word is a fixed
    ban: its steps still run ahead."""
    path = tiny_model_dirs["qwen3"]
    free, _ = _scheduler(path, overlap=False)
    free.handle(GenerateReq("free", [5, 5, 6], SamplingParams(max_tokens=10, **GREEDY), 0))
    ids = _run(free)["free"]["ids"]
    word = [ids[2], ids[3]]  # the plain run says these two in a row
    for words, may_run_ahead in (([word], False), ([[ids[0]]], True)):
        sp = SamplingParams(max_tokens=10, bad_words_token_ids=words, **GREEDY)
        plain, _ = _scheduler(path, overlap=False)
        over, ran_ahead = _scheduler(path, overlap=True)
        for s in (plain, over):
            s.handle(GenerateReq("bad", [5, 5, 6], sp, 0))
            s.handle(GenerateReq("other", [7, 8], SamplingParams(max_tokens=10, **GREEDY), 0))
        want = _run(plain)
        assert _run(over) == want
        got = want["bad"]["ids"]
        if len(words[0]) == 2:
            assert got[:3] == ids[:3] and got[3] != ids[3]
            assert not any(ran_ahead), "the word reads the output: no step may run ahead"
        else:
            assert ids[0] not in got and got != ids
            assert any(ran_ahead) is may_run_ahead
        _all_kv_free_or_cached(over)
