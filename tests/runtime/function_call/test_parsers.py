"""Tool-call parsers on canned model texts: whole, and streamed in random splits, where the
streamed deltas (read as an OpenAI client reads them) reassemble to the whole-text parse."""

from __future__ import annotations

import json
import random

import pytest

from braid.runtime.function_call import detect_parser, get_parser, resolve_parser_name

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "add"}},
    {"type": "function", "function": {"name": "echo"}},
]

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
W_ARGS = {"city": "Paris", "unit": "celsius"}
A = '{"name": "add", "arguments": {"a": 1, "b": [2, 3.5], "c": null, "d": true}}'
A_ARGS = {"a": 1, "b": [2, 3.5], "c": None, "d": True}
L_W = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
L_A = '{"name": "add", "parameters": {"a": 1, "b": [2, 3.5], "c": null, "d": true}}'

# (parser, model text, expected content, expected [(name, arguments)])
CASES = [
    # ---- hermes ----
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", W_ARGS)]),
    (
        "hermes",
        f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{A}\n</tool_call>",
        "",
        [("get_weather", W_ARGS), ("add", A_ARGS)],
    ),
    (
        "hermes",
        f"Let me check.\n<tool_call>\n{W}\n</tool_call>\nOne moment.",
        "Let me check.\nOne moment.",
        [("get_weather", W_ARGS)],
    ),
    (
        "hermes",
        '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call> then '
        f"<tool_call>{A}</tool_call>",
        '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call> then',
        [("add", A_ARGS)],
    ),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", "Use <tool> tags, or <tool_cal", "Use <tool> tags, or <tool_cal", []),
    (
        "hermes",
        '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b \\" c"}}</tool_call>',
        "",
        [("echo", {"text": 'a </tool_call> b " c'})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n',
        "",
        [("get_weather", {"city": "Zürich"})],
    ),
    ("hermes", "No tools needed. ", "No tools needed. ", []),
    # ---- llama3 ----
    ("llama3", L_W, "", [("get_weather", W_ARGS)]),
    (
        "llama3",
        f"<|python_tag|>{L_W}; {L_A}",
        "",
        [("get_weather", W_ARGS), ("add", A_ARGS)],
    ),
    (
        "llama3",
        f"Checking.\n<|python_tag|>{L_W}\nDone.",
        "Checking.\nDone.",
        [("get_weather", W_ARGS)],
    ),
    (
        "llama3",
        '{"name": "send_email", "parameters": {"to": "x"}}',
        '{"name": "send_email", "parameters": {"to": "x"}}',
        [],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    (
        "llama3",
        'An object: {"name": "add", "parameters": {}} is JSON.',
        'An object: {"name": "add", "parameters": {}} is JSON.',
        [],
    ),
    ("llama3", f"  {L_A};  no more", ";  no more", [("add", A_ARGS)]),
    ("llama3", "Almost a tag: <|python_ta", "Almost a tag: <|python_ta", []),
    # ---- mistral ----
    ("mistral", f"[TOOL_CALLS] [{W}]", "", [("get_weather", W_ARGS)]),
    ("mistral", f"[TOOL_CALLS][{W}, {A}]", "", [("get_weather", W_ARGS), ("add", A_ARGS)]),
    (
        "mistral",
        f"I will look it up. [TOOL_CALLS] [{W}] Thanks.",
        "I will look it up. Thanks.",
        [("get_weather", W_ARGS)],
    ),
    (
        "mistral",
        f'[TOOL_CALLS] [{W}, {{"name": "send_email", "arguments": {{}}}}]',
        f'[TOOL_CALLS] [{W}, {{"name": "send_email", "arguments": {{}}}}]',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1,}}] after',
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1,}}] after',
        [],
    ),
    ("mistral", "[TOOL_CALLS] sorry", "[TOOL_CALLS] sorry", []),
    ("mistral", "A list [1, 2] and [TOOL_CA", "A list [1, 2] and [TOOL_CA", []),
    # ---- pythonic ----
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", W_ARGS)]),
    (
        "pythonic",
        "[get_weather(city='Paris', unit='celsius'), add(a=1, b=[2, 3.5], c=None, d=True)]",
        "",
        [("get_weather", W_ARGS), ("add", A_ARGS)],
    ),
    (
        "pythonic",
        'Sure: [echo(text="x)] y")] done',
        "Sure: done",
        [("echo", {"text": "x)] y"})],
    ),
    ("pythonic", '[send_email(to="a")]', '[send_email(to="a")]', []),
    ("pythonic", "[add(a=x)]", "[add(a=x)]", []),
    ("pythonic", '[get_weather(city="Paris"]', '[get_weather(city="Paris"]', []),
    ("pythonic", "[add(1, 2)]", "[add(1, 2)]", []),
    ("pythonic", "See [the docs](http://x) [1]", "See [the docs](http://x) [1]", []),
    ("pythonic", "[add(a={'k': (1, 2)})]", "", [("add", {"a": {"k": [1, 2]}})]),
]


def split_points(text: str, rng: random.Random, max_piece: int) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_piece)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def splits(text: str) -> list[list[str]]:
    out = [[text], list(text)]
    for seed in range(6):
        out.append(split_points(text, random.Random(seed), 2 + 3 * seed))
    return out


def run_stream(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed pieces; reassemble as an OpenAI client does from the wire dicts, checking the
    shape of every delta on the way."""
    p = get_parser(parser_name)(TOOLS)
    deltas = []
    for piece in pieces:
        deltas += p.feed(piece)
    deltas += p.finish()
    content, calls = "", {}
    for d in deltas:
        wire = d.to_openai()
        assert len(wire) == 1
        if "content" in wire:
            assert wire["content"]
            content += wire["content"]
            continue
        (tc,) = wire["tool_calls"]
        if "id" in tc:
            assert tc["index"] == len(calls)  # calls are announced in order, once each
            assert tc["id"].startswith("call_") and tc["type"] == "function"
            assert tc["function"]["arguments"] == ""
            calls[tc["index"]] = [tc["function"]["name"], ""]
        else:
            assert set(tc["function"]) == {"arguments"} and tc["function"]["arguments"]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_whole_text_parse(case):
    name, text, content, expected = CASES[case]
    got_content, calls = get_parser(name).parse(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_in_any_split_equals_whole_parse(case):
    name, text, _, _ = CASES[case]
    whole_content, whole_calls = get_parser(name).parse(text, TOOLS)
    want = [(c.name, json.loads(c.arguments)) for c in whole_calls]
    for pieces in splits(text):
        content, calls = run_stream(name, pieces)
        assert content == whole_content, pieces
        assert [(n, json.loads(a)) for n, a in calls] == want, pieces


def test_marker_prefix_is_held_until_decided():
    p = get_parser("hermes")(TOOLS)
    assert [d.to_openai() for d in p.feed("Hi <tool")] == [{"content": "Hi"}]
    assert p.feed("_ca") == []
    assert [d.to_openai() for d in p.feed("t")] == [{"content": " <tool_cat"}]
    assert p.finish() == []


def test_call_header_comes_before_its_arguments_and_content_before_calls():
    p = get_parser("hermes")(TOOLS)
    deltas = p.feed(f"Checking.<tool_call>{W}</tool_call><tool_call>{A}</tool_call>") + p.finish()
    wire = [d.to_openai() for d in deltas]
    assert wire[0] == {"content": "Checking."}
    assert wire[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(wire[2]["tool_calls"][0]["function"]["arguments"]) == W_ARGS
    assert wire[3]["tool_calls"][0]["index"] == 1
    assert p.num_calls == 2


def test_feed_after_finish_is_an_error():
    p = get_parser("llama3")(TOOLS)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


def test_unknown_parser_names_the_field():
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_parser("qwen9")


def test_detect_parser_from_chat_template():
    assert detect_parser("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == (
        "hermes"
    )
    assert detect_parser("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert detect_parser("<|python_tag|>{{ x }}") == "llama3"
    assert detect_parser("[func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect_parser("{{ message['content'] }}") is None
    assert detect_parser(None) is None
    assert resolve_parser_name("auto", "<tool_call>") == "hermes"
    assert resolve_parser_name("none", "<tool_call>") is None
    assert resolve_parser_name("mistral", None) == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        resolve_parser_name("bogus", None)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{A}\n</tool_call>"),
        ("mistral", f"[TOOL_CALLS] [{W}, {A}]"),
        ("pythonic", '[get_weather(city="Paris", unit="celsius"), add(a=1)]'),
    ],
)
def test_parallel_tool_calls_false_keeps_the_first_call(name, text):
    """`parallel_tool_calls: false` with "auto": the calls the model writes past the first are
    dropped, whole and streamed."""
    from braid.runtime.function_call.tools import ToolPlan

    both = ToolPlan.resolve(TOOLS, "auto", True, parser=name).parse(text)[1]
    content, one = ToolPlan.resolve(TOOLS, "auto", False, parser=name).parse(text)
    assert [c.name for c in both] == ["get_weather", "add"]
    assert [(c.name, c.arguments) for c in one] == [(both[0].name, both[0].arguments)]
    assert content == ""
