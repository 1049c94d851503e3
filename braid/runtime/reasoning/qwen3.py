"""Qwen3: the model writes `<think>...</think>` itself, or its chat template opens `<think>` in
the prompt (Qwen3-Thinking-2507, Qwen3.5) so that only `</think>` is in the output. With
`enable_thinking=False` the template writes an empty `<think></think>` into the prompt and
the output is all answer."""

from __future__ import annotations

from braid.runtime.reasoning import PARSERS
from braid.runtime.reasoning.base import ReasoningParser


@PARSERS.register
class Qwen3Parser(ReasoningParser):
    """Reasoning when the output opens `<think>`, or when the prompt ends inside an open
    `<think>`; otherwise the output is all content."""

    @classmethod
    def starts_in_reasoning(cls, prompt: str | None) -> bool:
        if not prompt:
            return False
        return prompt.rfind(cls.start) > prompt.rfind(cls.end)
