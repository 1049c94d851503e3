"""The interface every language backend implements, and what flows through it.

A backend sees prompts as text (and, for chat-only servers, as messages), never IR nodes. It
generates, scores choices for `select`, precomputes shared prefixes, and keeps or releases a
program's KV (sessions) where the runtime behind it can.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from braid.lang.ir import DEFAULT_MAX_TOKENS, SamplingArgs
from braid.runtime.tokenizer.roles import RoleTemplate

# Called with each new piece of text and the request's meta info so far, while it streams.
OnDelta = Callable[[str, dict[str, Any]], None]


@dataclass
class Prompt:
    """Where a program stands when it asks the backend for something.

    `text` is the whole prompt with role boundaries rendered; `messages` the finished role
    messages; `open_role`/`open_content` the role being written and its text so far (None when
    outside any role). `session` names the program session (None: no pinning)."""

    text: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    open_role: str | None = None
    open_content: str = ""
    images: list[str | bytes] = field(default_factory=list)
    session: str | None = None


@dataclass
class GenOutput:
    """A finished generation. `meta` has `prompt_tokens`, `completion_tokens`,
    `cached_tokens`, `finish_reason`, and `output_token_logprobs` (a list of
    `(logprob, token_id, token_text)`) when logprobs were asked for."""

    text: str
    meta: dict[str, Any]


@dataclass
class ChoiceScores:
    """Per choice, the log-probabilities of its tokens after the prompt, and (when asked) the
    same tokens scored without it."""

    conditional: list[list[float]]
    unconditional: list[list[float]] | None
    meta: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """Runs generation for programs. Methods may be called from many threads at once."""

    supports_images: bool = False

    @property
    @abstractmethod
    def role_template(self) -> RoleTemplate:
        """How role boundaries render as text for this backend's model."""

    @abstractmethod
    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingArgs,
        constraint: tuple[str, Any] | None = None,
        on_delta: OnDelta | None = None,
    ) -> GenOutput:
        """Generate after `prompt`; `constraint` is `(kind, spec)` with kind in regex,
        json_schema, choice. Raises `ValueError` for bad input, `RuntimeError` when the runtime
        fails."""

    @abstractmethod
    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        """Log-probabilities of each choice's tokens after `prompt`, in one batched request."""

    def cache_prefix(self, text: str) -> None:
        """Compute `text`'s KV now so that requests starting with it share it. Optional."""
        return None

    def close_session(self, session: str) -> None:
        """Release what the runtime keeps for `session`. Optional."""
        return None

    def shutdown(self) -> None:
        """Release what the backend owns (processes it started, connections)."""
        return None


def max_tokens_of(sampling: SamplingArgs) -> int:
    return DEFAULT_MAX_TOKENS if sampling.max_tokens is None else sampling.max_tokens


def runtime_sampling(sampling: SamplingArgs) -> dict[str, Any]:
    """SamplingArgs as braid runtime `SamplingParams` fields (also /generate's names)."""
    fields = sampling.given()
    fields.pop("return_logprob", None)
    fields["max_tokens"] = max_tokens_of(sampling)
    if sampling.return_logprob:
        fields["logprobs"] = 0
    return fields


def choice_span(prompt_ids: list[int], full_ids: list[int]) -> int:
    """Where a choice's tokens start in `full_ids` (prompt + choice tokenized together): after
    the longest common prefix with the prompt's own tokens, so a token merged across the
    boundary counts as the choice's."""
    n = 0
    for a, b in zip(prompt_ids, full_ids):
        if a != b:
            break
        n += 1
    return min(n, len(full_ids) - 1)


def unconditional_scores(alone: list[float], n: int) -> list[float]:
    """A choice's unconditional scores aligned to its `n` scored tokens: `alone` holds the
    log-probabilities of the choice's tokens after its first (which has no context and scores
    0, see choices.py); the last `n` of them are kept, zero-padded in front."""
    return ([0.0] + alone + [0.0] * n)[-n:]
