"""OpenAI's Responses API (`/v1/responses`) through `braid serve` with the official `openai`
client (SmolLM2, greedy or seeded): each response is checked against the chat completion of
the same conversation, which the chat path is tested to get right; chains through
`previous_response_id`, a tool-call round trip, the typed stream, the SQLite store, reasoning
items and the refusals."""

from __future__ import annotations

import json
import sqlite3

import httpx
import jsonschema
import openai
import pytest

from braid.runtime.server.response_store import ResponseStore
from tests.server.conftest import start_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "Time now", "parameters": ZONE},
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]
GREET = r"Hello, (world|there)!"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("responses") / "store.sqlite3"


@pytest.fixture(scope="module")
def server(tmp_path_factory, store_path):
    s = start_server(
        tmp_path_factory.mktemp("serve-responses"),
        "--tool-call-parser",
        "hermes",
        "--response-store",
        str(store_path),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )


def test_text_input_and_instructions_give_the_chat_completion(client):
    r = client.responses.create(
        model="m",
        input="Name a fruit.",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    c = chat(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        6,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Cut off by max_output_tokens: incomplete, as OpenAI reports it.
    assert c.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in r.output] == ["incomplete"]  # the item cut off, as streamed
    assert (r.instructions, r.max_output_tokens, r.model) == ("Be brief.", 6, "smollm2-135m")


def test_stream_is_the_typed_event_sequence_of_the_whole_response(client):
    kw = dict(
        model="m",
        input="Greet me.",
        max_output_tokens=12,
        temperature=0,
        extra_body={"regex": GREET},
    )
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == final.output_text == whole.output_text
    assert final.status == whole.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored too
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_a_previous_response_id_chain_continues_the_conversation(client):
    first = client.responses.create(
        model="m",
        input="Name a color.",
        instructions="Answer in one word.",
        max_output_tokens=4,
        temperature=0,
    )
    second = client.responses.create(
        model="m",
        input="Another one?",
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
    )
    third = client.responses.create(
        model="m",
        input="And a third?",
        previous_response_id=second.id,
        max_output_tokens=4,
        temperature=0,
    )
    # Instructions do not carry over (OpenAI's rule): the chain is the user/assistant turns.
    messages = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And a third?"},
    ]
    c = chat(client, messages, 4)
    assert third.previous_response_id == second.id
    assert third.usage.input_tokens == c.usage.prompt_tokens
    assert third.output_text == c.choices[0].message.content
    # The same turns sent as input items instead of a chain give the same prompt.
    items = [{"type": "message", "role": m["role"], "content": m["content"]} for m in messages]
    explicit = client.responses.create(model="m", input=items, max_output_tokens=4, temperature=0)
    assert explicit.usage.input_tokens == third.usage.input_tokens
    assert explicit.output_text == third.output_text


def test_a_tool_call_round_trip(client):
    ask = "What is the weather in Paris?"
    r = client.responses.create(
        model="m",
        input=ask,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=24,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    back = client.responses.create(
        model="m",
        previous_response_id=r.id,
        tools=TOOLS,
        max_output_tokens=6,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}],
    )
    messages = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21C"},
    ]
    c = chat(client, messages, 6, tools=CHAT_TOOLS)
    assert back.usage.input_tokens == c.usage.prompt_tokens
    assert back.output_text == (c.choices[0].message.content or "")
    # The client may replay the call itself instead of chaining.
    replay = client.responses.create(
        model="m",
        tools=TOOLS,
        max_output_tokens=6,
        temperature=0,
        input=[
            {"role": "user", "content": ask},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"},
        ],
    )
    assert replay.usage.input_tokens == back.usage.input_tokens


def test_streamed_function_call_arguments_match_the_final_items(client):
    kw = dict(
        model="m",
        input="Weather in Rome and the time in UTC?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=48,
        temperature=0,
    )
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and final.status == "completed"
    for index, item in enumerate(final.output):
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.output_index == index
        ]
        done = [
            e
            for e in events
            if e.type == "response.function_call_arguments.done" and e.output_index == index
        ]
        assert "".join(deltas) == done[0].arguments == item.arguments
        schema = WEATHER if item.name == "get_weather" else ZONE
        jsonschema.validate(json.loads(item.arguments), schema)
    whole = client.responses.create(**kw)
    assert [(o.name, o.arguments) for o in whole.output] == [(o.name, o.arguments) for o in calls]


def test_auto_tool_calls_after_text_stream_as_two_items(client):
    # A regex makes SmolLM2 write some text, then a hermes call (tool_choice "auto").
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    regex = r"Sure\.\n" + call.replace("{", r"\{").replace("}", r"\}")
    kw = dict(
        model="m",
        input="What time is it?",
        tools=TOOLS,
        max_output_tokens=40,
        temperature=1.0,
        extra_body={"regex": regex, "seed": 3},
    )
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [
        (e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"
    ]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(0, "message"), (1, "function_call")]
    assert final.output_text == "Sure."
    assert (final.output[1].name, json.loads(final.output[1].arguments)) == (
        "get_time",
        {"zone": "UTC"},
    )
    whole = client.responses.create(**kw)
    assert [o.type for o in whole.output] == ["message", "function_call"]
    assert (whole.output_text, whole.output[1].arguments) == ("Sure.", final.output[1].arguments)


def test_parallel_tool_calls_false_allows_one_call(client):
    r = client.responses.create(
        model="m",
        input="Weather in Rome and the time in UTC?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=32,
        temperature=0,
    )
    assert [o.type for o in r.output] == ["function_call"] and r.parallel_tool_calls is False


def test_text_format_json_schema_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    }
    r = client.responses.create(
        model="m",
        input="Give a person.",
        max_output_tokens=24,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_stored_responses_get_and_delete(client, server, store_path):
    r = client.responses.create(
        model="m", input="Hi.", max_output_tokens=3, temperature=0, metadata={"k": "v"}
    )
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.usage.output_tokens, got.metadata) == (
        r.id,
        r.output_text,
        r.usage.output_tokens,
        {"k": "v"},
    )
    with sqlite3.connect(store_path) as db:  # a real database file
        assert db.execute("SELECT COUNT(*) FROM responses WHERE id = ?", (r.id,)).fetchone()[0]
    replay = httpx.get(f"{server.url}/v1/responses/{r.id}", params={"stream": "true"})
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"
    deleted = httpx.delete(f"{server.url}/v1/responses/{r.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="Again.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="m", input="Hi.", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": ""}, "input"),
        ({"input": 5}, "input"),
        # The template reads no reasoning effort (it would change nothing).
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        (
            {"text": {"format": {"type": "json_schema", "name": 5, "schema": {"type": "object"}}}},
            "text.format.name",
        ),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice.name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "word " * 9000}, "input"),
        (
            {"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
            "text.format.schema",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
            "input[0].output",
        ),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"conversation": "conv_1"}, "conversation"),
        # A strict tool's calls are held to its schema: not beside a constraint of its own.
        ({"tools": [{**TOOLS[0], "strict": True}], "regex": "a+"}, "tools"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, extra, param):
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_bad_tool_choice_is_described_in_the_responses_shape(server):
    body = {"model": "m", "input": "hi", "tools": TOOLS, "tool_choice": "sometimes"}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "{'type': 'function', 'name': ...}" in message, message


def test_an_aborted_stream_fails_and_is_not_stored(server, client):
    """A response aborted mid-stream (`/abort_request`) ends with `response.failed` (code
    "cancelled"), not as completed, and is not stored for `previous_response_id` to carry on."""
    body = {"model": "m", "input": "Count to a thousand.", "max_output_tokens": 400}
    events, deltas = [], 0
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            events.append(event)
            if event["type"] == "response.output_text.delta":
                deltas += 1
                if deltas == 3:
                    rid = events[0]["response"]["id"]
                    abort = httpx.post(f"{server.url}/abort_request", json={"rid": rid})
                    assert abort.status_code == 200, abort.text
    last = events[-1]
    assert last["type"] == "response.failed", [e["type"] for e in events[-4:]]
    response = last["response"]
    assert response["status"] == "failed" and response["error"]["code"] == "cancelled"
    assert response["usage"]["output_tokens"] < 400
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_cache_salt_keeps_tenants_apart(client):
    """`cache_salt` (extra_body): a prompt under one salt finds none of another salt's cached
    KV, and all of its own."""
    long = "The history of the salted cache is long and winding. " * 20 + "Go on."

    def cached(salt: str) -> int:
        r = client.responses.create(
            model="m", input=long, max_output_tokens=1, store=False, extra_body={"cache_salt": salt}
        )
        return r.usage.input_tokens_details.cached_tokens

    first = cached("tenant-c")
    assert first < 50 and cached("tenant-d") == first and cached("tenant-c") > 250


def test_the_server_keeps_serving_after_refusals(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search_preview"}])
    assert client.responses.create(model="m", input="Hi.", max_output_tokens=2).output_text


def test_the_store_keeps_only_the_newest(tmp_path):
    store = ResponseStore(tmp_path / "sub" / "r.sqlite3", capacity=3)
    for i in range(5):
        store.put({"id": f"resp_{i}", "output": []}, [{"role": "user", "content": str(i)}])
    assert len(store) == 3
    assert store.get("resp_0") is None and store.get("resp_1") is None
    assert store.get("resp_4") == {"id": "resp_4", "output": []}
    assert store.messages("resp_2") == [{"role": "user", "content": "2"}]
    assert store.delete("resp_3") and not store.delete("resp_3")
    assert ResponseStore(tmp_path / "sub" / "r.sqlite3", capacity=3).get("resp_4")  # persists


def test_a_store_that_cannot_be_opened_names_its_path(tmp_path, monkeypatch):
    """An unusable store or cache directory is named (a FileNotFoundError traceback before:
    at start-up for the embedded model's conversion, or a 500 on every stored response)."""
    from braid.runtime.assets import ModelAssets
    from braid.runtime.server.response_store import StoreUnavailable

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(StoreUnavailable, match=r"response store .*a-file/r\.sqlite3 cannot be"):
        ResponseStore(blocked / "r.sqlite3")
    monkeypatch.setenv("BRAID_CACHE_DIR", str(blocked))
    with pytest.raises(ValueError, match="braid's cache .*set BRAID_CACHE_DIR to a writable"):
        ModelAssets.load(None, with_tokenizer=False)


# ---- reasoning items ------------------------------------------------------------------------
THINK = r"<think>\n(ab|cd)\n</think>\n\n(yes|no)"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, store_path):
    # The same store file as the first server: stored responses outlive the server that made
    # them, and servers may share one file.
    s = start_server(
        tmp_path_factory.mktemp("serve-responses-reasoning"),
        "--reasoning-parser",
        "qwen3",
        "--response-store",
        str(store_path),
    )
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused")
    s.stop()


def test_reasoning_is_a_reasoning_item_whole_and_streamed(thinking, client):
    kw = dict(
        model="m",
        input="Think, then answer.",
        max_output_tokens=40,
        temperature=1.0,
        extra_body={"regex": THINK, "seed": 16},
    )
    r = thinking.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought in ("ab", "cd")
    assert r.output_text in ("yes", "no")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with thinking.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (thought, r.output_text)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    # Stored by this server, found by the other one (one SQLite file).
    assert client.responses.retrieve(r.id).output[0].content[0].text == thought
