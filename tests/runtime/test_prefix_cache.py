"""The prefix cache in the running engine: hits give the same tokens as cold runs (and as
transformers), chunked prefill and retraction keep fidelity, shared prefixes are computed once,
and after hundreds of mixed requests nothing leaks."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import braid
from braid import SamplingParams
from braid.runtime.forward_batch import ForwardMode
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from tests.conftest import (
    assert_kv_all_free_or_cached,
    hf_greedy,
    local_scheduler,
    run_to_end,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, and never invent facts. "
    "If you do not know, say so. Here are some examples of good answers: Paris is the capital "
    "of France. Water boils at 100 degrees Celsius at sea level."
)


_free_plus_cached = assert_kv_all_free_or_cached


def _local_free_plus_cached(s) -> None:
    s.check_invariants()
    assert not s.running and not s.waiting and s.prefilling is None
    assert s.kv.allocator.free_pages + s.kv.cache.total_pages == s.kv.allocator.capacity_pages


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dirs):
    return {
        a: AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()
        for a, p in tiny_model_dirs.items()
        if a in ("llama", "qwen2")
    }


def test_prefix_hit_gives_same_tokens_as_cold_run_and_transformers(smollm2, hf_smollm2):
    tok = smollm2.tokenizer
    smollm2.flush_cache()
    a = tok.encode(SYSTEM + " Question: what is the capital of Italy?")
    b = tok.encode(SYSTEM + " Question: how many legs does a spider have?")
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    cold = smollm2.generate([a], sp, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    warm = smollm2.generate([a], sp, use_tqdm=False)[0]
    assert warm.num_cached_tokens == len(a) - 1
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    other = smollm2.generate([b], sp, use_tqdm=False)[0]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert other.num_cached_tokens == common
    assert other.outputs[0].token_ids == hf_greedy(hf_smollm2, b, 12)
    _free_plus_cached(smollm2)


def test_offline_prompts_take_a_cache_salt_and_refuse_unknown_keys(smollm2):
    """vLLM's prompt dict key "cache_salt": only prompts with the same salt share the cached
    KV (a salted prompt misses an unsalted one's prefix and hits its own salt's); the tokens
    are the same. A key braid does not know is refused by name, never dropped."""
    tok = smollm2.tokenizer
    smollm2.flush_cache()
    ids = tok.encode(SYSTEM + " Question: what is the capital of Spain?")
    sp = SamplingParams(temperature=0.0, max_tokens=6)

    def run(**extra):
        return smollm2.generate({"prompt_token_ids": ids, **extra}, sp, use_tqdm=False)[0]

    plain = run()
    salted = [run(cache_salt=s) for s in ("tenant-a", "tenant-b", "tenant-a")]
    assert plain.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in salted] == [0, 0, len(ids) - 1]
    assert all(o.outputs[0].token_ids == plain.outputs[0].token_ids for o in salted)
    text = SYSTEM + " Question: what is the capital of Spain?"
    assert (
        smollm2.generate({"prompt": text, "cache_salt": "tenant-b"}, sp, use_tqdm=False)[
            0
        ].num_cached_tokens
        == len(ids) - 1
    )
    for bad, needle in [
        ({"prompt": "x", "mm_processor_kwargs": {}}, "unknown key(s) ['mm_processor_kwargs']"),
        ({"prompt": "x", "prompt_token_ids": [1, 2]}, "one of 'prompt' and 'prompt_token_ids'"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt must be a non-empty string"),
        ({"prompt": "x", "cache_salt": 5}, "cache_salt must be a non-empty string"),
        ({"prompt_token_ids": "x"}, "prompt_token_ids must be a list of token ids"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            smollm2.generate(bad, sp, use_tqdm=False)
    _free_plus_cached(smollm2)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_hits_and_chunked_prefill_match_transformers(tiny_model_dirs, hf_tiny, page_size):
    rng = random.Random(3)
    shared = [rng.randrange(512) for _ in range(45)]
    prompts = [shared + [rng.randrange(512) for _ in range(k)] for k in (3, 20, 41)]
    expected = [hf_greedy(hf_tiny["llama"], p, 10, eos=False) for p in prompts]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    cfg = dict(kv_tokens=2048, page_size=page_size, chunked_prefill_size=16)
    # In process, to watch the batches.
    s = local_scheduler(tiny_model_dirs["llama"], **cfg)
    sizes = []
    real = s.runner.forward

    def spy(batch):
        if batch.mode is ForwardMode.EXTEND:
            sizes.append(batch.num_tokens)
        return real(batch)

    s.runner.forward = spy
    s.handle(GenerateReq("first", prompts[0], sp, 0))
    assert run_to_end(s)["first"] == expected[0]
    assert max(sizes) <= 16 and len(sizes) >= 3  # 48 prompt tokens in chunks of 16
    # Through the engine's processes: hits on the shared prefix, same tokens.
    with braid.LLM(tiny_model_dirs["llama"], show_progress=False, **cfg) as llm:
        first = llm.generate([prompts[0]], sp, use_tqdm=False)[0]
        assert first.outputs[0].token_ids == expected[0]
        rest = llm.generate(prompts[1:], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in rest] == expected[1:]
        assert all(o.num_cached_tokens >= 40 for o in rest)
        _free_plus_cached(llm)


def test_chunks_interleave_with_running_decodes(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["qwen2"], kv_tokens=2048, chunked_prefill_size=8)
    modes = []
    real = s.runner.forward

    def spy(batch):
        modes.append(batch.mode)
        return real(batch)

    s.runner.forward = spy
    s.handle(GenerateReq("short", [1, 2, 3], SamplingParams(max_tokens=30, **GREEDY), 0))
    s.step()  # prefill "short"
    s.handle(GenerateReq("long", list(range(10, 90)), SamplingParams(max_tokens=2, **GREEDY), 0))
    modes.clear()
    for _ in range(8):
        s.step()
        s.check_invariants()
    # 80 prompt tokens in chunks of 8, a decode of "short" between any two chunks.
    assert modes == [ForwardMode.DECODE, ForwardMode.EXTEND] * 4
    assert s.prefilling is not None and s.prefilling.rid == "long"
    s.abort_all()
    _local_free_plus_cached(s)


def test_the_step_that_ends_a_chunked_prompt_admits_waiting_ones_in_its_budget(
    tiny_model_dirs, hf_tiny
):
    """40 prompt tokens in chunks of 16: the third step holds the last 8 and, in the 8 left,
    the next prompt (5 tokens), instead of an 8-token step of its own; tokens unchanged."""
    rng = random.Random(2)
    long, short = [rng.randrange(512) for _ in range(40)], [rng.randrange(512) for _ in range(5)]
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=2048, chunked_prefill_size=16)
    extends = _watch_extends(s)
    sp = SamplingParams(max_tokens=3, **GREEDY)
    s.handle(GenerateReq("long", long, sp, 0))
    s.handle(GenerateReq("short", short, sp, 1))
    got = run_to_end(s)
    assert extends == [(16, 1), (16, 1), (13, 2)]
    assert got == {
        p: hf_greedy(hf_tiny["llama"], x, 3, eos=False)
        for p, x in [("long", long), ("short", short)]
    }
    _local_free_plus_cached(s)


def _watch_extends(s) -> list[tuple[int, int]]:
    """The (tokens, requests) of every extend scheduler `s` runs from now on."""
    extends = []
    real = s.runner.forward

    def spy(batch):
        if batch.mode is ForwardMode.EXTEND:
            extends.append((batch.num_tokens, batch.batch_size))
        return real(batch)

    s.runner.forward = spy
    return extends


@pytest.mark.parametrize("avoid", [True, False], ids=["whole-prompts", "budget-filled"])
def test_a_later_prompt_that_fits_a_step_of_its_own_waits_for_it_rather_than_being_cut(
    tiny_model_dirs, hf_tiny, avoid
):
    """Budget 16, prompts of 10, 10 and 20 tokens. Avoiding partial chunks, the second waits
    for the next step (it fits whole there, not in the 6 the first leaves), and the third,
    longer than the budget, is still cut, into the room the second leaves; filling every step
    to its budget, as SGLang and vLLM do, cuts the second too. Tokens unchanged either way."""
    rng = random.Random(4)
    prompts = {rid: [rng.randrange(512) for _ in range(n)] for rid, n in zip("abc", (10, 10, 20))}
    s = local_scheduler(
        tiny_model_dirs["llama"],
        kv_tokens=2048,
        chunked_prefill_size=16,
        avoid_partial_chunks=avoid,
    )
    extends = _watch_extends(s)
    sp = SamplingParams(max_tokens=3, **GREEDY)
    for i, (rid, prompt) in enumerate(prompts.items()):
        s.handle(GenerateReq(rid, prompt, sp, i))
    got = run_to_end(s)
    if avoid:
        assert extends == [(10, 1), (16, 2), (14, 1)]  # a | b + c's first 6 | c's last 14
        assert s.stats.chunked_prompts == 1
    else:
        assert extends == [(16, 2), (16, 2), (8, 1)]  # a + b's 6 | b's 4 + c's 12 | c's 8
        assert s.stats.chunked_prompts == 2
    assert got == {rid: hf_greedy(hf_tiny["llama"], p, 3, eos=False) for rid, p in prompts.items()}
    _local_free_plus_cached(s)


def test_a_prompt_is_held_back_for_a_step_of_its_own_once_only(tiny_model_dirs):
    """lpm has no aging: a stream of requests whose system prompt is cached keeps going
    first. A 10-token prompt held back behind one of them (budget 16, 8 left) is cut behind
    the next, not held back for ever."""
    rng = random.Random(6)
    system = [rng.randrange(512) for _ in range(20)]
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=2048, chunked_prefill_size=16)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    s.handle(GenerateReq("warm", system, sp, 0))
    run_to_end(s)  # the system prompt is cached
    extends = _watch_extends(s)
    s.handle(GenerateReq("w", [rng.randrange(512) for _ in range(10)], sp, 1))
    arrivals = iter(range(3))
    s.handle(GenerateReq("x0", system + [rng.randrange(512) for _ in range(8)], sp, 2))
    while s.has_work:
        n = len(extends)
        s.step()
        if len(extends) > n and (i := next(arrivals, None)) is not None:
            s.handle(
                GenerateReq(f"x{i + 1}", system + [rng.randrange(512) for _ in range(8)], sp, 3)
            )
        s.check_invariants()
    # x0 | x1 + w's first 8 | w's last 2 + x2 | x3
    assert extends[:3] == [(8, 1), (16, 2), (10, 2)]
    _local_free_plus_cached(s)


def test_retraction_keeps_outputs_identical(tiny_model_dirs, hf_tiny):
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(20)] for _ in range(6)]
    expected = [hf_greedy(hf_tiny["qwen2"], p, 40, eos=False) for p in prompts]
    sp = SamplingParams(max_tokens=40, **GREEDY)
    # 6 x (20 + 40) = 360 tokens of KV wanted at once; the pool holds 160.
    with braid.LLM(tiny_model_dirs["qwen2"], kv_tokens=160, show_progress=False) as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert llm.stats()["retractions"] > 0
        assert [o.outputs[0].token_ids for o in outs] == expected
        _free_plus_cached(llm)


def test_n_samples_share_their_prompt_kv(smollm2):
    smollm2.flush_cache()
    ids = smollm2.tokenizer.encode(SYSTEM + " Tell me a fun fact.")
    before = smollm2.stats()
    out = smollm2.generate(
        [ids], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6), use_tqdm=False
    )[0]
    after = smollm2.stats()
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert len(out.outputs) == 4
    # The prompt is computed once; the other three samples only compute their last token.
    assert computed == len(ids) + 3
    _free_plus_cached(smollm2)


@pytest.mark.parametrize("policy, computed_once", [("lpm", True), ("fcfs", False)])
def test_lpm_computes_a_shared_prefix_once_when_requests_arrive_together(
    tiny_model_dirs, policy, computed_once
):
    # In process, so that all four surely arrive before the first step.
    rng = random.Random(9)
    shared = [rng.randrange(512) for _ in range(64)]
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=2048, schedule_policy=policy)
    for i in range(4):
        prompt = shared + [rng.randrange(512) for _ in range(4)]
        s.handle(GenerateReq(f"r{i}", prompt, SamplingParams(max_tokens=3, **GREEDY), 0))
    run_to_end(s)
    if computed_once:
        assert s.stats.prefill_tokens_computed == 68 + 3 * 4
        assert s.stats.cached_prompt_tokens == 3 * 64
    else:
        assert s.stats.prefill_tokens_computed == 4 * 68
    _local_free_plus_cached(s)


def test_disable_radix_cache_and_flush(tiny_model_dirs):
    prompt = list(range(1, 40))
    sp = SamplingParams(max_tokens=4, **GREEDY)
    with braid.LLM(
        tiny_model_dirs["llama"], kv_tokens=512, disable_radix_cache=True, show_progress=False
    ) as llm:
        a = llm.generate([prompt], sp, use_tqdm=False)[0]
        b = llm.generate([prompt], sp, use_tqdm=False)[0]
        stats = llm.stats()
        assert b.num_cached_tokens == 0 and stats["kv_cached_tokens"] == 0
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert stats["kv_free_tokens"] == stats["kv_capacity_tokens"]
    with braid.LLM(tiny_model_dirs["llama"], kv_tokens=512, show_progress=False) as llm:
        llm.generate([prompt], sp, use_tqdm=False)
        assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 38
        assert llm.flush_cache()
        stats = llm.stats()
        assert stats["kv_free_tokens"] == stats["kv_capacity_tokens"]
        assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0
        stats = llm.stats()
        assert stats["prompt_tokens"] == 3 * 39 and stats["cached_prompt_tokens"] == 38
        assert stats["cache_hit_rate"] == pytest.approx(38 / 117)
        assert stats["evicted_tokens"] >= 39


def test_flush_refused_while_requests_run(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=512)
    s.handle(GenerateReq("r", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY), 0))
    s.step()
    assert not s.flush_cache()
    s.abort_all()
    assert s.flush_cache()


@pytest.mark.parametrize("page_size", [1, 4])
def test_200_mixed_requests_with_aborts_and_failures_leak_nothing(tiny_model_dirs, page_size):
    rng = random.Random(page_size)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    s = local_scheduler(
        tiny_model_dirs["qwen3"],
        kv_tokens=600,
        page_size=page_size,
        max_running_requests=12,
        chunked_prefill_size=32,
    )
    live: list[str] = []
    finished = failed = 0
    for i in range(200):
        prompt = rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randrange(1, 30))]
        sp = SamplingParams(
            max_tokens=rng.randrange(1, 25),
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
            stop_token_ids=[rng.randrange(512)],
        )
        if i % 17 == 0:
            prompt = [10**6]  # out of vocabulary: refused, nothing queued
            with pytest.raises(ValueError):
                s.handle(GenerateReq(f"r{i}", prompt, sp, i))
            failed += 1
            continue
        s.handle(GenerateReq(f"r{i}", prompt, sp, i))
        live.append(f"r{i}")
        if i % 3 == 0:
            for out in s.step():
                if out.finish_reason:
                    finished += 1
            s.check_invariants()
        if i % 11 == 0 and live:
            s.handle(AbortReq(live.pop(rng.randrange(len(live)))))
            s.check_invariants()
    while s.has_work:
        for out in s.step():
            if out.finish_reason:
                finished += 1
        s.check_invariants()
    assert failed == 12
    _local_free_plus_cached(s)
    assert s.kv.cache.total_pages > 0
    assert s.flush_cache()
    assert s.kv.allocator.free_pages == s.kv.allocator.capacity_pages


def test_prompt_logprobs_survive_a_small_prefill_budget(tiny_model_dirs):
    """A prompt_logprobs request is never chunked (all prompt rows in one forward)."""
    s = local_scheduler(
        tiny_model_dirs["llama"], kv_tokens=512, chunked_prefill_size=16, schedule_policy="fcfs"
    )
    s.handle(GenerateReq("a", list(range(1, 11)), SamplingParams(max_tokens=2, **GREEDY), 0))
    sp = SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY)
    s.handle(GenerateReq("b", list(range(20, 30)), sp, 0))
    got = {}
    while s.has_work:
        for out in s.step():
            if out.prompt_logprobs is not None:
                got[out.rid] = out.prompt_logprobs
        s.check_invariants()
    assert len(got["b"]) == 10 and got["b"][0] is None and got["b"][1].token_id == 21


def test_a_chunked_prefill_is_retracted_before_a_running_request_is_failed(tiny_model_dirs):
    s = local_scheduler(tiny_model_dirs["llama"], kv_tokens=100, chunked_prefill_size=16)
    s.handle(GenerateReq("a", list(range(1, 11)), SamplingParams(max_tokens=85, **GREEDY), 0))
    for _ in range(41):
        s.step()
    s.handle(GenerateReq("b", list(range(100, 180)), SamplingParams(max_tokens=5, **GREEDY), 0))
    finished = {}
    while s.has_work:
        for out in s.step():
            if out.finish_reason:
                finished[out.rid] = (out.finish_reason, out.error)
        s.check_invariants()
    assert finished == {"a": ("length", None), "b": ("length", None)}
