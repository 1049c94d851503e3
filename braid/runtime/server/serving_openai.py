"""What OpenAI's two completion APIs share: submit every (prompt, sample), then answer with the
whole response or an SSE stream of chunks. `serving_completions` and `serving_chat` say how
their choices read, as subclasses of `OpenAIResponse`."""

from __future__ import annotations

import abc
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import Response

from braid.runtime.function_call.base import ToolCallStream
from braid.runtime.function_call.tools import finish_reason
from braid.runtime.ipc.to_scheduler import ImageInput
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.openai_types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceError,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionTokensDetails,
    PromptTokensDetails,
    Usage,
)
from braid.runtime.server.outputs import (
    GONE,
    SSE_DONE,
    Choice,
    ChunkEncoder,
    absorb,
    count_request,
    encode_listed,
    event_stream,
    finish_of,
    first_output,
    json_response,
    submit_all,
    unless_gone,
)
from braid.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from braid.runtime.server.state import ServerState
from braid.runtime.tokenizer.manager import RuntimeDied


class OpenAIResponse(abc.ABC):
    """One response of an OpenAI completion API, for `prompts` sampled `params.n` times each
    (choice `i` samples prompt `prompt_of[i]`). A subclass names the response's models and
    says how a choice's logprobs, its whole form and its streamed deltas read."""

    body_model: ClassVar[type[Completion] | type[ChatCompletion]]  # the whole response
    chunk_model: ClassVar[type[CompletionChunk] | type[ChatCompletionChunk]]  # a stream chunk
    id_prefix: ClassVar[str]

    def __init__(
        self,
        state: ServerState,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        images: list[list[ImageInput]] | None = None,
    ) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.params = params
        self.images = images  # per prompt, processed (chat with image parts)
        self.prompt_of = [i for i in range(len(prompts)) for _ in range(params.n)]
        self.choices: list[Choice] = []

    # ---- what a subclass says -------------------------------------------------------------
    @abc.abstractmethod
    def logprobs(self, c: Choice, offset: int) -> dict[str, Any]:
        """`c`'s logprobs (logprobs were asked for), as plain data in the shape of the models'
        `logprobs`; `offset` is where `c`'s text starts in its choice's text (a stream sends a
        choice in parts)."""

    @abc.abstractmethod
    def choice(self, i: int, c: Choice, common: dict[str, Any]) -> CompletionChoice | ChatChoice:
        """Choice `i` of the whole response: the fields in `common` (index, finish_reason,
        logprobs, and stop_reason and error where they apply) with the choice's text or message
        (which may replace the finish reason and logprobs)."""

    @abc.abstractmethod
    def delta(self, item: dict[str, Any], out: StrOut) -> None:
        """Put the text of `out` into `item`, a stream chunk's choice."""

    def opening(self) -> list[dict[str, Any]] | None:
        """The choices of a chunk sent before any output, or None for no such chunk."""
        return None

    def tool_streams(self) -> list[ToolCallStream] | None:
        """One tool-call parser per choice when a stream's outputs become tool-call deltas;
        None when they are text."""
        return None

    def grammar_waits(self) -> list[tuple[list[int], int | None]] | None:
        """Per prompt, what its constraint waits for before it applies (a reasoning model's
        end of thinking; see `submit_all`); None: constraints apply from the first token."""
        return None

    # ---- the response ---------------------------------------------------------------------
    async def respond(self, request: Request) -> Response:
        """Submit every sample and answer: the whole response, or with `stream` its SSE
        chunks; a 499 if the client leaves before the answer starts."""
        state, params = self.state, self.params
        self.rid = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        streams = submit_all(
            state,
            [(f"{self.rid}-{i}", ids) for i, (_, ids) in enumerate(self.prompts)],
            params,
            images=self.images,
            grammar_waits=self.grammar_waits(),
            cache_salt=self.req.cache_salt,
            group=self.rid,
            priority=self.req.priority,
        )
        count_request(state, sum(len(ids) for _, ids in self.prompts))
        self.prompt_choice = [i * params.n for i in range(len(self.prompts))]
        self.choices = [Choice() for _ in streams]
        if not self.req.stream:
            return await self._whole(request, streams)
        return await self._stream(request, streams)

    def _logprobs_of(self, c: Choice, offset: int = 0) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        return self.logprobs(c, offset)

    async def _whole(self, request: Request, streams: list[AsyncIterator[StrOut]]) -> Response:
        state, choices = self.state, self.choices

        async def collect() -> None:
            async for i, out in await first_output(streams):
                absorb(state, choices[i], out, time.perf_counter(), self.t0)

        if await unless_gone(request, collect()) is GONE:
            return Response(status_code=499)
        failed = [c.error for c in choices if c.error]
        if failed and state.tm.failure:
            raise RuntimeDied(state.tm.failure)

        def build() -> bytes:  # a worker thread's job: long logprob lists take a while
            body_choices = []
            for i, c in enumerate(choices):
                common: dict[str, Any] = {
                    "index": i,
                    "finish_reason": finish_of(c),
                    "logprobs": self._logprobs_of(c),
                }
                if c.stop_reason is not None:
                    common["stop_reason"] = c.stop_reason
                if c.error:  # it failed after it started: the reason, finish_reason "abort"
                    common["error"] = ChoiceError(message=c.error, type="server_error")
                body_choices.append(self.choice(i, c, common))
            body = self.body_model(
                id=self.rid,
                created=self.created,
                model=state.served_model_name,
                choices=body_choices,
                usage=_usage(choices, self.prompt_choice),
            )
            return encode_listed(body, "choices")

        return json_response(await asyncio.to_thread(build))

    async def _stream(self, request: Request, streams: list[AsyncIterator[StrOut]]) -> Response:
        state, choices, req = self.state, self.choices, self.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def usage_now() -> Usage | None:
            return _usage(choices, self.prompt_choice) if continuous else None

        head = self.chunk_model(
            id=self.rid, created=self.created, model=state.served_model_name, choices=[]
        )
        chunk = ChunkEncoder(head, include_usage).chunk

        outs = await unless_gone(request, first_output(streams))
        if outs is GONE:
            return Response(status_code=499)

        async def events():
            opening = self.opening()
            if opening is not None:
                yield chunk(opening)
            sent_logprobs = [0] * len(choices)  # logprobs already streamed, per choice
            sent_text = [0] * len(choices)
            calls = self.tool_streams()
            async for i, out in outs:
                c = choices[i]
                absorb(state, c, out, time.perf_counter(), self.t0)
                deltas = _tool_deltas(calls[i], out) if calls is not None else None
                if (not out.text if deltas is None else not deltas) and not out.finish_reason:
                    continue  # held-back text: its tokens' logprobs go with the next chunk
                delta_c = Choice(logprobs=c.logprobs[sent_logprobs[i] :], token_texts=c.token_texts)
                sent_logprobs[i] = len(c.logprobs)
                lp = self._logprobs_of(delta_c, sent_text[i])
                sent_text[i] = len(c.text)
                item: dict[str, Any] = {
                    "index": i,
                    "logprobs": lp,
                    "finish_reason": finish_of(c) if out.finish_reason else None,
                }
                if out.error:  # the stream's last chunk says why it failed
                    item["error"] = {"message": out.error, "type": "server_error"}
                # The last chunk's stop_reason, as a whole response's choice has it.
                ends: dict[str, Any] = {}
                if out.finish_reason and c.stop_reason is not None:
                    ends = {"stop_reason": c.stop_reason}
                item.update(ends)
                if deltas is not None and calls is not None:
                    # One chunk per delta: logprobs on the first, the finish reason on the last.
                    finish = finish_reason(item["finish_reason"], calls[i].num_calls)
                    for k, d in enumerate(deltas or [{}]):
                        last = k == max(len(deltas), 1) - 1
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "logprobs": lp if k == 0 else None,
                                    "finish_reason": finish if last else None,
                                    "delta": d,
                                    **(ends if last else {}),
                                }
                            ],
                            usage_now(),
                        )
                    continue
                self.delta(item, out)
                yield chunk([item], usage_now())
            if include_usage:
                yield chunk([], _usage(choices, self.prompt_choice))
            yield SSE_DONE

        return event_stream(request, events())


def _usage(choices: list[Choice], prompt_choice: list[int]) -> Usage:
    prompt = sum(choices[i].prompt_tokens for i in prompt_choice)
    cached = sum(choices[i].cached_tokens for i in prompt_choice)
    completion = sum(len(c.token_ids) for c in choices)
    usage = Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
    specs = [c.spec for c in choices if c.spec is not None]
    if specs:
        # Speculative decoding, in OpenAI's fields for predicted tokens: drafts kept and not.
        accepted = sum(s.accepted_drafts for s in specs)
        rejected = sum(s.proposed_drafts - s.accepted_drafts for s in specs)
        usage.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected
        )
    return usage


def _tool_deltas(ts: ToolCallStream, out: StrOut) -> list[dict[str, Any]]:
    deltas = ts.feed(out.text) if out.text else []
    if out.finish_reason:
        deltas += ts.finish()
    return [d.to_openai() for d in deltas]
