"""`/v1/embeddings` through a real `braid serve` with the real `openai` client, and
`LLM.embed`: vectors equal transformers' pooled hidden states (float32, 1e-5), base64 and float
encodings, Matryoshka `dimensions`, the sentence-transformers pooling config, generation running
alongside unchanged, bad input refused with a 400 naming the field, no KV leaked."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from braid.runtime.pooling import PoolingConfig
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.conftest import build_tiny_model
from tests.runtime.tiny_tokenizers import build_byte_level_bpe
from tests.server.conftest import start_server, wait_idle

TOL = 1e-5
TEXTS = ["The quick brown fox", "hello world", '{"name": "Ann", "age": 41}', "apple banana"]


def add_sentence_transformers_config(path, mode: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = {
        f"pooling_mode_{m}": m == mode
        for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
    }
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **flags})
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with a tokenizer, Matryoshka dimensions and a sentence-transformers config
    saying mean pooling, normalized."""
    path = build_tiny_model("qwen2", tmp_path_factory.mktemp("emb") / "qwen2")
    build_byte_level_bpe(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32, 64]
    (path / "config.json").write_text(json.dumps(cfg))
    add_sentence_transformers_config(path, "mean_tokens", normalize=True)
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    # The tokenizer the server loads (transformers' AutoTokenizer picks Qwen2's own class for
    # this config, whose pre-tokenizer splits digits differently).
    return model, load_tokenizer(model_dir)


def reference(model, ids, pooling="mean", normalize=True, dims=None) -> np.ndarray:
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
    v = v[:dims] if dims else v
    return (torch.nn.functional.normalize(v, dim=0) if normalize else v).numpy()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("serve"), "--model", str(model_dir), "--page-size", "4"
    )
    yield s
    s.stop()


def test_openai_client_embeddings_equal_transformers(server, hf):
    model, tok = hf
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    res = client.embeddings.create(input=TEXTS, model="tiny")  # the client asks for base64
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    ids = [tok.encode(t) for t in TEXTS]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    for d, p in zip(res.data, ids):
        np.testing.assert_allclose(d.embedding, reference(model, p), atol=TOL, rtol=0)
    floats = client.embeddings.create(input=TEXTS[0], model="tiny", encoding_format="float")
    assert floats.data[0].embedding == res.data[0].embedding  # float32 values either way
    # Token ids, a list of them, fewer (Matryoshka) dimensions, and no normalization.
    one = client.embeddings.create(input=ids[1], model="tiny", dimensions=32)
    assert len(one.data[0].embedding) == 32
    np.testing.assert_allclose(
        one.data[0].embedding, reference(model, ids[1], dims=32), atol=TOL, rtol=0
    )
    raw = client.embeddings.create(input=ids[2:], model="tiny", extra_body={"normalize": False})
    for d, p in zip(raw.data, ids[2:]):
        np.testing.assert_allclose(
            d.embedding, reference(model, p, normalize=False), atol=TOL, rtol=0
        )


def test_truncate_prompt_tokens_embeds_the_prompts_tail(server, hf):
    """vLLM's `truncate_prompt_tokens`: each input's last k tokens (usage counts what was
    embedded); -1 keeps as many as the context takes, so a prompt longer than the context
    is embedded by its tail instead of refused."""
    model, tok = hf
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    ids = [tok.encode(t) for t in TEXTS[:2]]
    res = client.embeddings.create(
        input=TEXTS[:2], model="tiny", extra_body={"truncate_prompt_tokens": 3}
    )
    assert len(ids[0]) > 3 and res.usage.prompt_tokens == sum(min(len(p), 3) for p in ids)
    for d, p in zip(res.data, ids):
        np.testing.assert_allclose(d.embedding, reference(model, p[-3:]), atol=TOL, rtol=0)
    context = httpx.get(f"{server.url}/get_server_info").json()["context_length"]
    long = [(7 * i) % 500 + 3 for i in range(context + 40)]
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == context
    np.testing.assert_allclose(
        r.json()["data"][0]["embedding"], reference(model, long[-context:]), atol=TOL, rtol=0
    )


def test_wire_format_and_base64(server, hf):
    model, tok = hf
    r = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": ["hello world"], "encoding_format": "base64"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] and body["id"].startswith("embd-")
    item = body["data"][0]
    assert item["object"] == "embedding" and item["index"] == 0
    vec = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, reference(model, tok.encode("hello world")), atol=TOL, rtol=0)
    n = len(tok.encode("hello world"))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello world"})
    assert r.json()["data"][0]["embedding"] == vec.tolist()


def test_generation_alongside_embeddings_is_unchanged(server):
    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")
        kw = dict(model="tiny", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
        try:
            alone = (await ac.completions.create(prompt="hello world and", **kw)).choices[0].text
            gens = [ac.completions.create(prompt="hello world and", **kw) for _ in range(3)]
            embeds = [ac.embeddings.create(input=TEXTS * 4, model="tiny") for _ in range(4)]
            done = await asyncio.gather(*gens, *embeds)
            return alone, [d.choices[0].text for d in done[:3]], done[3:]
        finally:
            await ac.close()

    alone, texts, embeds = asyncio.run(run())
    assert texts == [alone] * 3
    first = [d.embedding for d in embeds[0].data]
    for e in embeds[1:]:
        np.testing.assert_allclose([d.embedding for d in e.data], first, atol=1e-6, rtol=0)
    stats = wait_idle(server.url)
    assert stats["embedding_requests"] >= 64


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [[1, 2, 600]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1] * 600}, "input"),
        ({}, "input"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "dimensions": 20}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "normalize": "yes"}, "normalize"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "hi", "truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
        ({"input": "hi", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_server_keeps_serving_and_leaks_no_kv(server):
    for body in ({"input": ""}, {"input": [[1, 2, 600]]}, {"input": "x", "dimensions": 7}):
        assert httpx.post(f"{server.url}/v1/embeddings", json=body).status_code == 400
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS})
    assert r.status_code == 200 and len(r.json()["data"]) == len(TEXTS)
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_pooling_config_refuses_dimensions_without_matryoshka(tmp_path):
    cfg = PoolingConfig.from_model(tmp_path, 64, {}, None)
    assert (cfg.method, cfg.normalize) == ("last", True)
    with pytest.raises(ValueError, match="^dimensions: this model does not support Matryoshka"):
        cfg.spec(dimensions=32)
    any_size = PoolingConfig.from_model(tmp_path, 64, {"is_matryoshka": True}, "cls")
    assert any_size.spec(dimensions=7).dimensions == 7 and any_size.method == "cls"
    add_sentence_transformers_config(tmp_path, "max_tokens", normalize=False)
    with pytest.raises(ValueError, match="^input: this model cannot embed: .*max_tokens"):
        PoolingConfig.from_model(tmp_path, 64, {}, None).spec()
    assert PoolingConfig.from_model(tmp_path, 64, {}, "mean").spec().pooling == "mean"


def test_llm_embed(tmp_path):
    from transformers import AutoModel

    import braid

    path = build_tiny_model("llama", tmp_path / "llama")
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], list(range(40, 90))]
    with braid.LLM(path, kv_tokens=1024, show_progress=False, chunked_prefill_size=16) as llm:
        outs = llm.embed(prompts, use_tqdm=False)
        for o, p in zip(outs, prompts):
            assert o.prompt_token_ids == p and o.finished
            np.testing.assert_allclose(
                o.outputs.embedding, reference(model, p, "last"), atol=TOL, rtol=0
            )
        raw = llm.embed({"prompt_token_ids": prompts[2]}, normalize=False, use_tqdm=False)
        np.testing.assert_allclose(
            raw[0].outputs.embedding, reference(model, prompts[2], "last", False), atol=TOL, rtol=0
        )
        with pytest.raises(ValueError, match="^dimensions:"):
            llm.embed([1, 2], dimensions=8)
        # vLLM's truncate_prompt_tokens and PoolingParams: the tail's vector, as the keyword
        # or in pooling_params (use_activation: vLLM's newer name for normalize).
        tail = llm.embed(prompts[2], truncate_prompt_tokens=7, use_tqdm=False)[0]
        assert tail.prompt_token_ids == prompts[2][-7:]
        np.testing.assert_allclose(
            tail.outputs.embedding, reference(model, prompts[2][-7:], "last"), atol=TOL, rtol=0
        )
        pp = braid.PoolingParams(truncate_prompt_tokens=7, use_activation=False)
        raw_tail = llm.embed(prompts[2], pooling_params=pp, use_tqdm=False)[0]
        np.testing.assert_allclose(
            raw_tail.outputs.embedding,
            reference(model, prompts[2][-7:], "last", False),
            atol=TOL,
            rtol=0,
        )
        whole = llm.embed(prompts[1], truncate_prompt_tokens=-1, use_tqdm=False)[0]
        assert whole.prompt_token_ids == prompts[1]
        with pytest.raises(ValueError, match="^truncate_prompt_tokens: must be an integer >= 1"):
            llm.embed([1, 2], truncate_prompt_tokens=0)
        with pytest.raises(ValueError, match="^pooling_params: must be one PoolingParams"):
            llm.embed([1, 2], pooling_params=[braid.PoolingParams()])
        with pytest.raises(ValueError, match="^dimensions: given as 8 and as pooling_params"):
            llm.embed([1, 2], dimensions=8, pooling_params=braid.PoolingParams(dimensions=16))
        with pytest.raises(ValueError, match="^normalize: pooling_params: normalize and use_act"):
            llm.embed(
                [1, 2], pooling_params=braid.PoolingParams(normalize=True, use_activation=False)
            )
        with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
            llm.embed([[1, 2], []])
        with pytest.raises(ValueError, match="prompt 0: token id 600"):
            llm.embed([[1, 600]])
        gen = llm.generate(
            [prompts[0]],
            braid.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert len(gen[0].outputs[0].token_ids) == 4
        assert llm.stats()["embedding_requests"] == 7
        llm.check_invariants()
        s = llm.stats()
        assert s["kv_free_tokens"] + s["kv_cached_tokens"] == s["kv_capacity_tokens"]
    with braid.LLM(path, kv_tokens=1024, show_progress=False, pooling="mean") as llm:
        out = llm.embed(prompts[2], use_tqdm=False)[0]
        np.testing.assert_allclose(
            out.outputs.embedding, reference(model, prompts[2], "mean"), atol=TOL, rtol=0
        )
