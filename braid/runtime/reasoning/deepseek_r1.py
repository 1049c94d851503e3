"""DeepSeek-R1: its chat template opens `<think>` in the prompt, so the output starts inside
the reasoning and closes it with `</think>` (later R1 releases write the `<think>` again,
which is dropped). DeepSeek-V3.1's template with thinking off (`chat_template_kwargs`
`{"thinking": false}`) closes it in the prompt instead: the output is then all answer."""

from __future__ import annotations

from braid.runtime.reasoning import PARSERS
from braid.runtime.reasoning.base import ReasoningParser


@PARSERS.register
class DeepSeekR1Parser(ReasoningParser):
    """Everything up to `</think>` is reasoning; with no `</think>`, all of it is; unless the
    prompt itself closed the thinking."""

    @classmethod
    def starts_in_reasoning(cls, prompt: str | None) -> bool:
        if prompt and cls.end in prompt:
            return prompt.rfind(cls.start) > prompt.rfind(cls.end)
        return True
