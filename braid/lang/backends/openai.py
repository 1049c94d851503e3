"""`OpenAI`: programs on any OpenAI-compatible server (OpenAI itself, vLLM, `braid serve`).

A program that uses roles talks to `/v1/chat/completions` with its messages (a gen must then
open an assistant turn); one without roles talks to `/v1/completions` with its text. `select`
needs prompt log-probabilities (`/v1/completions` with `echo` and `logprobs`); a server that
does not give them gets a clear error. Sampling arguments OpenAI does not define (`top_k`,
`min_p`, `ignore_eos`, `regex`, `json_schema`) go in the request body as extras."""

from __future__ import annotations

from typing import Any

from braid.lang.backends.base import (
    Backend,
    ChoiceScores,
    GenOutput,
    OnDelta,
    Prompt,
    max_tokens_of,
    unconditional_scores,
)
from braid.lang.ir import SamplingArgs
from braid.runtime.tokenizer.roles import RoleTemplate

_OPENAI_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "stop")
_EXTRA_FIELDS = ("top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids")


class OpenAI(Backend):
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None) -> None:
        try:
            import openai
        except ImportError:
            raise ValueError(
                "the OpenAI backend needs the `openai` package: pip install openai"
            ) from None
        import os

        self.model = model
        self._openai = openai
        self.client = openai.OpenAI(
            base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        )
        self._roles = RoleTemplate.plain()

    @property
    def role_template(self) -> RoleTemplate:
        return self._roles

    def _kwargs(self, sampling: SamplingArgs, constraint) -> dict[str, Any]:
        given = sampling.given()
        kw: dict[str, Any] = {"max_tokens": max_tokens_of(sampling)}
        kw.update({k: given[k] for k in _OPENAI_FIELDS if k in given})
        extra = {k: given[k] for k in _EXTRA_FIELDS if k in given}
        if constraint is not None:
            extra[constraint[0]] = constraint[1]
        if extra:
            kw["extra_body"] = extra
        if sampling.return_logprob:
            kw["logprobs"] = True
        return kw

    def _call(self, fn, **kw):
        try:
            return fn(**kw)
        except self._openai.BadRequestError as e:
            raise ValueError(f"OpenAI backend ({self.client.base_url}): {e.message}") from None
        except self._openai.APIConnectionError as e:
            raise RuntimeError(
                f"OpenAI backend: cannot reach {self.client.base_url}: {e}"
            ) from None

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingArgs,
        constraint: tuple[str, Any] | None = None,
        on_delta: OnDelta | None = None,
    ) -> GenOutput:
        if prompt.images:
            raise ValueError("image(): the OpenAI backend sends text only in this version")
        kw = self._kwargs(sampling, constraint)
        chat = bool(prompt.messages) or prompt.open_role is not None
        if chat:
            if prompt.open_role != "assistant" or prompt.open_content:
                raise ValueError(
                    "OpenAI backend: with roles, a gen must come first inside an assistant turn "
                    "(`with s.assistant(): s += gen(...)`)"
                )
            if sampling.return_logprob:
                kw["logprobs"] = True
            stream = self._call(
                self.client.chat.completions.create,
                model=self.model,
                messages=prompt.messages,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        else:
            if sampling.return_logprob:
                kw["logprobs"] = 0
            stream = self._call(
                self.client.completions.create,
                model=self.model,
                prompt=prompt.text,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        text, meta = "", {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        for chunk in stream:
            if chunk.usage is not None:
                meta["prompt_tokens"] = chunk.usage.prompt_tokens
                meta["completion_tokens"] = chunk.usage.completion_tokens
            for choice in chunk.choices:
                piece = (choice.delta.content if chat else choice.text) or ""
                text += piece
                if choice.finish_reason:
                    meta["finish_reason"] = choice.finish_reason
                if piece and on_delta is not None:
                    on_delta(piece, dict(meta))
        return GenOutput(text, meta)

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        if prompt.messages or prompt.open_role is not None:
            raise ValueError(
                "OpenAI backend: select needs prompt log-probabilities, which chat completions "
                "do not return; use select outside roles, or the Engine / RuntimeEndpoint backend"
            )
        cond = [self._echo_scores(prompt.text, c) for c in choices]
        unc = None
        if unconditional:
            unc = [
                unconditional_scores(self._echo_scores("", c, whole=True)[1:], len(lps))
                for c, lps in zip(choices, cond)
            ]
        return ChoiceScores(cond, unc)

    def _echo_scores(self, prefix: str, choice: str, whole: bool = False) -> list[float]:
        out = self._call(
            self.client.completions.create,
            model=self.model,
            prompt=prefix + choice,
            max_tokens=0,
            echo=True,
            logprobs=0,
        )
        lp = out.choices[0].logprobs
        if lp is None or not lp.token_logprobs:
            raise ValueError(
                f"OpenAI backend: {self.client.base_url} returned no prompt log-probabilities "
                "(completions with echo and logprobs); select needs them"
            )
        if whole:
            return [x or 0.0 for x in lp.token_logprobs]
        # Tokens that start inside the choice (a token spanning the boundary counts as the
        # choice's).
        scores = [
            x
            for x, off, tok in zip(lp.token_logprobs, lp.text_offset, lp.tokens)
            if off + len(tok) > len(prefix) and x is not None
        ]
        if not scores:
            raise ValueError(f"select: choice {choice!r} added no scored tokens")
        return scores
