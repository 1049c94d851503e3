"""tools / tool_choice validation, the schemas that constrain decoding, and the streams that
turn constrained output into calls."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from braid.runtime.constrained.grammar import to_regex
from braid.runtime.function_call.base import assemble
from braid.runtime.function_call.tools import (
    NamedCallStream,
    RequiredCallStream,
    ToolPlan,
    check_tools,
    finish_reason,
    required_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]


@pytest.mark.parametrize(
    "tools, field",
    [
        ({"name": "x"}, "tools"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([WEATHER, {"type": "function", "function": {"name": ""}}], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            "tools[0].function.parameters",
        ),
        ([ADD, ADD], "tools[1].function.name"),
    ],
)
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ValueError) as e:
        check_tools(tools)
    assert str(e.value).split(":", 1)[0] == field


@pytest.mark.parametrize(
    "tools, choice, parallel, field",
    [
        (None, "required", True, "tool_choice"),
        ([], "required", True, "tool_choice"),
        (TOOLS, "sometimes", True, "tool_choice"),
        (TOOLS, 3, True, "tool_choice"),
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            True,
            "tool_choice.function.name",
        ),
        (
            None,
            {"type": "function", "function": {"name": "add"}},
            True,
            "tool_choice.function.name",
        ),
        (TOOLS, {"type": "function"}, True, "tool_choice.function.name"),
        (TOOLS, {"type": "tool", "function": {"name": "add"}}, True, "tool_choice.type"),
        (TOOLS, "auto", "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tool_choice_names_the_field(tools, choice, parallel, field):
    with pytest.raises(ValueError) as e:
        ToolPlan.resolve(tools, choice, parallel)
    assert str(e.value).split(":", 1)[0] == field


def test_tool_choice_modes():
    assert ToolPlan.resolve(None) is None
    assert ToolPlan.resolve(None, "auto") is None
    auto = ToolPlan.resolve(TOOLS, parser="hermes")
    assert auto.mode == "auto" and auto.template_tools == TOOLS and auto.json_schema is None
    none = ToolPlan.resolve(TOOLS, "none", parser="hermes")
    assert none.template_tools is None and none.stream() is None
    assert none.parse("<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])
    assert ToolPlan.resolve(TOOLS, "auto").stream() is None  # no parser: plain content
    named = ToolPlan.resolve(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.json_schema == ADD["function"]["parameters"]
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolPlan.resolve(TOOLS, parser="nope")


def test_special_tokens_kept_only_for_parsers_that_need_them():
    assert ToolPlan.resolve(TOOLS, parser="mistral").skip_special_tokens is False
    assert ToolPlan.resolve(TOOLS, parser="hermes").skip_special_tokens is None
    assert ToolPlan.resolve(TOOLS, "required", parser="mistral").skip_special_tokens is None


def call_array(calls: list[tuple[str, dict]]) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in calls])


def test_required_schema_accepts_exactly_well_formed_calls():
    schema = required_schema(TOOLS, parallel=True)
    regex = to_regex("json_schema", schema)
    good = call_array(
        [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    )
    jsonschema.validate(json.loads(good), schema)
    assert re.fullmatch(regex, good)
    for bad in (
        "[]",
        call_array([("add", {"city": "Oslo", "unit": "celsius"})]),  # another tool's arguments
        call_array([("get_weather", {"city": "Oslo", "unit": "kelvin"})]),
        call_array([("mul", {"a": 1, "b": 2})]),
        call_array([("get_weather", {"city": "a much too long city", "unit": "celsius"})]),
    ):
        assert not re.fullmatch(regex, bad), bad
    single = to_regex("json_schema", required_schema(TOOLS, parallel=False))
    assert re.fullmatch(single, call_array([("add", {"a": 1, "b": 2})]))
    assert not re.fullmatch(single, call_array([("add", {"a": 1, "b": 2})] * 2))


def test_required_schema_hoists_definitions_to_the_root():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tool = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Point"}},
                "required": ["to"],
                "$defs": {"Point": point},
            },
        },
    }
    schema = required_schema([tool, ADD], parallel=True)
    assert schema["$defs"] == {"Point": point}
    regex = to_regex("json_schema", schema)
    assert re.fullmatch(regex, call_array([("move", {"to": {"x": 3}})]))
    assert not re.fullmatch(regex, call_array([("move", {"to": {"y": 3}})]))
    other = json.loads(json.dumps(tool))
    other["function"]["name"] = "jump"
    other["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    with pytest.raises(ValueError, match="^tools:"):
        required_schema([tool, other], parallel=True)


def pieces_of(text: str, seed: int) -> list[str]:
    if seed == 0:
        return [text]
    if seed == 1:
        return list(text)
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(6))
def test_required_stream_sends_each_call_and_streams_its_arguments(seed):
    args1 = '{"city": "Oslo", "unit": "celsius"}'
    args2 = '{ "a": 1, "b": {"c": "}]"} }'
    text = (
        f'[{{"name": "get_weather", "arguments": {args1}}}, '
        f'{{ "name" : "add","arguments":{args2} }}]'
    )
    s = RequiredCallStream()
    deltas = []
    for piece in pieces_of(text, seed):
        deltas += s.feed(piece)
    deltas += s.finish()
    content, calls = assemble(deltas)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", args1), ("add", args2)]
    if seed == 1:  # one character at a time: the arguments arrive in many pieces
        assert sum(1 for d in deltas if getattr(d, "id", "x") is None) > len(args1)


def test_required_stream_of_a_cut_off_output_keeps_what_it_has():
    s = RequiredCallStream()
    deltas = s.feed('[{"name": "add", "arguments": {"a": 1, ') + s.finish()
    assert assemble(deltas)[1][0].arguments == '{"a": 1, '
    s = RequiredCallStream()
    deltas = s.feed('[{"name": "ad') + s.finish()  # cut before any call: the text is content
    assert assemble(deltas) == ('[{"name": "ad', [])


@pytest.mark.parametrize("seed", range(4))
def test_named_stream_is_one_call_with_the_text_as_arguments(seed):
    text = '{"a": 1, "b": 2}'
    s = NamedCallStream("add")
    deltas = []
    for piece in pieces_of(text, seed):
        deltas += s.feed(piece)
    deltas += s.finish()
    assert deltas[0].name == "add" and deltas[0].id.startswith("call_")
    _, calls = assemble(deltas)
    assert [(c.name, c.arguments) for c in calls] == [("add", text)]


def test_finish_reason_is_tool_calls_only_for_a_natural_end_with_calls():
    assert finish_reason("stop", 2) == "tool_calls"
    assert finish_reason("stop", 0) == "stop"
    assert finish_reason("length", 1) == "length"
    assert finish_reason("abort", 1) == "abort"


def test_strict_tools_with_auto_hold_hermes_calls_to_their_schemas():
    """OpenAI's `strict` with "auto": every call the hermes format starts is held to its
    tool's parameters by a structural tag (free text elsewhere); the text it allows parses
    back into the call. Formats without such a structure, or another constraint, refuse."""
    from braid.runtime.function_call.hermes import HermesParser
    from braid.runtime.sampling_params import SamplingParams

    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, ADD]
    plan = ToolPlan.resolve(strict, "auto", True, parser="hermes")
    tag = plan.sampling_params(SamplingParams()).structural_tag
    tag = json.loads(tag) if isinstance(tag, str) else tag
    assert tag["triggers"] == ["<tool_call>"]
    assert [s["schema"] for s in tag["structures"]] == [
        WEATHER["function"]["parameters"],
        ADD["function"]["parameters"],
    ]
    args = {"city": "Oslo", "unit": "celsius"}
    begin, end = tag["structures"][0]["begin"], tag["structures"][0]["end"]
    content, calls = HermesParser.parse("Sure. " + begin + json.dumps(args) + end, strict)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", args)
    ]
    loose = ToolPlan.resolve(TOOLS, "auto", True, parser="hermes")
    assert loose.sampling_params(SamplingParams()).structural_tag is None
    with pytest.raises(ValueError, match=r"^tools: strict tools .* not with the llama3 parser"):
        ToolPlan.resolve(strict, "auto", True, parser="llama3").sampling_params(SamplingParams())
    with pytest.raises(ValueError, match=r"^tools: strict tools constrain the calls"):
        plan.sampling_params(SamplingParams(regex="a+"))
