"""Tool calling through `braid serve` with the official `openai` client (SmolLM2, greedy)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from braid.runtime.server.openai_types import ChatCompletion, ChatCompletionChunk
from tests.server.conftest import sse_data, start_server

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time now", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # SmolLM2's template shows no call format, so name the parser for tool_choice "auto".
    s = start_server(tmp_path_factory.mktemp("serve-tools"), "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def streamed_calls(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason) as a client accumulates them."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function"
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.function.name is None
                    calls[tc.index][2] += tc.function.arguments
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def test_required_calls_validate_and_stream_the_same(client):
    kw = dict(
        model="smollm2-135m",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=128,  # greedy: as many tokens as the model spells the forced text in
    )
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert content == "" and finish == "tool_calls"
    want = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(name, args) for _, name, args in calls] == want
    assert all(cid.startswith("call_") for cid, _, _ in calls)


def test_named_tool_choice_after_a_tool_round(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
    ]
    out = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=40,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_auto_parses_calls_from_the_text_streamed_or_not(client):
    # A regex makes SmolLM2 write a Hermes-style call after some text.
    regex = (
        re.escape('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "')
        + "(Paris|Oslo)"
        + re.escape('", "unit": "celsius"}}</tool_call>')
    )
    kw = dict(
        model="smollm2-135m",
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=128,  # greedy: as many tokens as the model spells the forced text in
        extra_body={"regex": regex},
    )
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == "Sure."
    (call,) = full.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    content, calls, finish = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]
    none = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and not none.message.tool_calls
    assert none.message.content.startswith("Sure.<tool_call>")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "maybe"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        # A schema braid cannot enforce, found compiling the tools' constraint: it named
        # json_schema, a field the request did not send.
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "array", "uniqueItems": True},
                        },
                    }
                ],
            },
            "tools",
        ),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(client, extra, param):
    kw = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=4)
    kw.update(extra)
    if kw["tools"] is None:
        del kw["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    err = e.value.response.json()["error"]
    assert err["param"].startswith(param) and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param)


def test_a_call_cut_off_by_max_tokens_is_no_call(client):
    # Issue 13: the arguments of a call that ran out of tokens are not JSON; OpenAI answers
    # finish_reason "length" and no tool_calls (the text stays as content).
    out = client.chat.completions.create(
        model="smollm2-135m",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=4,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and out.usage.completion_tokens == 4


def test_tool_call_bodies_and_chunks_parse_into_the_response_models(server):
    body = {
        "model": "m",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0,
        "max_tokens": 40,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = ChatCompletion.model_validate_json(r.content).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    chunks = [
        ChatCompletionChunk.model_validate_json(d)
        for d in sse_data(f"{server.url}/v1/chat/completions", {**body, "stream": True})
    ]
    pieces = [
        tc for c in chunks for ch in c.choices for tc in ch.delta.model_dump().get("tool_calls", [])
    ]
    assert pieces[0]["function"]["name"] == "get_time"
    assert "".join(p["function"]["arguments"] for p in pieces) == call.function.arguments


def test_strict_tools_with_auto_run_under_their_structural_tag(client):
    """A strict tool with "auto" (the hermes format): the request runs with the calls' tag
    compiled in the scheduler; strict with a constraint of its own is a 400 naming tools."""
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, *TOOLS[1:]]
    kw = dict(model="smollm2-135m", messages=ASK, tools=strict, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**{**kw, "tools": TOOLS}).choices[0]
    held = client.chat.completions.create(**kw).choices[0]
    # Nothing here starts a call: the free text is the unconstrained model's.
    assert held.message.content == plain.message.content and not held.message.tool_calls
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"regex": "a+"})
    assert e.value.body["param"] == "tools"
