"""OpenAI's text completions: `POST /v1/completions`."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import FastAPI, Request

from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import (
    check_model,
    json_body,
    tokenize_prompts,
    validate_prompts,
)
from braid.runtime.server.openai_types import Completion, CompletionChoice, CompletionChunk
from braid.runtime.server.openapi import answers, takes
from braid.runtime.server.outputs import Choice, text_of
from braid.runtime.server.protocol import CompletionRequest
from braid.runtime.server.serving_beam import beam_params, beam_response
from braid.runtime.server.serving_openai import OpenAIResponse
from braid.runtime.server.state import ServerState


def add_routes(app: FastAPI, state: ServerState) -> None:
    def prepare_completion(req: CompletionRequest):
        check_model(state, req.model)
        if req.echo and req.stream:
            raise APIError(400, "echo: not supported with stream=true", "echo")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of: not supported (only best_of equal to n)", "best_of")
        if req.suffix:
            raise APIError(
                400, "suffix: not supported (braid does not fill in the middle)", "suffix"
            )
        prompts = tokenize_prompts(state, req.prompt, add_special_tokens=req.add_special_tokens)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        if max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        if req.echo and max_tokens == 0:
            max_tokens = 1  # echo only: one token is generated and dropped
        params = req.sampling_params(state.defaults, max_tokens=max_tokens, logprobs=req.logprobs)
        params = state.tm.resolve(params)  # bad words tokenized once, here off the event loop
        if req.echo and req.logprobs is not None:
            params = params.replace(prompt_logprobs=req.logprobs)
        for i, (_, ids) in enumerate(prompts):
            # Images come on /v1/chat/completions or /generate, never here.
            state.media.check_no_placeholders(
                ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            )
        if req.echo and params.truncate_prompt_tokens is not None:
            raise APIError(400, "echo: not with truncate_prompt_tokens", "echo")
        if not req.use_beam_search and req.length_penalty != 1:
            raise APIError(400, "length_penalty: only with use_beam_search", "length_penalty")
        has_tokenizer = state.tokenizer is not None
        beam = beam_params(req, params, has_tokenizer) if req.use_beam_search else None
        given = "max_tokens" if req.max_tokens is not None else None  # else 16, cut short
        prompts = validate_prompts(state, prompts, params, "prompt", max_tokens_field=given)
        return prompts, params, beam

    @app.post(
        "/v1/completions",
        openapi_extra=takes(CompletionRequest),
        responses=answers(Completion, streamed=True),
    )
    async def completions(
        request: Request, req: Annotated[CompletionRequest, json_body(CompletionRequest)]
    ):
        prompts, params, beam = await asyncio.to_thread(prepare_completion, req)
        if beam is not None:
            return await beam_response(state, req, prompts, beam, request)
        return await CompletionResponse(state, req, prompts, params).respond(request)


class CompletionResponse(OpenAIResponse):
    body_model = Completion
    chunk_model = CompletionChunk
    id_prefix = "cmpl"
    req: CompletionRequest

    def logprobs(self, c: Choice, offset: int) -> dict[str, Any]:
        return _completion_logprobs(self.state, c, offset)

    def choice(self, i: int, c: Choice, common: dict[str, Any]) -> CompletionChoice:
        if self.req.echo:
            common.update(_echo(self.state, self.req, self.prompts[self.prompt_of[i]], c))
        else:
            common["text"] = c.text
        return CompletionChoice(**common)

    def delta(self, item: dict[str, Any], out: StrOut) -> None:
        item["text"] = out.text


def _completion_logprobs(state: ServerState, c: Choice, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs; `offset` is where this part of the text starts."""
    tokens, token_lps, tops, offsets, pos = [], [], [], [], offset
    for lp in c.logprobs:
        tok = text_of(state, lp.token_id, c.token_texts)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({text_of(state, tid, c.token_texts): v for tid, v in lp.top})
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _echo(
    state: ServerState, req: CompletionRequest, prompt: tuple[str | None, list[int]], c: Choice
) -> dict[str, Any]:
    """A completion choice with the prompt echoed: its text first, and with logprobs, the
    prompt tokens' log-probabilities first (None for the first token). `max_tokens=0` echoes
    the prompt alone."""
    text, ids = prompt
    if text is None:
        text = state.tokenizer.decode(ids) if state.tokenizer is not None else ""
    only = req.max_tokens == 0
    out: dict[str, Any] = {"text": text + ("" if only else c.text)}
    if req.logprobs is None:
        return out
    lps = c.prompt_logprobs or [None] * len(ids)
    tokens, values, tops, offsets, pos = [], [], [], [], 0
    for tid, lp in zip(ids, lps):
        tok = text_of(state, tid, c.token_texts)
        tokens.append(tok)
        values.append(None if lp is None else lp.logprob)
        tops.append(
            None if lp is None else {text_of(state, t, c.token_texts): v for t, v in lp.top}
        )
        offsets.append(pos)
        pos += len(tok)
    if not only:
        gen = _completion_logprobs(state, c, pos)
        tokens += gen["tokens"]
        values += gen["token_logprobs"]
        tops += gen["top_logprobs"]
        offsets += gen["text_offset"]
    out["logprobs"] = {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    if only:
        out["finish_reason"] = "length"
    return out
