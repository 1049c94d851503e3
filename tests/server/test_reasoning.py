"""`braid serve --reasoning-parser qwen3` with the official `openai` client. SmolLM2 does not
think on its own, so a regex constraint makes it write `<think>...</think>` and an answer; the
split of that real output is checked whole, streamed, with tool calls after the reasoning, and
turned off per request."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from braid.runtime.server.openai_types import ChatCompletion, ChatCompletionChunk
from tests.server.conftest import sse_data, start_server

# Short forced outputs keep the module quick on a CPU: reasoning then an answer, and reasoning
# then a hermes tool call.
THINK = r"<think>\n(ab|cd) (ef|gh)\n</think>\n\n(yes|no)"
CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
THINK_THEN_CALL = r"<think>\n(ab|cd)\n</think>\n\n" + CALL.replace("{", r"\{").replace("}", r"\}")
ASK = [{"role": "user", "content": "Think, then tell me the time."}]
NOW_TOOL = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("serve-reasoning"),
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def ask(client, regex: str, **kw):
    # Sampled with a seed, not greedy: the same seed gives the same output, and a sampled
    # request keeps the text jump-forward appends at once (a greedy one checks it token by
    # token against the model, ten times slower here).
    return client.chat.completions.create(
        model="smollm2-135m",
        messages=ASK,
        temperature=1.0,
        seed=16,
        max_tokens=80,
        extra_body={"regex": regex, **kw.pop("extra_body", {})},
        **kw,
    )


def expected_split(raw: str) -> tuple[str, str]:
    """The split of an output the constraint allowed: the groups, without tags or newlines."""
    m = re.fullmatch(THINK, raw)
    assert m, raw
    return f"{m[1]} {m[2]}", m[3]


@pytest.fixture(scope="module")
def whole(client):
    return ask(client, THINK)


def test_the_reasoning_is_split_from_the_real_output(whole):
    choice = whole.choices[0]
    msg = choice.message
    # The one output of the constraint with this split: only the tags and newlines went.
    raw = f"<think>\n{msg.reasoning_content}\n</think>\n\n{msg.content}"
    assert expected_split(raw) == (msg.reasoning_content, msg.content)
    assert msg.reasoning == msg.reasoning_content
    assert choice.finish_reason == "stop"


def test_streamed_deltas_carry_the_same_split_reasoning_first(client, whole):
    reasoning, content, kinds = "", "", []
    for chunk in ask(client, THINK, stream=True):
        for choice in chunk.choices:
            d = choice.delta
            r = getattr(d, "reasoning_content", None)
            assert r == getattr(d, "reasoning", None)
            if r:
                reasoning += r
                kinds.append("reasoning")
            if d.content:
                content += d.content
                kinds.append("content")
    msg = whole.choices[0].message  # the same seed: the same output
    assert (reasoning, content) == (msg.reasoning_content, msg.content)
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning" in kinds


def test_streamed_tool_calls_come_from_the_content_after_the_reasoning(client):
    reasoning, names, args, finish = "", [], "", None
    stream = ask(client, THINK_THEN_CALL, stream=True, tools=[NOW_TOOL], tool_choice="auto")
    for chunk in stream:
        for choice in chunk.choices:
            assert not names or not getattr(choice.delta, "reasoning_content", None)
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            assert not choice.delta.content
            for tc in choice.delta.tool_calls or []:
                names += [tc.function.name] if tc.id else []
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert reasoning in ("ab", "cd")
    assert (names, args, finish) == (["now"], "{}", "tool_calls")


def test_separate_reasoning_false_returns_the_raw_text(client, whole):
    raw = ask(client, THINK, extra_body={"separate_reasoning": False})
    msg = raw.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    first = whole.choices[0].message  # the same seed: the same output, split
    assert expected_split(msg.content) == (first.reasoning_content, first.content)
    assert raw.usage.completion_tokens == whole.usage.completion_tokens


def test_server_info_reports_the_parser(server):
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert info["reasoning_parser"] == "qwen3"


def test_a_constraint_without_the_marker_is_enforced_on_the_answer(client):
    """SmolLM2 spells `<think>` in several tokens, so the first token cannot tell whether it
    thinks: a constraint that does not spell `</think>` applies from the start (never
    unconstrained text), and there is no reasoning."""
    r = ask(client, r"(yes|no)( indeed)?")
    msg = r.choices[0].message
    assert re.fullmatch(r"(yes|no)( indeed)?", msg.content), msg.content
    assert msg.reasoning_content is None


def _waits(prompt: str, parser: str, constraint, start_end_ids: tuple[int, int] | None):
    """What `ChatResponse.grammar_waits` decides for one prompt, with a tokenizer that spells
    each marker in one token (`start_end_ids`) or in several (None)."""
    from types import SimpleNamespace

    from braid.runtime.reasoning import get_parser
    from braid.runtime.server.serving_chat import ChatResponse

    class Tok:
        def encode(self, text, add_special_tokens=False):
            if start_end_ids is None:
                return [ord(c) for c in text]
            return [start_end_ids[0] if text == "<think>" else start_end_ids[1]]

    r = ChatResponse.__new__(ChatResponse)
    r.state = SimpleNamespace(tokenizer=Tok())
    r.reasoning = get_parser(parser)
    r.params = SimpleNamespace(constraint=constraint)
    r.prompts = [(prompt, [1])]
    waits = r.grammar_waits()
    return None if waits is None else waits[0]


def test_where_a_constraint_starts_under_each_parser():
    regex = ("regex", "(yes|no)")
    one = (7, 8)  # <think>, </think> as single tokens (Qwen3, DeepSeek-R1)
    # Qwen3 may or may not think: the first token decides (the grammar's, or <think>).
    assert _waits("<|im_start|>assistant\n", "qwen3", regex, one) == ([8], 7)
    # ... its template opened the thinking: the grammar waits for </think>.
    assert _waits("assistant\n<think>\n", "qwen3", regex, one) == ([8], None)
    # ... or closed it (enable_thinking=False): the grammar applies from the start.
    assert _waits("assistant\n<think>\n\n</think>\n\n", "qwen3", regex, one) == ([], None)
    # DeepSeek-R1's template always opens it.
    assert _waits("<｜Assistant｜><think>\n", "deepseek-r1", regex, one) == ([8], None)
    # A multi-token <think> cannot be decided on one token: from the start.
    assert _waits("<|im_start|>assistant\n", "qwen3", regex, None) == ([], None)
    # A constraint that spells the end marker covers the thinking: from the start.
    assert _waits("x", "deepseek-r1", ("regex", "<think>a</think>b"), one) is None
    assert _waits("x", "qwen3", None, one) is None


def test_reasoning_and_tool_call_bodies_parse_into_the_response_models(server):
    body = {
        "model": "m",
        "messages": ASK,
        "temperature": 1.0,
        "seed": 16,
        "max_tokens": 80,
        "regex": THINK_THEN_CALL,
        "tools": [NOW_TOOL],
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = ChatCompletion.model_validate_json(r.content).choices[0].message
    assert (
        message.reasoning_content in ("ab", "cd") and message.reasoning == message.reasoning_content
    )
    assert [c.function.name for c in message.tool_calls] == ["now"]
    chunks = [
        ChatCompletionChunk.model_validate_json(d)
        for d in sse_data(f"{server.url}/v1/chat/completions", {**body, "stream": True})
    ]
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert any("reasoning_content" in d for d in deltas) and any("tool_calls" in d for d in deltas)
