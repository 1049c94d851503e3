"""Reasoning formats: splitting a reasoning model's output into its thinking and its answer.

DeepSeek-R1 and Qwen3 write their reasoning between `<think>` and `</think>`. DeepSeek-R1's
template opens the `<think>` itself, so its output may start inside the reasoning with no
opening tag; Qwen3 writes both tags (and none when thinking is off).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    # The output starts inside the reasoning even without the opening tag.
    starts_in_reasoning: bool


REASONING_FORMATS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    """The format of `model_type` (None: deepseek-r1's, SGLang's default); `ValueError` for an
    unknown name."""
    name = model_type or "deepseek-r1"
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"reasoning: unknown model_type {name!r}; known: {sorted(REASONING_FORMATS)}"
        ) from None


def split_reasoning(text: str, model_type: str | None = None) -> tuple[str, str]:
    """(reasoning, answer) of a whole output. Without reasoning the answer is the text; an
    output cut off before the closing tag is all reasoning."""
    fmt = reasoning_format(model_type)
    body = text.lstrip()
    if body.startswith(fmt.start):
        body = body[len(fmt.start) :]
    elif not fmt.starts_in_reasoning:
        return "", text
    reasoning, closed, answer = body.partition(fmt.end)
    if not closed:
        return reasoning.strip(), ""
    return reasoning.strip(), answer.strip()
