"""Beam search on `/v1/completions` and `/v1/chat/completions` (vLLM's `use_beam_search`):
`n` beams per prompt, run as `braid.runtime.beam_search.BeamSearch` steps through the
scheduler (each step submits one token of every live beam with its top `2 x n` logprobs,
over the prefix cache), answered with the `n` best beams of each prompt as its choices, best
first. Whole responses only."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from braid.runtime.beam_search import BeamSearch, BeamSearchParams
from braid.runtime.errors import ParamError
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.outputs import PositionLogprobs, logprob_dict
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.policies import check_priority
from braid.runtime.server.guard import APIError
from braid.runtime.server.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    Usage,
)
from braid.runtime.server.outputs import (
    GONE,
    count_request,
    encode_listed,
    json_response,
    submit_all,
    unless_gone,
)
from braid.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from braid.runtime.server.state import ServerState
from braid.runtime.tokenizer.manager import RuntimeDied

# What a completions body may ask for that beam search cannot honour: it ranks beams by the
# model's own probabilities and ends them only at EOS or max_tokens.
_NOT_WITH_BEAMS = (
    "stream",
    "echo",
    "logprobs",
    "tools",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
# Their values that ask for nothing.
_INERT_VALUES = {
    "stream": False,
    "echo": False,
    "min_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def beam_params(
    req: CompletionRequest | ChatCompletionRequest,
    params: SamplingParams,
    has_tokenizer: bool,
    max_tokens: int | None = None,
) -> BeamSearchParams:
    """The beam search `req` asks for (`n` beams, `max_tokens` if given, else its params'); a
    400 naming a field beam search cannot honour, or an output constraint."""
    if not has_tokenizer:
        raise APIError(
            400,
            "use_beam_search: this model has no tokenizer to write the beams' text",
            "use_beam_search",
        )
    for name in _NOT_WITH_BEAMS:
        value = getattr(req, name, None)
        # `is False`: a 0 (`logprobs: 0`) asks for something, though 0 == False in Python.
        if value is None or value is False or value in ([], {}):
            continue
        if value == _INERT_VALUES.get(name):
            continue
        raise APIError(400, f"{name}: not with use_beam_search", name)
    if req.constraint_fields():
        raise APIError(400, "use_beam_search: not with an output constraint", "use_beam_search")
    beam = BeamSearchParams(
        beam_width=req.n,
        max_tokens=params.max_tokens if max_tokens is None else max_tokens,
        ignore_eos=req.ignore_eos,
        temperature=params.temperature,
        length_penalty=req.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    try:
        beam.check()
    except ParamError as e:
        name = {"beam_width": "n"}.get(e.param or "", e.param)
        raise APIError(400, str(e).replace(str(e.param), name, 1), name) from None
    return beam


async def beam_response(
    state: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    beam: BeamSearchParams,
    request: Request,
) -> Response:
    """Run the search and answer with a completion, or for a chat request a chat completion
    whose messages hold the beams' text."""
    chat = isinstance(req, ChatCompletionRequest)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    check_priority(req.priority, state.tm.config.schedule_policy)  # before it is counted
    count_request(state, sum(len(ids) for _, ids in prompts))
    search = BeamSearch(
        [ids for _, ids in prompts], beam, state.tm.eos_token_ids, state.tm.ready.context_length
    )
    step = search.step_params()

    async def run() -> None:
        while (batch := search.batch()) is not None:
            jobs = [(f"{rid}-{search.steps}-{j}", ids) for j, (_, ids) in enumerate(batch)]
            streams = submit_all(
                state, jobs, step, cache_salt=req.cache_salt, group=rid, priority=req.priority
            )
            try:
                got = await asyncio.gather(
                    *(_candidates(state, s) for s in streams), return_exceptions=True
                )
            finally:
                for r, _ in jobs:  # a stream never read (the client left first) is aborted
                    state.tm.cancel(r)
            failed = [g for g in got if isinstance(g, BaseException)]
            if failed:
                raise failed[0]
            if any(g is None for g in got):  # aborted (/abort_request, shutdown)
                search.abort()
                return
            search.advance(got)

    if await unless_gone(request, run()) is GONE:
        return Response(status_code=499)
    choices, completion = [], 0
    for p, out in enumerate(search.results(None)):
        start = search.prompt_lens[p]
        for b in out.sequences:
            new = search.kept(b)[start:]
            completion += len(b.tokens) - start
            skip = req.skip_special_tokens
            text = state.tokenizer.decode(new, skip_special_tokens=skip) if state.tokenizer else ""
            common = {"index": len(choices), "finish_reason": b.finish_reason, "logprobs": None}
            if chat:
                choices.append(ChatChoice(message=AssistantMessage(content=text), **common))
            else:
                choices.append(CompletionChoice(text=text, **common))
    state.metrics.generation_tokens += completion
    prompt = sum(search.prompt_lens)
    body = (ChatCompletion if chat else Completion)(
        id=rid,
        created=created,
        model=state.served_model_name,
        choices=choices,
        usage=Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
        ),
    )
    return json_response(encode_listed(body, "choices"))


async def _candidates(state: ServerState, stream: AsyncIterator[StrOut]) -> PositionLogprobs | None:
    """The scored next tokens of one beam's step: the chosen one and its top alternatives;
    None if the step was aborted."""
    scored = []
    async for out in stream:
        if out.refused is not None and out.error:
            raise APIError(400, out.error, out.refused.param)
        if out.error:
            if state.tm.failure:
                raise RuntimeDied(state.tm.failure)
            raise APIError(500, f"beam search failed: {out.error}", kind="server_error")
        if out.finish_reason == "abort":
            return None
        scored += out.logprobs or []
    if not scored:
        return None
    return logprob_dict(scored[0], None)
