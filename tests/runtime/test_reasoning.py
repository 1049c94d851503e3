"""Reasoning parsers (deepseek-r1, qwen3): the split of whole outputs, streams in random splits
that give the same split, where a prompt leaves the output, the end marker's token ids, and
the chat stream that feeds the content after the reasoning to a tool-call parser."""

from __future__ import annotations

import random

import pytest

from braid.runtime.function_call.base import ContentDelta, ToolCallDelta
from braid.runtime.function_call.tools import ToolPlan
from braid.runtime.reasoning import PARSER_NAMES, get_parser, split_reasoning
from braid.runtime.reasoning.base import ReasoningDelta, join
from braid.runtime.server.outputs import Choice
from braid.runtime.server.serving_chat import (
    ReasoningTextDelta,
    SeparatedStream,
    _chat_message,
)

QWEN3_THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_NO_THINKING_PROMPT = (
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)

# DeepSeek-V3.1's template, thinking on (`<think>` opens the turn) and off (`</think>`; an
# earlier turn's `</think>` is in both).
V31_HISTORY = "<｜User｜>hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜><｜User｜>and?"
V31_THINKING_PROMPT = V31_HISTORY + "<｜Assistant｜><think>"
V31_NO_THINKING_PROMPT = V31_HISTORY + "<｜Assistant｜></think>"

# (parser, prompt, output, reasoning, content)
CASES = [
    ("deepseek-r1", None, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("deepseek-r1", None, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("deepseek-r1", None, "  still thinking, cut off", "still thinking, cut off", ""),
    ("deepseek-r1", None, "</think>Paris.", "", "Paris."),
    ("deepseek-r1", None, "a <think> b </think> c </think> d", "a <think> b", "c </think> d"),
    ("deepseek-r1", None, "", "", ""),
    ("deepseek-r1", None, "  <thi", "<thi", ""),
    ("deepseek-r1", V31_THINKING_PROMPT, "hmm</think>Paris.", "hmm", "Paris."),
    ("deepseek-r1", V31_NO_THINKING_PROMPT, "Paris, at once.", "", "Paris, at once."),
    ("qwen3", None, "<think>\nhmm\n</think>\n\nParis. ", "hmm", "Paris. "),
    ("qwen3", None, "\n<think>cut", "cut", ""),
    ("qwen3", None, "  Paris, no thinking.\n", "", "  Paris, no thinking.\n"),
    ("qwen3", None, "Paris</think>then", "", "Paris</think>then"),
    ("qwen3", None, "Paris <think>x</think>", "", "Paris <think>x</think>"),
    ("qwen3", None, "<thinking>x</thinking>", "", "<thinking>x</thinking>"),
    ("qwen3", None, " <thi", "", " <thi"),
    ("qwen3", QWEN3_THINKING_PROMPT, "hmm\n</think>\n\nParis.", "hmm", "Paris."),
    ("qwen3", QWEN3_THINKING_PROMPT, "<think>hmm</think>Paris.", "hmm", "Paris."),
    ("qwen3", QWEN3_THINKING_PROMPT, "hmm, cut off", "hmm, cut off", ""),
    ("qwen3", QWEN3_NO_THINKING_PROMPT, "Paris.", "", "Paris."),
]


def streamed(parser, pieces: list[str]) -> tuple[str, str]:
    deltas = [parser.feed(p) for p in pieces]
    return join([*deltas, parser.finish()])


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_whole_output_splits_into_reasoning_and_content(name, prompt, text, reasoning, content):
    parser = get_parser(name)(prompt)
    assert parser.split(text) == (reasoning, content)
    assert streamed(get_parser(name)(prompt), [text]) == (reasoning, content)
    assert streamed(get_parser(name)(prompt), list(text)) == (reasoning, content)


def test_streams_in_random_splits_equal_the_whole_split():
    # Texts built from the markers' pieces, so that markers are cut across chunks every way.
    alphabet = ["<think>", "</think>", "<", "</", "think", ">", "</th", " ", "\n", "a", "bc"]
    rng = random.Random(16)
    checked = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        for name, prompt in (
            ("deepseek-r1", None),
            ("qwen3", None),
            ("qwen3", QWEN3_THINKING_PROMPT),
        ):
            whole = get_parser(name)(prompt).split(text)
            for _ in range(8):
                pieces = random_pieces(text, rng)
                assert streamed(get_parser(name)(prompt), pieces) == whole, (name, pieces)
                checked += 1
    assert checked == 300 * 3 * 8


def test_a_stream_sends_reasoning_as_it_comes_and_holds_only_a_possible_marker():
    p = get_parser("deepseek-r1")()
    assert p.feed("\nFirst") == ReasoningDelta(reasoning="First")
    assert p.feed(" step </th") == ReasoningDelta(reasoning=" step")
    assert not p.reasoning_ended
    assert p.feed("ink>\n\nAns") == ReasoningDelta(content="Ans")
    assert p.reasoning_ended
    assert p.feed("wer") == ReasoningDelta(content="wer")
    assert not p.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")


def test_qwen3_starts_in_reasoning_only_when_the_prompt_leaves_think_open():
    qwen3 = get_parser("qwen3")
    assert qwen3.starts_in_reasoning(QWEN3_THINKING_PROMPT)
    assert not qwen3.starts_in_reasoning(QWEN3_NO_THINKING_PROMPT)
    assert not qwen3.starts_in_reasoning(None)
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n")
    earlier_turn = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>assistant\n"
    assert not qwen3.starts_in_reasoning(earlier_turn)
    assert get_parser("deepseek-r1").starts_in_reasoning(None)


def test_end_marker_text_and_token_ids(tmp_path):
    from transformers import AutoTokenizer

    from tests.runtime.tiny_tokenizers import build_byte_level_bpe

    tok = AutoTokenizer.from_pretrained(str(build_byte_level_bpe(tmp_path / "tok")))
    for name in PARSER_NAMES:
        cls = get_parser(name)
        assert (cls.start, cls.end) == ("<think>", "</think>")
        ids = cls.end_token_ids(tok)
        assert len(ids) > 1 and tok.decode(ids) == "</think>"  # no such token: several
    tok.add_tokens(["<think>", "</think>"])  # as DeepSeek-R1's and Qwen3's vocabularies have
    parser = get_parser("qwen3")()
    assert parser.end_token_ids(tok) == [tok.convert_tokens_to_ids("</think>")]
    assert parser.start_token_ids(tok) == [tok.convert_tokens_to_ids("<think>")]


def test_registry_names_and_unknown_names():
    assert PARSER_NAMES == ("deepseek-r1", "qwen3")
    assert get_parser("qwen3").__name__ == "Qwen3Parser"
    with pytest.raises(ValueError, match=r"reasoning_parser: 'o1' is unknown \(have \["):
        get_parser("o1")
    with pytest.raises(ValueError, match="unknown model_type"):
        split_reasoning("x", "o1")


def test_language_split_keeps_its_meaning():
    assert split_reasoning("<think> a b </think> answer ", "qwen3") == ("a b", "answer")
    assert split_reasoning("  no thinking here", "qwen3") == ("", "  no thinking here")
    assert split_reasoning("straight in</think>Paris", None) == ("straight in", "Paris")


# ---- the chat side: reasoning first, then content and tool calls ---------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_TEXT = (
    '<think>\nShould I call <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    "? Yes.\n</think>\n\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def accumulate(deltas) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning, content, calls = "", "", {}
    for d in deltas:
        if isinstance(d, ReasoningTextDelta):
            assert d.to_openai() == {"reasoning_content": d.text, "reasoning": d.text}
            assert not content and not calls, "reasoning after content"
            reasoning += d.text
        elif isinstance(d, ContentDelta):
            content += d.text
        elif isinstance(d, ToolCallDelta) and d.id is not None:
            calls[d.index] = [d.name, d.arguments]
        else:
            calls[d.index][1] += d.arguments
    return reasoning, content, [tuple(c) for _, c in sorted(calls.items())]


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning():
    plan = ToolPlan.resolve([WEATHER], "auto", parser="hermes")
    typed, finish = _chat_message(
        Choice(text=CALL_TEXT, finish_reason="stop"), plan, get_parser("qwen3")()
    )
    message = typed.model_dump()  # as on the wire
    thought = 'Should I call <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>? Yes.'
    assert message["reasoning_content"] == message["reasoning"] == thought
    assert message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert finish == "tool_calls"

    rng = random.Random(7)
    for _ in range(40):
        stream = SeparatedStream(get_parser("qwen3")(), plan.stream())
        deltas = [d for piece in random_pieces(CALL_TEXT, rng) for d in stream.feed(piece)]
        deltas += stream.finish()
        call = ("get_weather", '{"city": "Paris"}')
        assert accumulate(deltas) == (thought, "Let me look.", [call])
        assert stream.num_calls == 1


def test_without_tools_the_rest_is_content_and_no_reasoning_reads_none():
    message, finish = _chat_message(Choice(text="Paris.", finish_reason="stop"), None, None)
    assert message.model_dump() == {"role": "assistant", "content": "Paris."}
    assert finish == "stop"
    message, _ = _chat_message(
        Choice(text="Paris.", finish_reason="stop"), None, get_parser("qwen3")()
    )
    assert message.model_dump() == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": None,
        "reasoning": None,
    }
    stream = SeparatedStream(get_parser("deepseek-r1")(), None)
    deltas = stream.feed("mull</think>") + stream.feed(" Paris.") + stream.finish()
    assert accumulate(deltas) == ("mull", "Paris.", [])
