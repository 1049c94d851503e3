"""`OpenAI`: programs on any OpenAI-compatible server (OpenAI itself, vLLM, `braid serve`).

A program that uses roles talks to `/v1/chat/completions` with its messages (a gen must then
open an assistant turn); one without roles talks to `/v1/completions` with its text. `select`
and `logprob_start_len` need prompt log-probabilities (`/v1/completions` with `echo` and
`logprobs`); a server that does not give them gets a clear error. Sampling arguments OpenAI
does not define (`top_k`, `min_p`, `ignore_eos`, `stop_regex`, `regex`, `json_schema`) go in
the request body as extras. An `ebnf` constraint goes only to a server with SGLang's native API
(`braid serve`, SGLang: it answers `/get_model_info`); for any other a gen with one is a clear
`ValueError`, since such a server would ignore the unknown field and answer with free text.
OpenAI's wire format has no token ids: logprob entries carry None there.

Images (`image()`) go where they stand in the messages, as `image_url` content parts (a file,
bytes or a PIL image as a base64 `data:` URL, an http(s) URL as it is), so a program runs
against any OpenAI-compatible vision-language server; a message without images keeps its
plain string content. `/v1/completions` takes no images: they must be inside roles."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from braid.lang.backends.base import (
    Backend,
    ChoiceScores,
    GenOutput,
    OnDelta,
    Prompt,
    logprob_entry,
    max_tokens_of,
    unconditional_tokens,
)
from braid.lang.images import to_data_url
from braid.lang.ir import SamplingArgs
from braid.runtime.outputs import finish_reason_info
from braid.runtime.tokenizer.roles import RoleTemplate

_OPENAI_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "seed",
)
_EXTRA_FIELDS = ("top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "stop_regex")
# Constraint kinds only servers with SGLang's native API take (vLLM would drop the field).
_SGLANG_CONSTRAINTS = ("ebnf",)
# Where an image stands in the program's text and messages until they are sent. The server's
# model has its own placeholder, unknown here; this one only has to be unlike any real text.
IMAGE_PLACEHOLDER = "<|braid_image|>"


def chat_messages(
    messages: list[dict[str, Any]], images: list[Any], placeholder: str = IMAGE_PLACEHOLDER
) -> list[dict[str, Any]]:
    """`messages` as a chat completions request sends them: a content that holds image
    placeholders becomes a list of `text` and `image_url` parts in the order they stand, the
    images taken from `images` in turn; other messages are unchanged. `ValueError` if the
    placeholders in the messages are not as many as the images (an image outside any role:
    chat messages cannot carry it), or an image cannot be encoded."""
    found = sum(m["content"].count(placeholder) for m in messages if isinstance(m["content"], str))
    if found != len(images):
        raise ValueError(
            f"OpenAI backend: the messages hold {found} of the prompt's {len(images)} images; "
            "images go to the server inside role messages only "
            "(`s += user(image(...) + '...')`)"
        )
    urls = iter([to_data_url(x) for x in images])
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or placeholder not in content:
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for k, piece in enumerate(content.split(placeholder)):
            if k:
                parts.append({"type": "image_url", "image_url": {"url": next(urls)}})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    return out


_COMPLETIONS_IMAGES = (
    "OpenAI backend: /v1/completions takes text only; put image() inside a role "
    "(`s += user(image(...) + '...')`) to send it through chat completions"
)


class OpenAI(Backend):
    # Whether the model takes images is the server's to say: it answers a request with images
    # it cannot serve with an error.
    supports_images = True

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None) -> None:
        try:
            import openai
        except ImportError:
            raise ValueError(
                "the OpenAI backend needs the `openai` package: pip install openai"
            ) from None

        self.model = model
        self._openai = openai
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=self._api_key)
        self._roles = RoleTemplate.plain()
        self._sglang_api: bool | None = None  # whether the server answers /get_model_info

    @property
    def role_template(self) -> RoleTemplate:
        return self._roles

    @property
    def image_placeholder(self) -> str:
        return IMAGE_PLACEHOLDER

    def get_model_name(self) -> str:
        return self.model

    def _check_constraint(self, constraint: tuple[str, Any] | None) -> None:
        if constraint is None or constraint[0] not in _SGLANG_CONSTRAINTS:
            return
        if self._sglang_api is None:
            self._sglang_api = self._answers_model_info()
        if not self._sglang_api:
            kind = constraint[0]
            raise ValueError(
                f"OpenAI backend: gen({kind}=...) needs a server that takes SGLang's `{kind}` "
                f"field (braid serve, SGLang); {self.client.base_url} does not answer "
                "/get_model_info. Use the Engine or RuntimeEndpoint backend, or a regex or "
                "json_schema constraint"
            )

    def _answers_model_info(self) -> bool:
        import httpx

        root = str(self.client.base_url).rstrip("/").removesuffix("/v1")
        try:
            r = httpx.get(
                f"{root}/get_model_info",
                headers={"Authorization": f"Bearer {self._api_key}"},
                timeout=10,
            )
            return r.status_code == 200 and "model_path" in r.json()
        except (httpx.HTTPError, ValueError):
            return False

    def _kwargs(self, sampling: SamplingArgs, constraint) -> dict[str, Any]:
        self._check_constraint(constraint)
        given = sampling.given()
        kw: dict[str, Any] = {"max_tokens": max_tokens_of(sampling)}
        kw.update({k: given[k] for k in _OPENAI_FIELDS if k in given})
        extra = {k: given[k] for k in _EXTRA_FIELDS if k in given}
        if constraint is not None:
            extra[constraint[0]] = constraint[1]
        if extra:
            kw["extra_body"] = extra
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
        kw = self._kwargs(sampling, constraint)
        chat = bool(prompt.messages) or prompt.open_role is not None
        top = sampling.top_logprobs_num or 0
        wants_input = sampling.return_logprob and sampling.logprob_start_len is not None
        if kw["max_tokens"] == 0:
            stream = []  # nothing to generate (OpenAI refuses max_tokens=0): no call
        elif chat:
            if prompt.loose_text is not None:
                raise ValueError(
                    "OpenAI backend: a chat sends only its role messages, and this program wrote "
                    f"{prompt.loose_text} outside any role; put it in a role "
                    "(`s += system(...)`) or write the program without roles"
                )
            messages = chat_messages(prompt.messages, prompt.images)
            if prompt.open_role != "assistant" or prompt.open_content:
                raise ValueError(
                    "OpenAI backend: with roles, a gen must come first inside an assistant turn "
                    "(`with s.assistant(): s += gen(...)`)"
                )
            if wants_input:
                raise ValueError(
                    "OpenAI backend: logprob_start_len needs prompt log-probabilities, which "
                    "chat completions do not return; use it outside roles"
                )
            if sampling.return_logprob:
                kw["logprobs"] = True
                if top:
                    kw["top_logprobs"] = top
            stream = self._call(
                self.client.chat.completions.create,
                model=self.model,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        else:
            if prompt.images:
                raise ValueError(_COMPLETIONS_IMAGES)
            if sampling.return_logprob:
                kw["logprobs"] = top
            stream = self._call(
                self.client.completions.create,
                model=self.model,
                prompt=prompt.text,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        n = kw.get("n", 1)
        t0 = time.perf_counter()
        texts = [""] * n
        metas = [self._new_meta(sampling) for _ in range(n)]
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                i = choice.index
                failed = getattr(choice, "error", None)  # braid's server says why a stream ended
                if failed:
                    why = failed.get("message") if isinstance(failed, dict) else failed
                    raise RuntimeError(f"generation failed: {why}")
                piece = (choice.delta.content if chat else choice.text) or ""
                texts[i] += piece
                if sampling.return_logprob and choice.logprobs is not None:
                    self._absorb_logprobs(metas[i], choice.logprobs, chat, top)
                if choice.finish_reason:
                    metas[i]["finish_reason"] = finish_reason_info(
                        choice.finish_reason,
                        getattr(choice, "stop_reason", None),  # vLLM's: the stop that matched
                        len(metas[i].get("output_token_logprobs", [])),
                    )
                if piece and i == 0 and on_delta is not None:
                    on_delta(piece, dict(metas[0]))
        for meta in metas:
            meta["e2e_latency"] = time.perf_counter() - t0
            if meta["finish_reason"] is None:
                meta["finish_reason"] = finish_reason_info("length", None, 0)
            if usage is not None:
                meta["prompt_tokens"] = usage.prompt_tokens
                meta["completion_tokens"] = usage.completion_tokens // n
                meta["cached_tokens"] = _cached_tokens(usage)
            finish = meta["finish_reason"]
            if finish["type"] == "length" and not finish["length"]:
                # The tokens it was cut off at (counted above only from logprobs).
                finish["length"] = meta["completion_tokens"]
        if wants_input:
            entries = self._echo_entries(prompt.text, max(0, sampling.logprob_start_len), top)
            for meta in metas:
                meta["input_token_logprobs"] = entries[0]
                if top:
                    meta["input_top_logprobs"] = entries[1]
        return GenOutput(texts[0], metas[0], texts if n > 1 else None)

    @staticmethod
    def _new_meta(sampling: SamplingArgs) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": f"openai-{uuid.uuid4().hex[:12]}",
            "finish_reason": None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
        }
        if sampling.return_logprob:
            meta["output_token_logprobs"] = []
            if sampling.top_logprobs_num:
                meta["output_top_logprobs"] = []
        return meta

    @staticmethod
    def _absorb_logprobs(meta: dict[str, Any], lp, chat: bool, top: int) -> None:
        if chat:
            for item in lp.content or []:
                meta["output_token_logprobs"].append(logprob_entry(item.logprob, None, item.token))
                if top:
                    meta["output_top_logprobs"].append(
                        [logprob_entry(t.logprob, None, t.token) for t in item.top_logprobs or []]
                    )
            return
        for k, (tok, value) in enumerate(zip(lp.tokens or [], lp.token_logprobs or [])):
            meta["output_token_logprobs"].append(logprob_entry(value, None, tok))
            if top:
                alts = (lp.top_logprobs or [{}] * (k + 1))[k] or {}
                meta["output_top_logprobs"].append(
                    [logprob_entry(v, None, t) for t, v in alts.items()]
                )

    def _echo(self, texts: list[str], top: int = 0) -> list:
        """The prompt logprobs of each text (one completions request with all of them)."""
        out = self._call(
            self.client.completions.create,
            model=self.model,
            prompt=texts,
            max_tokens=0,
            echo=True,
            logprobs=top,
        )
        by_index = sorted(out.choices, key=lambda c: c.index)
        lps = [c.logprobs for c in by_index]
        if len(lps) != len(texts) or any(lp is None or not lp.token_logprobs for lp in lps):
            raise ValueError(
                f"OpenAI backend: {self.client.base_url} returned no prompt log-probabilities "
                "(completions with echo and logprobs); select and logprob_start_len need them"
            )
        return lps

    def _echo_entries(self, text: str, start: int, top: int) -> tuple[list, list]:
        """The prompt's `[logprob, None, token]` entries from token `start` on, and their top
        alternatives."""
        lp = self._echo([text], top)[0]
        entries = [logprob_entry(v, None, t) for t, v in zip(lp.tokens, lp.token_logprobs)]
        tops = [
            None if alts is None else [logprob_entry(v, None, t) for t, v in alts.items()]
            for alts in (lp.top_logprobs or [None] * len(entries))
        ]
        return entries[start:], tops[start:]

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        if prompt.messages or prompt.open_role is not None:
            raise ValueError(
                "OpenAI backend: select needs prompt log-probabilities, which chat completions "
                "do not return; use select outside roles, or the Engine / RuntimeEndpoint backend"
            )
        if prompt.images:
            raise ValueError(_COMPLETIONS_IMAGES)
        texts = [prompt.text + c for c in choices]
        if unconditional:
            texts += list(choices)
        lps = self._echo(texts)
        tokens = [self._choice_entries(lp, prompt.text, c) for lp, c in zip(lps, choices)]
        unc = None
        if unconditional:
            unc = []
            for lp, toks in zip(lps[len(choices) :], tokens):
                alone = [logprob_entry(v, None, t) for t, v in zip(lp.tokens, lp.token_logprobs)]
                unc.append(unconditional_tokens(alone, len(toks)))
        return ChoiceScores(tokens, unc)

    @staticmethod
    def _choice_entries(lp, prefix: str, choice: str) -> list[list[Any]]:
        # Tokens that end inside the choice (a token spanning the boundary counts as the
        # choice's).
        entries = [
            logprob_entry(x, None, tok)
            for x, off, tok in zip(lp.token_logprobs, lp.text_offset, lp.tokens)
            if off + len(tok) > len(prefix) and x is not None
        ]
        if not entries:
            raise ValueError(f"select: choice {choice!r} added no scored tokens")
        return entries


def _cached_tokens(usage: Any) -> int:
    """`usage.prompt_tokens_details.cached_tokens`, 0 where the server or an older `openai`
    client has no such field (older clients keep it as a plain dict, if at all)."""
    details = getattr(usage, "prompt_tokens_details", None)
    if isinstance(details, dict):
        return details.get("cached_tokens") or 0
    return getattr(details, "cached_tokens", None) or 0
