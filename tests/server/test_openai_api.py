"""`braid serve` driven by the official `openai` client and by plain HTTP."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from braid.runtime.server.openai_types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
)
from tests.server.conftest import sse_data, wait_idle

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2-135m"]


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, temperature=0, max_tokens=24
    )
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    chunks = client.chat.completions.create(
        model="smollm2-135m",
        messages=CHAT,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for ch in chunks:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streaming_equals_non_streaming(client):
    kw = dict(
        model="smollm2-135m", prompt="The three primary colors are", temperature=0, max_tokens=20
    )
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].text and full.choices[0].text
    assert full.usage.completion_tokens == 20


def test_n_samples_and_seed(client):
    kw = dict(model="smollm2-135m", prompt="My favourite animal is", max_tokens=10, temperature=1.0)
    out = client.completions.create(**kw, n=2, seed=11)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text
    again = client.completions.create(**kw, n=2, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert out.usage.completion_tokens == 20


def test_logprobs_in_chat_and_completions(client):
    chat = client.chat.completions.create(
        model="smollm2-135m",
        messages=CHAT,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.token == item.top_logprobs[0].token  # greedy: the chosen is the top one
    comp = client.completions.create(
        model="smollm2-135m", prompt="1, 2, 3,", temperature=0, max_tokens=4, logprobs=3
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 3
    assert "".join(lp.tokens) == comp.choices[0].text


def test_repeated_prompt_reports_cached_tokens(client):
    msgs = [{"role": "user", "content": "Tell me something about the ocean, in one line."}]
    first = client.chat.completions.create(
        model="smollm2-135m", messages=msgs, temperature=0, max_tokens=4
    )
    second = client.chat.completions.create(
        model="smollm2-135m", messages=msgs, temperature=0, max_tokens=4
    )
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert first.choices[0].message.content == second.choices[0].message.content


def test_chat_without_max_tokens_runs_past_completions_default_of_16(client, server):
    """Chat's max_tokens defaults to the context (vLLM's and SGLang's), not completions' 16:
    min_tokens 17 with no max_tokens used to be refused as more than max_tokens (16). Every
    token is a "." (logit_bias), so the stop string ends it right after min_tokens."""
    (dot,) = httpx.post(server.url + "/tokenize", json={"prompt": "."}).json()["tokens"]
    out = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Tell me about the ocean."}],
        temperature=0,
        stop=["."],
        logit_bias={str(dot): 100},
        extra_body={"min_tokens": 17},
    )
    assert out.usage.completion_tokens == 18 and out.choices[0].finish_reason == "stop"


def test_log_requests_logs_one_line_per_request(client, server):
    """--log-requests (SGLang's flag; the module's server has it): one line per request as
    it ends. Nothing logged requests before, at any level."""
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="Hi", max_tokens=1, temperature=-1)
    # Each line is written as its request ends, after the client may have the answer.
    server.wait_for_log(r"127\.0\.0\.1:\d+ POST /v1/chat/completions 200 in \d")
    server.wait_for_log(r"POST /v1/completions 400 in \d+\.\d{3} s$")


def test_extras_via_extra_body(client):
    out = client.completions.create(
        model="smollm2-135m",
        prompt="Count: 1, 2, 3,",
        max_tokens=6,
        temperature=0.9,
        extra_body={"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.0, "ignore_eos": True},
    )
    greedy = client.completions.create(
        model="smollm2-135m", prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0
    )
    assert out.choices[0].text == greedy.choices[0].text


def test_64_concurrent_streams_all_finish(server):
    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")

        async def one(i: int) -> str:
            stream = await ac.completions.create(
                model="smollm2-135m",
                prompt=f"Fact number {i}:",
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text, finish = "", None
            async for ch in stream:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            assert finish == "length"
            return text

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await ac.close()

    texts = asyncio.run(run())
    assert len(texts) == 64 and all(texts)
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_client_disconnect_aborts_and_frees_kv(server):
    body = {
        "prompt": "Write a very long story:",
        "max_tokens": 2000,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # hang up mid-stream
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_native_endpoints(server):
    url = server.url
    one = httpx.post(
        f"{url}/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    ).json()
    assert one["meta_info"]["completion_tokens"] == 4 and len(one["output_ids"]) == 4
    assert one["meta_info"]["finish_reason"]["type"] == "length"
    assert one["meta_info"]["e2e_latency"] > 0
    batch = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": [[1, 2, 3], [4, 5]],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True,
        },
    ).json()
    assert [len(b["output_ids"]) for b in batch] == [2, 2]
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 2
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["context_length"] == 8192 and info["is_generation"]
    sinfo = httpx.get(f"{url}/get_server_info").json()
    assert sinfo["kv_capacity_tokens"] == 8192 and set(sinfo["pids"]) >= {
        "scheduler",
        "detokenizer",
    }
    wait_idle(url)
    assert httpx.post(f"{url}/flush_cache").status_code == 200
    stats = httpx.get(f"{url}/get_server_info").json()["stats"]
    assert stats["kv_free_tokens"] == stats["kv_capacity_tokens"]
    assert (
        httpx.post(f"{url}/abort_request", json={"rid": "nothing-by-this-name"}).status_code == 200
    )
    metrics = httpx.get(f"{url}/metrics").text
    for name in (
        "braid_num_running_requests",
        "braid_num_queued_requests",
        "braid_prompt_tokens_total",
        "braid_generation_tokens_total",
        "braid_cache_hit_rate",
        "braid_kv_usage",
        "braid_time_to_first_token_seconds_bucket",
        "braid_inter_token_latency_seconds_count",
    ):
        assert name in metrics
    streamed = httpx.post(
        f"{url}/generate",
        json={
            "text": "Hi",
            "stream": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
    ).text
    assert streamed.strip().endswith("data: [DONE]")


def test_streamed_logprobs_cover_every_token_with_running_offsets(server):
    import json as _json

    body = {
        "prompt": "A list: one, two,",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
        "stream": True,
    }
    tokens, offsets, text = [], [], ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = _json.loads(line[6:])["choices"][0]
                if ch["logprobs"]:
                    tokens += ch["logprobs"]["tokens"]
                    offsets += ch["logprobs"]["text_offset"]
                text += ch["text"]
    assert len(tokens) == 8 and "".join(tokens) == text
    assert (
        offsets == sorted(offsets)
        and offsets[0] == 0
        and offsets[-1] == len(text) - len(tokens[-1])
    )


def test_response_format_json_schema(client):
    import json as _json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Name a city as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    jsonschema.validate(_json.loads(out.choices[0].message.content), schema)


def test_completions_echo_returns_prompt_logprobs(client, server):
    prompt = "The capital of France is"
    model = client.models.list().data[0].id
    only = client.completions.create(
        model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    lp = only.choices[0].logprobs
    n = len(httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert only.choices[0].text == prompt
    assert len(lp.tokens) == n and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    more = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, echo=True, logprobs=0, temperature=0
    )
    assert more.choices[0].text.startswith(prompt)
    again = more.choices[0].logprobs.token_logprobs
    assert again[0] is None and again[1:n] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert len(again) == n + 2


def test_generate_speaks_sglangs_native_fields(server):
    url = server.url
    gen = f"{url}/generate"
    # n samples of one prompt: a list, one result per sample.
    two = httpx.post(
        gen,
        json={
            "text": "Once upon a time",
            "rid": "two",
            "sampling_params": {"n": 2, "max_new_tokens": 3},
        },
    ).json()
    assert [r["meta_info"]["id"] for r in two] == ["two/0", "two/1"]
    # max_new_tokens 0: the prompt is prefilled (and cached) and nothing is generated.
    zero = httpx.post(
        gen, json={"text": "A prompt to cache", "sampling_params": {"max_new_tokens": 0}}
    ).json()
    assert zero["text"] == "" and zero["output_ids"] == []
    assert zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    again = httpx.post(
        gen, json={"text": "A prompt to cache, again", "sampling_params": {"max_new_tokens": 1}}
    ).json()
    assert again["meta_info"]["cached_tokens"] >= 3
    # Top logprobs for the output and the prompt (the prompt's first position has none).
    scored = httpx.post(
        gen,
        json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 3,
            "logprob_start_len": 0,
        },
    ).json()["meta_info"]
    assert scored["output_token_logprobs_length"] == 2
    assert [len(t) for t in scored["output_top_logprobs"]] == [3, 3]
    assert scored["output_top_logprobs"][0][0][1] == scored["output_token_logprobs"][0][1]
    assert scored["input_token_logprobs"][0][0] is None and scored["input_top_logprobs"][0] is None
    assert all(len(t) == 3 for t in scored["input_top_logprobs"][1:])
    # stop_regex ends the output where its first match ends, the match kept.
    stopped = httpx.post(
        gen,
        json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 30, "temperature": 0, "stop_regex": "[a-z]{4}"},
        },
    ).json()
    text = stopped["text"]
    assert re.search("[a-z]{4}", text).end() == len(text) and len(stopped["output_ids"]) < 30
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": "[a-z]{4}"}


def test_generate_takes_sglangs_per_prompt_lists_in_a_batch(server):
    """A /generate batch with a list per prompt of sampling_params, rid, return_logprob,
    top_logprobs_num and logprob_start_len (SGLang's shapes): each prompt runs with its own,
    exactly as it does alone."""
    gen = f"{server.url}/generate"
    texts = ["The capital of France is", "Once upon a time"]
    first = {"max_new_tokens": 2, "temperature": 0}
    second = {"max_new_tokens": 5, "temperature": 0, "n": 2}
    batch = httpx.post(
        gen,
        json={
            "text": texts,
            "rid": ["paris", "story"],
            "sampling_params": [first, second],
            "return_logprob": [True, False],
            "top_logprobs_num": [2, 0],
            "logprob_start_len": [0, -1],
        },
    ).json()
    assert [b["meta_info"]["id"] for b in batch] == ["paris", "story/0", "story/1"]
    alone_first = httpx.post(
        gen,
        json={
            "text": texts[0],
            "sampling_params": first,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 0,
        },
    ).json()
    alone_second = httpx.post(
        gen, json={"text": texts[1], "sampling_params": {**second, "n": 1}}
    ).json()
    assert batch[0]["output_ids"] == alone_first["output_ids"] and len(batch[0]["output_ids"]) == 2
    for sample in batch[1:]:
        assert sample["output_ids"] == alone_second["output_ids"]
        assert len(sample["output_ids"]) == 5 and "output_token_logprobs" not in sample["meta_info"]
    meta = batch[0]["meta_info"]
    assert [len(t) for t in meta["output_top_logprobs"]] == [2, 2]
    assert meta["input_token_logprobs"] == alone_first["meta_info"]["input_token_logprobs"]
    # A list of one serves a single prompt too.
    one = httpx.post(
        gen, json={"text": texts[0], "rid": ["solo"], "sampling_params": [first]}
    ).json()
    assert one["meta_info"]["id"] == "solo" and one["output_ids"] == alone_first["output_ids"]
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_chat_template_kwargs_reach_the_servers_template(client):
    """vLLM's and SGLang's chat_template_kwargs (Qwen3's enable_thinking): accepted, and a
    variable the served template never reads (SmolLM2 has no thinking switch) changes
    nothing. That the variables reach a template is tested with a request's own template
    (tests/server/test_hostile.py) and with LLM.chat."""
    msgs = [{"role": "user", "content": "Say hi."}]
    plain = client.chat.completions.create(model="m", messages=msgs, max_tokens=1)
    off = client.chat.completions.create(
        model="m",
        messages=msgs,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens


def test_vllms_token_fields_over_http(server, client):
    """allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's extras) on completions
    (the openai client's extra_body) and in /generate's sampling_params, each doing what
    it says on the real model."""
    prompt = "The capital of France is"
    free = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    allowed = [ids[1], ids[3]]
    only = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"allowed_token_ids": allowed},
    )
    native_only = httpx.post(
        f"{server.url}/generate",
        json={
            "text": prompt,
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 1.0,
                "seed": 5,
                "allowed_token_ids": allowed,
            },
        },
    ).json()
    assert set(native_only["output_ids"]) <= set(allowed) and len(native_only["output_ids"]) == 6
    assert only.choices[0].text == native_only["text"]
    word = free.choices[0].text.split()[0].strip(".,")
    banned = client.completions.create(
        model="m", prompt=prompt, max_tokens=6, temperature=0, extra_body={"bad_words": [word]}
    )
    assert banned.choices[0].text != free.choices[0].text
    assert word not in banned.choices[0].text.split()
    native = httpx.post(
        f"{server.url}/generate",
        json={
            "text": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "bad_words": [word]},
        },
    ).json()
    assert native["text"] == banned.choices[0].text
    cut = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 2},
    )
    tail = client.completions.create(model="m", prompt=ids[-2:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 2 and cut.choices[0].text == tail.choices[0].text


def test_continue_final_message_goes_on_from_the_last_message(client):
    """vLLM's continue_final_message: the last (assistant) message stays open, so the reply
    continues it instead of starting a new turn."""
    msgs = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    opened = client.chat.completions.create(
        model="m",
        messages=msgs,
        max_tokens=3,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    closed = client.chat.completions.create(model="m", messages=msgs, max_tokens=3, temperature=0)
    # Open: the prompt ends inside the assistant's message (no end-of-turn, no new turn).
    assert opened.usage.prompt_tokens < closed.usage.prompt_tokens
    assert opened.choices[0].message.content != closed.choices[0].message.content


def test_tokenize_messages_and_detokenize_as_vllm(server, client):
    """vLLM's /tokenize with chat messages counts what a chat request is fed; /detokenize
    gives the text of token ids back; return_token_strs spells each token."""
    url = server.url
    msgs = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=1)
    counted = httpx.post(f"{url}/tokenize", json={"messages": msgs}).json()
    assert counted["count"] == chat.usage.prompt_tokens == len(counted["tokens"])
    bare = httpx.post(f"{url}/tokenize", json={"messages": msgs, "add_generation_prompt": False})
    assert bare.json()["count"] < counted["count"]
    text = "Hello there, world"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(ids["token_strs"]) == ids["count"] and ids["token_strs"][0] == "Hello"
    back = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back == {"prompt": text}
    # vLLM's clients name the model on these routes too.
    named = httpx.post(f"{url}/tokenize", json={"model": "smollm2-135m", "prompt": text})
    assert named.status_code == 200 and named.json()["tokens"] == ids["tokens"]
    named = httpx.post(f"{url}/detokenize", json={"model": "m", "tokens": ids["tokens"]})
    assert named.status_code == 200 and named.json() == {"prompt": text}


def test_models_retrieve_and_version(server, client):
    """The openai client's models.retrieve finds the served model (and a NotFoundError for
    another name); /version says braid's version."""
    import braid

    card = client.models.retrieve("smollm2-135m")
    assert (card.id, card.owned_by) == ("smollm2-135m", "braid")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-5")
    assert httpx.get(f"{server.url}/version").json() == {"version": braid.__version__}


def test_cache_salt_shares_cached_kv_only_within_a_salt(client):
    """vLLM's cache_salt: a prompt cached under one salt is a miss under another salt or
    none, and a hit under the same salt."""
    prompt = "A ledger of the salted tenants: " + "entry, " * 30

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        out = client.completions.create(
            model="m", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        return out.usage.prompt_tokens_details.cached_tokens

    # (Unsalted requests share among themselves: an earlier test's prompt may share a first
    # token or two with this one, never the salted ledger.)
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) < 3
    assert cached("tenant-a") > 30 and cached("tenant-b") > 30 and cached(None) > 30


def test_any_model_name_gets_the_served_model(client):
    # As SGLang: a server of one model answers whatever `model` a client names.
    for name in ("gpt-5", ""):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0)
        assert out.model == "smollm2-135m"


def test_strict_model_name_refuses_other_names():
    from braid.runtime.server.app import APIError, ServerState
    from braid.runtime.server.inputs import check_model

    state = ServerState(
        None, None, "smollm2-135m", "/models/smollm2", None, None, strict_model_name=True
    )
    check_model(state, "smollm2-135m")
    check_model(state, "/models/smollm2")
    with pytest.raises(APIError, match="does not exist") as e:
        check_model(state, "gpt-5")
    assert e.value.status == 404


def _metric(url: str, name: str, want: float) -> float:
    """`name` in /metrics once it equals `want` (its gauges follow the scheduler's heartbeat),
    else its value after 10 s."""
    for _ in range(100):
        text = httpx.get(f"{url}/metrics").text
        (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
        if float(line.split()[1]) == want:
            break
        time.sleep(0.1)
    return float(line.split()[1])


def test_session_pin_ttl_over_http_shows_in_stats_and_metrics(server):
    """A /generate with session_params {"id", "ttl"} pins its KV for that session: the pins
    show in /get_server_info and /metrics; a pin with a 1 s TTL expires (counted) while a
    session with a long TTL and one with none stay pinned."""
    url = server.url
    wait_idle(url)
    httpx.post(f"{url}/flush_cache").raise_for_status()
    before = httpx.get(f"{url}/get_server_info").json()["stats"]
    sp = {"max_new_tokens": 4, "temperature": 0}

    def generate(text: str, **session) -> None:
        r = httpx.post(f"{url}/generate", json={"text": text, "sampling_params": sp, **session})
        assert r.status_code == 200, r.text

    generate("A session that stays:", session_id="stays")
    generate("A session with a long TTL:", session_params={"id": "long", "ttl": 600})
    stats = wait_idle(url)
    assert stats["pinned_sessions"] == before["pinned_sessions"] + 2
    assert stats["programs_known"] >= 2
    assert stats["pinned_tokens"] > 0
    for name in ("pinned_sessions", "pinned_tokens"):
        assert _metric(url, f"braid_{name}", stats[name]) == stats[name]
    recomputed = stats["program_tokens_recomputed"]
    assert _metric(url, "braid_program_tokens_recomputed_total", recomputed) == recomputed
    declined = stats["pins_declined"]  # first calls of their sessions: no pause known, pinned
    assert declined == before["pins_declined"]
    assert _metric(url, "braid_pins_declined_total", declined) == declined
    generate("A short-lived session:", session_params={"id": "short", "ttl": 1})
    for _ in range(200):
        stats = httpx.get(f"{url}/get_server_info").json()["stats"]
        if stats["pins_expired"] > before["pins_expired"]:
            break
        time.sleep(0.1)
    assert stats["pins_expired"] == before["pins_expired"] + 1
    assert stats["pinned_sessions"] == before["pinned_sessions"] + 2  # "stays" and "long"
    expired = stats["pins_expired"]
    assert _metric(url, "braid_pins_expired_total", expired) == expired
    for session in ("stays", "long"):
        close = httpx.post(f"{url}/close_session", json={"session_id": session})
        assert close.status_code == 200


def test_program_positions_over_generate_show_per_program_in_info_and_metrics(server):
    """/generate takes a call's position next to its session (session_params.position, or
    session_position beside session_id); /get_server_info lists the program with its calls,
    last position, service and pinned tokens while it holds pins, /metrics shows its figures,
    and both drop it once its sessions are closed."""
    url = server.url
    wait_idle(url)
    sp = {"max_new_tokens": 3, "temperature": 0}
    context = "An agent plans a trip to Lisbon, step by step."

    def generate(**body) -> None:
        r = httpx.post(f"{url}/generate", json={"sampling_params": sp, **body})
        assert r.status_code == 200, r.text

    # Long TTLs: the pins must outlast the test's pauses (the adaptive TTL follows them).
    generate(text=context, session_params={"id": "trip", "ttl": 600, "position": 0})
    # One call of two requests (a select's choices), then a fork branch's call, as SGLang's
    # programs send them.
    generate(
        text=[context + " Train?", context + " Plane?"],
        session_id="trip",
        session_ttl=600,
        session_position=1,
    )
    generate(text=context + " Book it:", session_params={"id": "trip.0", "ttl": 600, "position": 2})
    wait_idle(url)
    (trip,) = [
        p for p in httpx.get(f"{url}/get_server_info").json()["programs"] if p["id"] == "trip"
    ]
    assert (trip["calls"], trip["calls_served"], trip["last_position"]) == (3, 3, 2)
    assert trip["in_flight"] == 0 and trip["pinned_sessions"] == 2
    assert trip["pinned_tokens"] >= 2 * len(context.split())
    assert trip["service"] >= trip["pinned_tokens"] // 2
    line = f'braid_program_pinned_tokens{{program="trip"}} {trip["pinned_tokens"]}'
    for _ in range(100):  # /metrics follows the scheduler's heartbeat
        metrics = httpx.get(f"{url}/metrics").text
        if line in metrics.splitlines():
            break
        time.sleep(0.1)
    assert line in metrics.splitlines()
    assert 'braid_program_calls_served{program="trip"} 3' in metrics
    assert f'braid_program_service_tokens{{program="trip"}} {trip["service"]}' in metrics
    (hist,) = [
        x
        for x in metrics.splitlines()
        if x.startswith('braid_programs_by_pinned_tokens{le="+Inf"}')
    ]
    assert int(hist.split()[1]) >= 1
    for session in ("trip.0", "trip"):
        httpx.post(f"{url}/close_session", json={"session_id": session}).raise_for_status()
    programs = httpx.get(f"{url}/get_server_info").json()["programs"]
    assert "trip" not in {p["id"] for p in programs}
    for _ in range(100):
        if 'program="trip"' not in httpx.get(f"{url}/metrics").text:
            break
        time.sleep(0.1)
    assert 'program="trip"' not in httpx.get(f"{url}/metrics").text


def test_program_id_without_sessions_over_generate_and_end_program(server):
    """/generate takes program_id (and a call's position beside it) without a session: while
    a call streams, /get_server_info lists the program in flight with its calls and last
    position, and programs_in_flight counts it (also in /metrics); /end_program ends it once,
    and an unknown program is not ended."""
    url = server.url
    wait_idle(url)
    before = httpx.get(f"{url}/get_server_info").json()["stats"]
    sp = {"max_new_tokens": 3, "temperature": 0}
    r = httpx.post(
        f"{url}/generate",
        json={"text": "Plan:", "sampling_params": sp, "program_id": "plan", "session_position": 0},
    )
    assert r.status_code == 200, r.text
    body = {
        "text": "Plan: step two, at length:",
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        "program_id": "plan",
        "session_position": 1,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        info = httpx.get(f"{url}/get_server_info").json()
        (plan,) = [p for p in info["programs"] if p["id"] == "plan"]
        assert (plan["in_flight"], plan["calls"], plan["last_position"]) == (1, 2, 1)
        assert plan["pinned_sessions"] == 0
        assert info["stats"]["programs_in_flight"] >= 1
        assert _metric(url, "braid_programs_in_flight", 1.0) >= 1
        for _ in lines:  # the call runs to its end
            pass
    stats = wait_idle(url)
    assert stats["programs_in_flight"] == 0
    assert stats["programs_known"] == before["programs_known"] + 1
    ended = httpx.post(f"{url}/end_program", json={"program_id": "plan"})
    assert ended.status_code == 200 and ended.json() == {"success": True}
    stats = httpx.get(f"{url}/get_server_info").json()["stats"]
    assert stats["programs_ended"] == before["programs_ended"] + 1
    assert stats["programs_known"] == before["programs_known"]
    again = httpx.post(f"{url}/end_program", json={"program_id": "plan"})
    assert again.json() == {"success": False}


WHOLE = [
    ("/v1/completions", {"prompt": ["Red,", "Blue,"], "n": 2, "logprobs": 2, "stop": [","]}),
    ("/v1/completions", {"prompt": "One, two", "echo": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 2}),
]
STREAMS = [
    (
        "/v1/completions",
        {"prompt": ["Red,", "Blue,"], "n": 2, "logprobs": 1, "stop": [","]},
    ),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2}),
]


@pytest.mark.parametrize("include_usage", [False, True])
def test_every_body_and_chunk_parses_into_its_response_model(server, include_usage):
    # The wire and the typed models of `openai_types` cannot drift apart: whole bodies are
    # built through the models, and every chunk the stream's fast encoder writes parses into
    # the chunk model (which refuses keys it does not declare).
    common = {"model": "m", "max_tokens": 6, "temperature": 0.7, "seed": 3}
    for path, body in WHOLE:
        r = httpx.post(server.url + path, json={**common, **body}, timeout=120)
        assert r.status_code == 200, r.text
        model = ChatCompletion if "chat" in path else Completion
        parsed = model.model_validate_json(r.content)
        assert parsed.usage.completion_tokens > 0 and all(c.logprobs for c in parsed.choices)
    options = {"stream": True, "stream_options": {"include_usage": include_usage}}
    for path, body in STREAMS:
        chunk_model = ChatCompletionChunk if "chat" in path else CompletionChunk
        data = sse_data(server.url + path, {**common, **body, **options})
        chunks = [chunk_model.model_validate_json(d) for d in data]
        assert len({c.id for c in chunks}) == 1
        finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
        assert finished == set(range(4 if "prompt" in body else 1))
        # Only a chunk that ends its choice at a stop string names it (stop_reason).
        named = [ch for c in chunks for ch in c.choices if "stop_reason" in ch.model_fields_set]
        assert all(ch.finish_reason == "stop" and ch.stop_reason == "," for ch in named)
        # With include_usage every chunk has a usage, null but on the last (choices []);
        # without, none has the key.
        assert all(("usage" in c.model_fields_set) == include_usage for c in chunks)
        if include_usage:
            assert all(c.usage is None for c in chunks[:-1])
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_names_the_stop_string_that_ended_it_as_the_whole_response_does(client, chat):
    """vLLM's `stop_reason`: the stop string that ended a choice, on the whole response's
    choice and on the stream's last chunk of it."""
    stop = "." if chat else " 7"  # chat: "The capital of France is Paris." (make demo)
    kw = dict(model="m", max_tokens=12, temperature=0, stop=[stop])
    if chat:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(messages=msgs, **kw)
        chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
    else:
        whole = client.completions.create(prompt="1, 2, 3, 4,", **kw)
        chunks = list(client.completions.create(prompt="1, 2, 3, 4,", stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    choice = whole.choices[0]
    assert (choice.finish_reason, getattr(choice, "stop_reason", None)) == ("stop", stop), choice
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert (last.finish_reason, getattr(last, "stop_reason", None)) == ("stop", stop), last
    earlier = [c.choices[0] for c in chunks if c.choices][:-1]
    assert not any(getattr(c, "stop_reason", None) for c in earlier)


def test_abort_request_takes_the_ids_clients_hold(server):
    """/abort_request aborts what runs under the id a client holds: every sample of a
    /generate rid with n > 1, and a chat completion by its response id."""
    import threading

    url = server.url
    sp = {"max_new_tokens": 3000, "ignore_eos": True}
    bodies = {
        "mine": {"text": "Count forever:", "rid": "abort-me", "sampling_params": {**sp, "n": 2}},
        # Another client's request whose rid looks like one of mine: it runs on.
        "theirs": {"text": "Count:", "rid": "abort-me-1", "sampling_params": {**sp, "n": 1}},
    }
    bodies["theirs"]["sampling_params"]["max_new_tokens"] = 40
    got = {}

    def post(name):
        got[name] = httpx.post(f"{url}/generate", json=bodies[name], timeout=300)

    threads = {name: threading.Thread(target=post, args=(name,)) for name in bodies}
    deadline = time.time() + 60
    # Mine first, then theirs once mine runs: theirs is short, and must still be running.
    for name, running in (("mine", 2), ("theirs", 3)):
        threads[name].start()
        while httpx.get(f"{url}/get_server_info").json()["stats"]["running_requests"] < running:
            assert time.time() < deadline
            time.sleep(0.05)
    assert httpx.post(f"{url}/abort_request", json={"rid": "abort-me"}).status_code == 200
    for t in threads.values():
        t.join(120)
    outs = got["mine"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert all(o["meta_info"]["completion_tokens"] < 3000 for o in outs)
    theirs = got["theirs"].json()["meta_info"]
    assert theirs["finish_reason"]["type"] == "length" and theirs["completion_tokens"] == 40
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count forever."}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    assert httpx.post(f"{url}/abort_request", json={"rid": first.id}).status_code == 200
    finish = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finish[-1] == "abort" and len(finish) < 3000
    wait_idle(url)


def test_opened_sessions_continue_their_requests_as_sglangs_do(server):
    """SGLang's /open_session and session_params.rid: a request continues an earlier one of its
    session (its prompt and output, then the new tokens), or its prompt alone
    (drop_previous_output), cut at an offset; replace forgets the other continuations and
    ends a request still running; each continued prompt gives the tokens the same prompt sent
    whole gives, with the earlier part found cached."""
    url = server.url
    wait_idle(url)
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}

    def generate(ids: list[int], status: int = 200, **body) -> dict:
        r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp, **body})
        assert r.status_code == status, r.text
        return r.json()

    sid = httpx.post(f"{url}/open_session", json={"capacity_of_str_len": 4096}).json()
    assert isinstance(sid, str) and sid
    taken = httpx.post(f"{url}/open_session", json={"capacity_of_str_len": 10, "session_id": sid})
    assert taken.status_code == 400 and "open already" in taken.json()["error"]["message"]
    a, b = [504, 3457, 314, 4195, 30], [1073, 28, 2215]
    root = generate(a, rid="t0", session_params={"id": sid})
    assert root["meta_info"]["prompt_tokens"] == len(a)
    out0 = root["output_ids"]
    # Continue t0: its prompt and output, then b; the same tokens as the whole prompt sent.
    t1 = generate(b, rid="t1", session_params={"id": sid, "rid": "t0"})
    whole = a + out0 + b
    assert t1["meta_info"]["prompt_tokens"] == len(whole)
    assert t1["meta_info"]["cached_tokens"] >= len(a + out0) - 1
    assert t1["output_ids"] == generate(whole)["output_ids"]
    # Without t0's output; cut at an offset (t1's sequence's first 7 tokens, then b).
    t2 = generate(
        b, rid="t2", session_params={"id": sid, "rid": "t0", "drop_previous_output": True}
    )
    assert t2["meta_info"]["prompt_tokens"] == len(a + b)
    assert t2["output_ids"] == generate(a + b)["output_ids"]
    t3 = generate(b, rid="t3", session_params={"id": sid, "rid": "t1", "offset": 7})
    assert t3["output_ids"] == generate((whole + t1["output_ids"])[:7] + b)["output_ids"]
    # Refused, naming the field: an unknown request, a rid used twice, a session not opened.
    bad = generate(b, 400, rid="t4", session_params={"id": sid, "rid": "nope"})
    assert bad["error"]["param"] == "session_params.rid"
    bad = generate(b, 400, rid="t1", session_params={"id": sid, "rid": "t0"})
    assert bad["error"]["param"] == "rid" and "already" in bad["error"]["message"]
    bad = generate([b], 400, rid="t4", session_params={"id": sid, "rid": "t0"})
    assert bad["error"]["param"] == "input_ids" and "not a list" in bad["error"]["message"]
    bad = generate(b, 400, session_params={"id": "not-opened", "rid": "t0"})
    assert bad["error"]["param"] == "session_params.id" and "not open" in bad["error"]["message"]
    # replace: t0's continuations (t1, t2 and t1's t3) are forgotten.
    generate(b, rid="t5", session_params={"id": sid, "rid": "t0", "replace": True})
    bad = generate(b, 400, rid="t6", session_params={"id": sid, "rid": "t1"})
    assert "no request 't1'" in bad["error"]["message"]
    # A request still running: continuing it is refused; replacing it ends it.
    long = {"input_ids": a, "rid": "run", "stream": True, "session_params": {"id": sid}}
    long["sampling_params"] = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/generate", json=long, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(x for x in lines if x.startswith("data:"))  # it is running
        bad = generate(b, 400, rid="t7", session_params={"id": sid, "rid": "run"})
        assert "has not ended" in bad["error"]["message"]
        generate(b, rid="t8", session_params={"id": sid, "rid": "run", "replace": True})
        last = [x for x in lines if x.startswith("data:") and x != "data: [DONE]"][-1]
    assert '"finish_reason":{"type":"abort"' in last.replace(" ", "")
    assert httpx.post(f"{url}/close_session", json={"session_id": sid}).json()["success"]
    bad = generate(b, 400, rid="t9", session_params={"id": sid, "rid": "t0"})
    assert "not open" in bad["error"]["message"]
    wait_idle(url)


def test_an_opened_sessions_ended_request_is_not_a_later_request_with_its_rid(server):
    """A rid names a session's request only until it ends: a request elsewhere that takes the
    same rid later neither blocks continuing the session's request nor is aborted by a
    `replace` in the session (both happened: the session asked whether the rid was in
    flight anywhere)."""
    url = server.url
    wait_idle(url)
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    sid = httpx.post(f"{url}/open_session", json={"capacity_of_str_len": 4096}).json()

    def generate(ids: list[int], **body) -> dict:
        r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp, **body})
        assert r.status_code == 200, r.text
        return r.json()

    a, b = [504, 3457, 314, 4195, 30], [1073, 28, 2215]
    generate(a, rid="c0", session_params={"id": sid})  # ended
    other = {"input_ids": b, "rid": "c0", "stream": True}
    other["sampling_params"] = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/generate", json=other, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(x for x in lines if x.startswith("data:"))  # it is running
        generate(b, rid="c1", session_params={"id": sid, "rid": "c0"})
        generate(b, rid="c2", session_params={"id": sid, "replace": True})
        last = [x for x in lines if x.startswith("data:") and x != "data: [DONE]"][-1]
    assert '"finish_reason":{"type":"length"' in last.replace(" ", ""), last[-300:]
    assert httpx.post(f"{url}/close_session", json={"session_id": sid}).json()["success"]
    wait_idle(url)


@pytest.mark.parametrize("penalty", [-1000.0, 1000.0, 1e308])
def test_beam_search_ranks_beams_under_any_finite_length_penalty(client, server, penalty):
    """A length penalty that takes `length ** penalty` past the float range (1000 at a length
    of 3 or more) ranks the beams by the score's limit instead of failing with a 500."""
    out = client.completions.create(
        model="m",
        prompt="The sky is",
        max_tokens=3,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": penalty},
    )
    assert len(out.choices) == 2 and all(c.text for c in out.choices)
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_chat_beam_search_gives_the_beams_of_its_rendered_prompt(client, server):
    """vLLM's `use_beam_search` on chat: the chat template's prompt searched as completions
    search it (the same beams, in order, as the messages' text), `n` choices, best first;
    tools and what beam search cannot honour are 400s naming the field."""
    messages = [{"role": "user", "content": "Name a colour."}]
    beam = {"use_beam_search": True, "length_penalty": 0.5}
    chat = client.chat.completions.create(
        model="m", messages=messages, max_tokens=4, n=2, extra_body=beam
    )
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    plain = client.completions.create(model="m", prompt=ids, max_tokens=4, n=2, extra_body=beam)
    assert [c.message.content for c in chat.choices] == [c.text for c in plain.choices]
    assert [c.finish_reason for c in chat.choices] == [c.finish_reason for c in plain.choices]
    assert len({c.message.content for c in chat.choices}) == 2  # two different beams
    assert chat.id.startswith("chatcmpl-") and chat.usage.prompt_tokens == len(ids)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (
        ({"tools": [tool], "tool_choice": "required"}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"stream": True}, "stream"),
    ):
        body = {"messages": messages, "n": 2, "use_beam_search": True, **extra}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]
