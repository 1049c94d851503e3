"""Mixed prefill + decode steps (`enable_mixed_chunk`): while prompts are prefilled (in chunks,
with prefix-cache hits, arriving while others decode), the running requests' decode rows ride
in the same extend batch; every request's greedy tokens equal transformers' and the same
workload without mixing, the KV stays accounted after every step, and the counters show
the mixing happened."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from braid import SamplingParams
from braid.runtime.config import EngineConfig
from braid.runtime.forward_batch import ForwardMode
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import hf_greedy, local_scheduler

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _workload(seed: int = 0) -> list[tuple[int, list[int], int]]:
    """(step at which it arrives, prompt, new tokens): long prompts that need several chunks,
    short ones, and prompts sharing a 24-token prefix (cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(24)]
    work = []
    for i in range(8):
        n = rng.choice([5, 17, 40, 70])
        prompt = [rng.randrange(3, 500) for _ in range(n)]
        if i % 3 == 2:
            prompt = shared + prompt[:8]
        work.append((2 * i, prompt, rng.randint(4, 12)))
    return work


def _run(sched, work) -> tuple[dict[str, list[int]], list[tuple[ForwardMode, int, int]]]:
    """Submit each request at its step, run to the end checking invariants after every step;
    the tokens of each and, per forward, (mode, tokens, requests)."""
    forwards = []
    real = sched.runner.forward

    def spy(batch):
        forwards.append((batch.mode, batch.num_tokens, batch.batch_size))
        return real(batch)

    sched.runner.forward = spy
    tokens: dict[str, list[int]] = {}
    step, pending = 0, list(enumerate(work))
    while pending or sched.has_work:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, n) = pending.pop(0)
            sched.handle(GenerateReq(f"r{i}", prompt, SamplingParams(max_tokens=n, **GREEDY), i))
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        sched.check_invariants()
        step += 1
    return tokens, forwards


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dirs["llama"]), dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_steps_give_transformers_tokens_and_the_unmixed_ones(
    tiny_model_dirs, hf_llama, page_size
):
    work = _workload()
    kw = dict(kv_tokens=2048, chunked_prefill_size=32, page_size=page_size)
    mixed = local_scheduler(tiny_model_dirs["llama"], enable_mixed_chunk=True, **kw)
    plain = local_scheduler(tiny_model_dirs["llama"], **kw)
    got, forwards = _run(mixed, work)
    want, _ = _run(plain, work)
    assert got == want
    for i, (_, prompt, n) in enumerate(work):
        assert got[f"r{i}"] == hf_greedy(hf_llama, prompt, n, eos=False), i
    stats = mixed.stats
    assert stats.mixed_steps > 0 and stats.mixed_decode_rows >= stats.mixed_steps
    assert plain.stats.mixed_steps == 0
    # A mixed extend carries more requests than its prefill work alone, and mixing saved steps.
    assert len(forwards) < plain.stats.prefill_steps + plain.stats.decode_steps
    assert stats.cached_prompt_tokens > 0  # the shared prefix was a hit


def test_decode_rows_count_against_the_prefill_budget(tiny_model_dirs):
    """Every extend's tokens stay within the chunk budget, decode rows included."""
    sched = local_scheduler(
        tiny_model_dirs["llama"], kv_tokens=2048, chunked_prefill_size=32, enable_mixed_chunk=True
    )
    _, forwards = _run(sched, _workload(seed=3))
    extends = [f for f in forwards if f[0] is ForwardMode.EXTEND]
    assert max(tokens for _, tokens, _ in extends) <= 32
    assert any(reqs > 1 for _, _, reqs in extends)


def test_mixing_refuses_speculative_decoding_naming_both():
    with pytest.raises(ValueError, match="enable_mixed_chunk.*speculative"):
        EngineConfig(model="x", enable_mixed_chunk=True, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="enable_mixed_chunk must be true or false"):
        EngineConfig(model="x", enable_mixed_chunk="yes")
