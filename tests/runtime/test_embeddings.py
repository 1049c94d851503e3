"""Embeddings in the scheduler: pooled final hidden states equal transformers' (AutoModel's
last_hidden_state pooled in torch, float32) for last / mean / cls pooling, alone, in a batch
with generation requests (whose tokens do not change), across chunked prefill and prefix-cache
hits, with every KV slot accounted for."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from braid.runtime.ipc.to_scheduler import AbortReq, EmbedSpec, GenerateReq
from braid.runtime.sampling_params import SamplingParams
from tests.conftest import build_tiny_model, local_scheduler

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("emb")
    return {a: build_tiny_model(a, root / a) for a in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def hf_models(tiny) -> dict:
    from transformers import AutoModel

    return {
        a: AutoModel.from_pretrained(str(p), dtype=torch.float32).eval() for a, p in tiny.items()
    }


def reference(model, ids: list[int], pooling: str, normalize: bool, dims: int | None = None):
    """transformers' final hidden states of `ids`, pooled in torch."""
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
    if dims is not None:
        v = v[:dims]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def embed_req(rid: str, ids: list[int], pooling: str, normalize: bool = True, dims=None):
    return GenerateReq(
        rid, ids, SamplingParams(max_tokens=0), 0, embed=EmbedSpec(pooling, normalize, dims)
    )


def gen_req(rid: str, ids: list[int], n: int = 6):
    return GenerateReq(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), 0)


def run(sched, msgs) -> tuple[dict[str, list[int]], dict[str, np.ndarray], dict[str, int]]:
    """Submit `msgs`, step until idle checking the accounting each step; (tokens, embeddings,
    cached tokens) by rid."""
    for m in msgs:
        sched.handle(m)
    tokens, vecs, cached = {}, {}, {}
    while sched.has_work:
        for out in sched.step():
            assert out.error is None, out.error
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            cached[out.rid] = out.cached_tokens
            if out.embedding is not None:
                assert out.rid not in vecs and out.finish_reason == "stop"
                vecs[out.rid] = np.frombuffer(out.embedding, dtype="<f4")
        sched.check_invariants()
    return tokens, vecs, cached


def assert_all_free_or_cached(sched) -> None:
    u = sched.usage()
    assert u["running_requests"] == 0 and u["queued_requests"] == 0
    assert u["kv_free_tokens"] + u["kv_cached_tokens"] == u["kv_capacity_tokens"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pooled_embeddings_equal_transformers_in_a_mixed_batch(tiny, hf_models, arch):
    sched = local_scheduler(tiny[arch], kv_tokens=2048, page_size=4)
    gens = prompts(3, seed=1)
    alone, _, _ = run(sched, [gen_req(f"g{i}", p) for i, p in enumerate(gens)])
    sched.flush_cache()
    embeds = prompts(6, seed=2)
    cases = [
        (p, pooling, norm)
        for p in embeds
        for pooling in ("last", "mean", "cls")
        for norm in (True, False)
    ]
    msgs = [embed_req(f"e{i}", p, pooling, norm) for i, (p, pooling, norm) in enumerate(cases)]
    msgs[3:3] = [gen_req(f"g{i}", p) for i, p in enumerate(gens)]  # arrive among the embeddings
    tokens, vecs, _ = run(sched, msgs)
    assert {k: tokens[k] for k in alone} == alone  # generation is untouched by its neighbours
    assert set(vecs) == {f"e{i}" for i in range(len(cases))}
    for i, (p, pooling, norm) in enumerate(cases):
        want = reference(hf_models[arch], p, pooling, norm).numpy()
        assert vecs[f"e{i}"].shape == want.shape
        np.testing.assert_allclose(vecs[f"e{i}"], want, atol=TOL, rtol=0)
        if norm:
            assert abs(np.linalg.norm(vecs[f"e{i}"]) - 1.0) < 1e-5
    assert all(tokens[f"e{i}"] == [] for i in range(len(cases)))  # nothing sampled
    assert sched.stats.embedding_requests == len(cases)
    assert_all_free_or_cached(sched)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunked_prefill_pools_exactly(tiny, hf_models, pooling):
    sched = local_scheduler(tiny["llama"], kv_tokens=2048, page_size=4, chunked_prefill_size=8)
    long = prompts(3, seed=3, lo=30, hi=60)
    gen = prompts(1, seed=4)[0]
    msgs = [embed_req(f"e{i}", p, pooling, False) for i, p in enumerate(long)] + [gen_req("g", gen)]
    steps_before = sched.stats.prefill_steps
    tokens, vecs, _ = run(sched, msgs)
    assert sched.stats.prefill_steps - steps_before >= sum(len(p) for p in long) // 8
    for i, p in enumerate(long):
        want = reference(hf_models["llama"], p, pooling, False).numpy()
        np.testing.assert_allclose(vecs[f"e{i}"], want, atol=TOL, rtol=0)
    assert len(tokens["g"]) == 6
    assert_all_free_or_cached(sched)


def test_prefix_cache_hit_gives_the_same_embedding(tiny, hf_models):
    sched = local_scheduler(tiny["qwen2"], kv_tokens=2048, page_size=4)
    shared = prompts(1, seed=5, lo=24, hi=25)[0]
    a, b = shared + [7, 8, 9], shared + [10, 11]
    cold = {}
    for pooling in ("last", "mean"):
        _, vecs, cached = run(sched, [embed_req("cold", a, pooling)])
        assert cached["cold"] == 0
        cold[pooling] = vecs["cold"]
        sched.flush_cache()
    # Warm the cache with a generation over the shared prefix, then embed over it.
    run(sched, [gen_req("warm", shared + [1, 2, 3, 4], n=2)])
    _, vecs, cached = run(sched, [embed_req("hit", a, "last"), embed_req("b", b, "last")])
    assert cached["hit"] >= 16  # the shared pages came from the cache
    np.testing.assert_allclose(vecs["hit"], cold["last"], atol=1e-6, rtol=0)
    want = reference(hf_models["qwen2"], b, "last", True).numpy()
    np.testing.assert_allclose(vecs["b"], want, atol=TOL, rtol=0)
    # Mean pooling reads every position's hidden state: it never starts from a cache hit.
    _, vecs, cached = run(sched, [embed_req("mean", a, "mean")])
    assert cached["mean"] == 0
    np.testing.assert_allclose(vecs["mean"], cold["mean"], atol=1e-6, rtol=0)
    want = reference(hf_models["qwen2"], a, "mean", True).numpy()
    np.testing.assert_allclose(vecs["mean"], want, atol=TOL, rtol=0)
    # An embedding's prompt pages went to the cache, evictable: a later prompt can hit them.
    _, _, cached = run(sched, [gen_req("after", a + [5], n=1)])
    assert cached["after"] >= 24
    assert_all_free_or_cached(sched)


def test_truncated_dimensions_are_renormalized(tiny, hf_models):
    sched = local_scheduler(tiny["llama"], kv_tokens=1024)
    p = prompts(1, seed=6)[0]
    _, vecs, _ = run(sched, [embed_req("d", p, "last", True, 16)])
    want = reference(hf_models["llama"], p, "last", True, 16).numpy()
    assert vecs["d"].shape == (16,)
    np.testing.assert_allclose(vecs["d"], want, atol=TOL, rtol=0)


def test_bad_embedding_requests_are_refused_and_leak_nothing(tiny):
    sched = local_scheduler(tiny["llama"], kv_tokens=1024)
    bad = [
        embed_req("unknown", [1, 2, 3], "weighted"),
        embed_req("dims", [1, 2, 3], "last", True, 0),
        embed_req("vocab", [1, 600], "last"),
        embed_req("long", [1] * (sched.context_length + 1), "last"),
    ]
    for m in bad:
        with pytest.raises(ValueError, match=r"^(pooling|dimensions|prompt|input):"):
            sched.handle(m)
    _, vecs, _ = run(sched, [embed_req("fits", [3] * sched.context_length, "last")])
    assert vecs["fits"].shape == (64,)
    sched.handle(embed_req("gone", [1, 2, 3, 4], "mean"))
    outs = sched.handle(AbortReq("gone"))
    assert outs[0].finish_reason == "abort" and outs[0].embedding is None
    sched.check_invariants()
    assert_all_free_or_cached(sched)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_a_checkpoint_without_lm_head_embeds_and_refuses_generation(tmp_path, arch):
    """transformers' `Qwen2Model` / `MistralModel` saved alone (keys without `model.`, no
    `lm_head`), as embedding models are published."""
    from transformers import AutoModel

    import braid
    from tests.conftest import _tiny_config

    torch.manual_seed(7)
    body = AutoModel.from_config(_tiny_config(arch), dtype=torch.float32).eval()
    body.save_pretrained(str(tmp_path))
    p = prompts(1, seed=8, lo=30, hi=31)[0]
    with braid.LLM(tmp_path, kv_tokens=512, show_progress=False, pooling="mean") as llm:
        assert llm.model_config.architecture == type(body).__name__
        got = llm.embed([p], use_tqdm=False)[0].outputs.embedding
        np.testing.assert_allclose(got, reference(body, p, "mean", True).numpy(), atol=TOL, rtol=0)
        with pytest.raises(ValueError, match="no LM head"):
            llm.generate([p], use_tqdm=False)

        # Past the front end's check, the scheduler refuses too; nothing leaks. (Submitted on
        # the engine's loop, where the manager's sockets live.)
        async def submit():
            return llm.tm.submit("x", p, SamplingParams(max_tokens=2))

        assert llm._call(submit()) == ["x"]

        async def last():
            return [o async for o in llm.tm.stream("x")][-1]

        o = llm._call(last())
        assert o.refused is not None and o.refused.param == "prompt" and "no LM head" in o.error
        llm.check_invariants()


def test_embedding_messages_round_trip_the_codec():
    from braid.runtime.ipc import codec
    from braid.runtime.ipc.to_detokenizer import BatchTokenOut, TokenOut
    from braid.runtime.ipc.to_tokenizer import BatchStrOut, StrOut

    vec = np.arange(5, dtype="<f4").tobytes()
    for msg in (
        embed_req("r", [1, 2], "mean", False, 3),
        BatchTokenOut([TokenOut("r", [], 2, 0, "stop", embedding=vec)]),
        BatchStrOut([StrOut("r", "", [], 2, 0, 0, "stop", embedding=vec)]),
    ):
        assert codec.decode(codec.encode(msg)) == msg
