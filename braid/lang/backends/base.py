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
    outside any role). `images` are the prompt's images in order (as `image()` keeps them:
    `braid.lang.images`), each standing at one `Backend.image_placeholder` in `text` (and in
    the content of the message it is in). `session` names the program session (None: no
    pinning); `position` is this call's position in the program run (0 for its first gen or
    select, then 1, ...; a fork's branches each go on from the parent's next position, and
    after a join the parent goes on from the furthest branch), which backends send with the
    session or the program for the runtime's per-program accounting. `program` names the
    program run (with or without a session); backends that can send it send it with each
    request, so the runtime schedules by program (`--schedule-policy program` or
    `program-srpt`) even where nothing is pinned. `loose_text` names the first text (quoted, cut
    to 40 characters) or image the program wrote outside any role, which a backend that sends
    only the messages of a chat must refuse rather than drop."""

    text: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    open_role: str | None = None
    open_content: str = ""
    images: list[Any] = field(default_factory=list)
    session: str | None = None
    position: int | None = None
    program: str | None = None
    loose_text: str | None = None


@dataclass
class GenOutput:
    """A finished generation. `meta` is SGLang's meta info: `id`, `prompt_tokens`,
    `completion_tokens`, `cached_tokens`, `finish_reason` (`{"type": "stop" | "length" |
    "abort", ...}`), `e2e_latency`, and with logprobs `output_token_logprobs` (a list of
    `[logprob, token_id, token_text]`), `output_top_logprobs` (per token, the most likely
    alternatives in that shape), `input_token_logprobs` / `input_top_logprobs` (the prompt's,
    from `logprob_start_len`). With `n > 1`, `texts` holds every sample (`text`, `meta` are the
    first's)."""

    text: str
    meta: dict[str, Any]
    texts: list[str] | None = None


@dataclass
class ChoiceScores:
    """Per choice, its tokens after the prompt as `[logprob, token_id, text]` (token id None
    where the backend does not know it), and (when asked) the same tokens scored without the
    prompt (the first, which then has no context, has logprob None)."""

    tokens: list[list[list[Any]]]
    unconditional: list[list[list[Any]]] | None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def conditional(self) -> list[list[float]]:
        """Per choice, just the log-probabilities."""
        return [[t[0] for t in toks] for toks in self.tokens]


def logprob_entry(logprob: float | None, token_id: int | None, text: str | None) -> list[Any]:
    return [logprob, token_id, text]


class Backend(ABC):
    """Runs generation for programs. Methods may be called from many threads at once."""

    # Whether prompts may hold images (`image()`); where true, `image_placeholder` is the text
    # that stands for one.
    supports_images: bool = False

    @property
    def image_placeholder(self) -> str:
        """The prompt text that stands for one image: the model's own (its chat template's
        form, which the runtime expands to the image's tokens) where the backend knows it."""
        raise ValueError("image(): this backend's model takes text only")

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

    def cache_prefix(self, text: str, images: list[Any] | None = None) -> None:
        """Compute `text`'s KV now (with `images`, one per placeholder in it) so that requests
        starting with it share it. Optional."""
        return None

    def close_session(self, session: str) -> None:
        """Release what the runtime keeps for `session`. Optional."""
        return None

    @property
    def precache_key(self) -> object:
        """What names the runtime whose cache `cache_prefix` fills (a program pre-computes
        its constant prefix once per runtime, whichever backend object reaches it)."""
        return id(self)

    def end_program(self, program: str) -> None:
        """The program run `program` (a `Prompt.program` sent without a session) has ended:
        the runtime may forget it. Optional."""
        return None

    def shutdown(self) -> None:
        """Release what the backend owns (processes it started, connections)."""
        return None

    # ---- SGLang's backend surface -------------------------------------------------------
    @property
    def endpoint(self) -> Backend:
        """What requests go to. SGLang code unwraps `backend.endpoint` (a `Runtime`'s
        server); a backend is its own endpoint."""
        return self

    def get_model_name(self) -> str:
        """The model this backend serves (a path for braid's own runtime)."""
        raise NotImplementedError

    def flush_cache(self) -> bool:
        """Empty the runtime's prefix cache; whether it did (False where it cannot)."""
        return False

    def get_server_info(self) -> dict[str, Any] | None:
        """The runtime's state and counters, where the backend can read them."""
        return None


def max_tokens_of(sampling: SamplingArgs) -> int:
    return DEFAULT_MAX_TOKENS if sampling.max_tokens is None else sampling.max_tokens


# SamplingArgs fields that say what to report, not how to sample.
_REPORTING = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def runtime_sampling(sampling: SamplingArgs) -> dict[str, Any]:
    """SamplingArgs as braid runtime `SamplingParams` fields (also /generate's names)."""
    fields = sampling.given()
    for name in _REPORTING:
        fields.pop(name, None)
    fields["max_tokens"] = max_tokens_of(sampling)
    if sampling.return_logprob:
        top = sampling.top_logprobs_num or 0
        fields["logprobs"] = top
        if sampling.logprob_start_len is not None and sampling.logprob_start_len >= 0:
            fields["prompt_logprobs"] = top
            fields["logprob_start_len"] = sampling.logprob_start_len
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


def unconditional_tokens(alone: list[list[Any]], n: int) -> list[list[Any]]:
    """A choice's tokens scored alone, aligned to its `n` scored tokens in context: `alone`
    holds `[logprob, token_id, text]` for every token of the choice tokenized by itself (the
    first has no context: logprob None); the last `n` are kept, padded in front with entries
    of logprob None."""
    padded = [logprob_entry(None, None, None)] * n + list(alone)
    return padded[-n:]
