"""Structured outputs on a real `braid serve` (the default grammar backend), driven by the
`openai` client and by plain HTTP: EBNF and Lark grammars under SGLang's and vLLM's names,
SGLang's structural tag, bounded integers enforced; bad grammars, unenforceable schemas, two
constraints at once, constraint fields braid does not implement and constraints that admit no
output are 400s naming the field; a grammar failing mid-generation ends its request with a
short message and one log line; and the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.runtime.grammars import (
    ARITHMETIC,
    ARITHMETIC_RE,
    MATH_PROMPT,
    SQL,
    SQL_LARK,
    SQL_RE,
    TOOL_TAG,
    WEATHER,
)
from tests.server.conftest import wait_idle

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
NO_OUTPUT = "the constraint matches no output"
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SQL_PROMPT = "Question: list the names of all users.\nSQL: "


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_ebnf_and_lark_under_every_name(server, client):
    native = httpx.post(
        server.url + G,
        json={
            "text": SQL_PROMPT,
            "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ebnf": SQL},
        },
    ).json()
    assert re.fullmatch(SQL_RE, native["text"]), native
    assert native["meta_info"]["finish_reason"]["type"] == "stop"
    # SGLang's field on the OpenAI endpoints, vLLM's names for EBNF and Lark.
    for extra in ({"ebnf": ARITHMETIC}, {"guided_grammar": ARITHMETIC}):
        out = client.completions.create(
            model="m", prompt=MATH_PROMPT, max_tokens=20, temperature=0, extra_body=extra
        )
        assert re.fullmatch(ARITHMETIC_RE, out.choices[0].text), (extra, out.choices[0])
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Write a SQL query listing user names."}],
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": SQL_LARK}},
    )
    assert re.fullmatch(SQL_RE, chat.choices[0].message.content), chat.choices[0]


def test_structural_tag_constrains_the_tagged_text_only(client):
    prompt = (
        "Tools: get_weather(city). Call one as "
        '<function=get_weather>{"city": "Rome"}</function>.\n'
        "User: What is the weather in Paris?\nAssistant: Let me check. <function="
    )
    fmt = {"type": "structural_tag", **TOOL_TAG}
    out = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    text, begin = out.choices[0].text, "<function=get_weather>"
    # The prompt's open tag is not the output's: the output starts free, and each tag it
    # writes holds a valid call.
    calls = re.findall(r"<function=get_weather>(.*?)</function>", text, flags=re.S)
    rest = re.sub(r"<function=get_weather>.*?</function>", "", text, flags=re.S)
    if out.choices[0].finish_reason == "length" and "<function=" in rest:
        rest, _, cut = rest.rpartition("<function=")  # max_tokens ended inside a tag
        assert (begin[10:] + "{").startswith(cut[:13]), cut
    assert "<function=" not in rest, text
    for call in calls:
        jsonschema.validate(json.loads(call), WEATHER)
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        response_format=fmt,
    )
    assert chat.choices[0].message.content  # free text where no trigger appears


def test_integer_bounds_are_enforced(client):
    qty = {"type": "integer", "minimum": 1, "maximum": 9}
    schema = {"type": "object", "properties": {"qty": qty}, "required": ["qty"]}
    out = client.completions.create(
        model="m",
        prompt="Order: 300 apples. As JSON:",
        max_tokens=12,
        n=4,
        temperature=1.5,
        seed=7,
        extra_body={"json_schema": schema},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert 1 <= json.loads(choice.text)["qty"] <= 9, choice.text


BAD = [
    (G, {"text": "x", "sampling_params": {"ebnf": 'root ::= "a" nothing'}}, "ebnf", "nothing"),
    (C, {"prompt": "x", "ebnf": "root ::= ("}, "ebnf", "ebnf"),
    (C, {"prompt": "x", "stream": True, "ebnf": "root ::= ("}, "ebnf", "ebnf"),
    (CH, {"messages": MSG, "structured_outputs": {"grammar": "start: ("}}, "lark", "lark"),
    (
        C,
        {"prompt": "x", "json_schema": {"type": "array", "uniqueItems": True}},
        "json_schema",
        "uniqueItems",
    ),
    (G, {"text": "x", "sampling_params": {"json_schema": '{"not": {}}'}}, "json_schema", "not"),
    (C, {"prompt": "x", "regex": "a", "ebnf": SQL}, "ebnf", "not both regex and ebnf"),
    (
        CH,
        {"messages": MSG, "regex": "a", "response_format": {"type": "json_object"}},
        "response_format",
        "one output constraint",
    ),
    (
        C,
        {"prompt": "x", "guided_json": {}, "structured_outputs": {"regex": "a"}},
        "structured_outputs.regex",
        "one output constraint",
    ),
    (G, {"text": "x", "sampling_params": {"regex": "a", "ebnf": SQL}}, "ebnf", "only one"),
    (
        C,
        {"prompt": "x", "guided_whitespace_pattern": " "},
        "guided_whitespace_pattern",
        "not supported",
    ),
    (
        C,
        {"prompt": "x", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
        "Unrecognized request argument supplied",
    ),
    (
        CH,
        {"messages": MSG, "response_format": {"type": "structural_tag"}},
        "response_format",
        "structures",
    ),
    (
        # vLLM's newer structural tag shape ("format": xgrammar's tag tree) is not taken.
        CH,
        {"messages": MSG, "response_format": {"type": "structural_tag", "format": {}}},
        "response_format.format",
        "Unrecognized request argument supplied",
    ),
    (CH, {"messages": MSG, "response_format": {"type": "grammar"}}, "response_format.type", ""),
    (
        G,
        {"text": "x", "sampling_params": {"structural_tag": '{"triggers": ["<f"]}'}},
        "structural_tag.structures",
        "non-empty list",
    ),
    # Constraints that compile but admit no output: refused before they run, not aborted
    # with the grammar library's state dumped into the message.
    (
        CH,
        {
            "messages": MSG,
            "max_tokens": 10,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"$ref": "#"}},
            },
        },
        "json_schema",
        NO_OUTPUT,
    ),
    (C, {"prompt": "x", "stream": True, "json_schema": CYCLE}, "json_schema", NO_OUTPUT),
    (C, {"prompt": "x", "regex": "[^\\x00-\\U0010FFFF]"}, "regex", NO_OUTPUT),
    (G, {"text": "x", "sampling_params": {"ebnf": 'root ::= root "a"'}}, "ebnf", NO_OUTPUT),
    # Schemas that allow nothing, not even the empty output they used to end with.
    (C, {"prompt": "x", "json_schema": {"enum": []}}, "json_schema", NO_OUTPUT),
    (C, {"prompt": "x", "json_schema": {"anyOf": []}}, "json_schema", NO_OUTPUT),
    (
        G,
        {"text": "x", "sampling_params": {"json_schema": '{"type": []}'}},
        "json_schema",
        NO_OUTPUT,
    ),
]


@pytest.mark.parametrize("path, body, param, needle", BAD)
def test_bad_constraints_are_400s_naming_the_field(server, path, body, param, needle):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert err["param"] == param and needle in err["message"], err


def test_a_grammar_failing_mid_generation_aborts_with_a_short_message_and_one_log_line(server):
    # 1000 properties: llguidance's parser passes its per-step limit after the `{`; its error
    # dumps its state and the grammar (tens of kB), which neither the client nor the log gets.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    body = {"prompt": "JSON:", "max_tokens": 10, "temperature": 0, "json_schema": wide}
    r = httpx.post(server.url + C, json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["error"]["message"]
    assert choice["finish_reason"] == "abort" and message.startswith("grammar: token "), choice
    assert len(message) < 400 and "\n" not in message and "max is" in message, message
    wait_idle(server.url)
    lines = [line for line in server.log().splitlines() if "grammar failed mid-generation" in line]
    assert len(lines) == 1 and "json_schema" in lines[0] and len(lines[0]) < 500, lines


def test_the_server_serves_after_refused_constraints(server, client):
    out = client.completions.create(
        model="m", prompt="Pick:", max_tokens=4, temperature=0, extra_body={"choice": ["a", "b"]}
    )
    assert out.choices[0].text in ("a", "b")
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]
