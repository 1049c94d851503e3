"""`LLM.chat` with tools, offline (the embedded SmolLM2)."""

from __future__ import annotations

import json

import jsonschema
import pytest

import braid

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_named_tool_choice_returns_a_valid_call(smollm2):
    (out,) = smollm2.chat(
        ASK,
        braid.SamplingParams(temperature=0, max_tokens=40),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        use_tqdm=False,
    )
    sample = out.outputs[0]
    (call,) = sample.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert call.arguments == sample.text  # the constrained text is the arguments
    jsonschema.validate(json.loads(call.arguments), PARAMS)


def test_bad_tool_fields_raise_naming_the_field(smollm2):
    with pytest.raises(ValueError, match=r"^tool_choice\.function\.name:"):
        smollm2.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(ValueError, match=r"^tool_choice:"):
        smollm2.chat(ASK, tool_choice="required")
    with pytest.raises(ValueError, match=r"^tool_choice:"):
        smollm2.chat(
            ASK,
            braid.SamplingParams(regex="a+"),
            tools=TOOLS,
            tool_choice="required",
        )
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.name:"):
        smollm2.chat(ASK, tools=[{"type": "function", "function": {}}])


def test_auto_tool_calls_need_a_parser(smollm2):
    """SmolLM2's template shows no call format braid knows: "auto" (the default with tools)
    is refused unless a parser is named; "none" gives the raw text on purpose."""
    with pytest.raises(ValueError, match=r'^tool_choice: "auto" needs a tool-call parser'):
        smollm2.chat(ASK, tools=TOOLS, use_tqdm=False)
    sp = braid.SamplingParams(temperature=0, max_tokens=4)
    (raw,) = smollm2.chat(ASK, sp, tools=TOOLS, tool_call_parser="none", use_tqdm=False)
    assert raw.outputs[0].text and raw.outputs[0].tool_calls == []
    (parsed,) = smollm2.chat(ASK, sp, tools=TOOLS, tool_call_parser="hermes", use_tqdm=False)
    assert parsed.outputs[0].token_ids == raw.outputs[0].token_ids
