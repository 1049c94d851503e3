"""Reasoning formats: splitting a reasoning model's output into its thinking and its answer (a
registry of lazily imported parsers, `--reasoning-parser`).

DeepSeek-R1 and Qwen3 write their reasoning between `<think>` and `</think>`. DeepSeek-R1's
template opens the `<think>` itself, so its output starts inside the reasoning; Qwen3 writes
both tags, or its template opens the first (and with thinking off it writes none).

    parser = get_parser("qwen3")(prompt_text)        # one parser per output
    reasoning, content = parser.split(model_text)     # whole text
    for piece in pieces: send(parser.feed(piece))     # or as it streams
    send(parser.finish())
    parser.end, parser.end_token_ids(tokenizer)      # where the reasoning ends
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.reasoning.base import ReasoningParser

PARSERS: Registry[type[ReasoningParser]] = Registry(
    "reasoning_parser",
    {
        "deepseek-r1": "braid.runtime.reasoning.deepseek_r1",
        "qwen3": "braid.runtime.reasoning.qwen3",
    },
    unknown="{kind}: {name!r} is unknown (have {known})",
)

PARSER_NAMES = tuple(PARSERS.names())


def get_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; `ValueError` naming the setting if unknown."""
    return PARSERS.get(name)


def reasoning_format(model_type: str | None) -> type[ReasoningParser]:
    """The parser of `model_type` (None: deepseek-r1's, SGLang's default), under the language's
    name for it (`separate_reasoning(model_type=...)`); `ValueError` for an unknown name."""
    name = model_type or "deepseek-r1"
    if name not in PARSERS:
        raise ValueError(f"reasoning: unknown model_type {name!r}; known: {list(PARSER_NAMES)}")
    return get_parser(name)


def split_reasoning(text: str, model_type: str | None = None) -> tuple[str, str]:
    """(reasoning, answer) of a whole output whose prompt is not known, both stripped. Without
    reasoning the answer is the text as it is; an output cut off before the closing tag is
    all reasoning."""
    parser = reasoning_format(model_type)()
    reasoning, answer = parser.split(text)
    opened = parser.in_reasoning_at_start or text.lstrip().startswith(parser.start)
    return reasoning, answer.strip() if opened else answer
