"""The base class of every reasoning parser: a model's thinking between two markers (`<think>`,
`</think>`), split from its answer, for a whole output or as it streams.

A parser is a state machine over characters. `feed(text)` returns the reasoning and content
that the text seen so far decides; `finish()` releases what is still held at the end. Every
decision depends only on the characters, never on how they were cut into pieces, so the
pieces of a stream join to exactly what `split(text)` returns for the whole text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from braid.runtime.function_call.base import held_prefix_len

State = Literal["opening", "reasoning", "after", "content"]


@dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of output decided: its reasoning text and its content text."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def marker_token_ids(tokenizer: Any, marker: str) -> list[int]:
    """The token ids `marker` encodes to alone (no BOS). For DeepSeek-R1 and Qwen3, `<think>`
    and `</think>` are each one vocabulary entry; for other tokenizers the marker may take
    several tokens, and a model may spell it with other tokens than these."""
    return list(tokenizer.encode(marker, add_special_tokens=False))


class ReasoningParser(ABC):
    """One output's split into reasoning and content; subclasses are the formats, registered
    under their names (`braid.runtime.reasoning.PARSERS`).

    The rules, for the whole text and for any stream of it:
    - An output that opens with `start` (after whitespace) is reasoning up to `end`.
    - Otherwise it is reasoning up to `end` when it starts inside the reasoning
      (`starts_in_reasoning`: the prompt already opened it), else it is all content, as
      written (a later `start` or `end` is content too).
    - Reasoning that never reaches `end` (an output cut off) is all reasoning.
    - The reasoning is stripped of whitespace at both ends, the content after `end` of the
      whitespace at its start.
    """

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, prompt: str | None = None) -> None:
        """A parser for one output of `prompt` (the text the output continues; None when it
        is not known)."""
        self.in_reasoning_at_start = self.starts_in_reasoning(prompt)
        self._state: State = "opening"
        self._pending = ""  # text seen but not yet decided
        self._reasoning_started = False  # reasoning other than leading whitespace was sent
        self._finished = False

    @classmethod
    @abstractmethod
    def starts_in_reasoning(cls, prompt: str | None) -> bool:
        """Whether an output of `prompt` begins inside the reasoning without writing `start`
        (its chat template opened it)."""

    @classmethod
    def end_token_ids(cls, tokenizer: Any) -> list[int]:
        """The token ids of the end-of-reasoning marker, `end`, for `tokenizer`."""
        return marker_token_ids(tokenizer, cls.end)

    @classmethod
    def start_token_ids(cls, tokenizer: Any) -> list[int]:
        """The token ids of the opening marker, `start`, for `tokenizer`."""
        return marker_token_ids(tokenizer, cls.start)

    @property
    def reasoning_ended(self) -> bool:
        """Whether the text fed so far has passed the end of the reasoning (or has none)."""
        return self._state in ("after", "content")

    # ---- whole text -------------------------------------------------------------------
    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output, by the rules above; leaves the stream's
        state alone."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif not self.in_reasoning_at_start:
            return "", text
        reasoning, _, content = body.partition(self.end)
        return reasoning.strip(), content.lstrip()

    # ---- streaming --------------------------------------------------------------------
    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of output; returns the reasoning and content it decides."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The output ended: release what is still held. Further calls return nothing."""
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        held, self._pending = self._pending, ""
        if self._state == "opening":
            if not self.in_reasoning_at_start:
                return ReasoningDelta(content=held)
            self._state = "reasoning"
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=self._reasoning_text(held.rstrip()))
        return ReasoningDelta()  # after the end marker only its trailing whitespace was held

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Decide what the pending text can; True to run again (the state changed)."""
        pending = self._pending
        if self._state == "opening":
            body = pending.lstrip()
            if body.startswith(self.start):
                self._pending, self._state = body[len(self.start) :], "reasoning"
                return True
            if self.start.startswith(body):
                return False  # whitespace, or a start of `start`: wait for more
            if self.in_reasoning_at_start:
                self._state = "reasoning"
                return True
            self._state = "content"
            return True
        if self._state == "reasoning":
            at = pending.find(self.end)
            if at >= 0:
                reasoning.append(self._reasoning_text(pending[:at].rstrip()))
                self._pending, self._state = pending[at + len(self.end) :], "after"
                return True
            # Hold a tail that may start `end`, and whitespace before it: the reasoning's
            # trailing whitespace is dropped if `end` follows.
            cut = len(pending) - held_prefix_len(pending, (self.end,))
            body = pending[:cut].rstrip()
            reasoning.append(self._reasoning_text(body))
            self._pending = pending[len(body) :]
            return False
        if self._state == "after":
            body = pending.lstrip()
            if not body:
                self._pending = ""
                return False
            self._pending, self._state = body, "content"
            return True
        content.append(pending)
        self._pending = ""
        return False

    def _reasoning_text(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return text


def join(deltas: Sequence[ReasoningDelta]) -> tuple[str, str]:
    """The (reasoning, content) that a stream's deltas spell."""
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)
