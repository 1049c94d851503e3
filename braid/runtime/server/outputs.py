"""From submitted samples to a response, for every generating route: submit all samples or
none, wait for outputs while watching for the client leaving, gather each sample's outputs into
a `Choice` (`SampleOutputs`, with the server's timings), and encode JSON bodies and SSE
events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pydantic_core
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from braid.runtime.ipc.to_scheduler import ImageInput
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.outputs import SampleOutputs
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.scheduler.policies import check_priority
from braid.runtime.server.guard import APIError
from braid.runtime.server.openai_types import ChatCompletionChunk, CompletionChunk, Usage
from braid.runtime.server.state import ServerState

logger = logging.getLogger(__name__)


def count_request(state: ServerState, prompt_tokens: int) -> None:
    """Count a request in /metrics once it is submitted (`submit_all` refuses a bad priority
    or a rid in use first: a refused request is not counted)."""
    state.metrics.requests += 1
    state.metrics.prompt_tokens += prompt_tokens


def submit_all(
    state: ServerState,
    jobs: list[tuple[str, list[int]]],
    params: SamplingParams | list[SamplingParams],
    session_id: str | None = None,
    images: list[list[ImageInput]] | None = None,
    grammar_waits: list[tuple[list[int], int | None]] | None = None,
    session_ttl_s: float | None = None,
    program_position: int | None = None,
    program_id: str | None = None,
    cache_salt: str | None = None,
    group: str | None = None,
    priority: int = 0,
) -> list[AsyncIterator[StrOut]]:
    """Submit `params.n` samples of every (rid, prompt) (`params[i]` for prompt i when a list),
    with `images[i]` the processed images of prompt i and `grammar_waits[i]` what its
    constraint waits for (`GenerateReq`'s `grammar_after`, `grammar_open`): all of them or (on
    an error) none, in one message to the scheduler. `group`: the id the client holds for them
    all (`/abort_request` takes it). `priority`: under the priority schedule policy, lower
    first (`check_priority`: a 400 naming it, before anything is submitted)."""
    check_priority(priority, state.tm.config.schedule_policy)
    with state.tm.together() as rids:
        for i, (rid, ids) in enumerate(jobs):
            rids += state.tm.submit(
                rid,
                ids,
                params[i] if isinstance(params, list) else params,
                session_id=session_id,
                images=images[i] if images else None,
                grammar_wait=grammar_waits[i] if grammar_waits else None,
                session_ttl_s=session_ttl_s,
                program_position=program_position,
                program_id=program_id,
                cache_salt=cache_salt,
                group=group,
                priority=priority,
            )
    return [state.tm.stream(r) for r in rids]


# ---- disconnects, first outputs -------------------------------------------------------------
GONE = object()  # the client disconnected


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, aw: Any) -> Any:
    """`aw`'s result, or `GONE` if the client disconnects first: then `aw` is cancelled, which
    aborts every sample it was waiting on (their KV is freed at once)."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not work.done()
        if gone:  # the client left (or this handler was cancelled): stop the work
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if gone:
        logger.info("client disconnected: aborted %s %s", request.method, request.url.path)
        return GONE
    return work.result()


def _refused(out: StrOut) -> APIError | None:
    """The 400 for an output that says the scheduler refused the request (a grammar that does
    not compile, or does not compile in time)."""
    if out.finish_reason and out.refused is not None and out.error:
        return APIError(400, out.error, out.refused.param)
    return None


async def first_output(
    streams: list[AsyncIterator[StrOut]],
) -> AsyncIterator[tuple[int, StrOut]]:
    """The merged outputs, after waiting for the first: a request the scheduler refuses raises
    its `APIError` here, before any response (or stream) has started."""
    merged = _merge(streams)
    first = await merged.__anext__()
    err = _refused(first[1])
    if err is not None:
        await merged.aclose()
        raise err

    async def outputs() -> AsyncIterator[tuple[int, StrOut]]:
        try:
            yield first
            async for item in merged:
                yield item
        finally:
            await merged.aclose()

    return outputs()


async def _merge(streams: list[AsyncIterator[StrOut]]) -> AsyncIterator[tuple[int, StrOut]]:
    """Interleave several sample streams as their outputs arrive; cancelling the consumer
    cancels (and so aborts) every sample still running."""
    if len(streams) == 1:  # the common case: no pump tasks, no extra queue hop per token
        async with contextlib.aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[StrOut]) -> None:
        try:
            async with contextlib.aclosing(s) as outs:
                async for out in outs:
                    await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is done:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- one sample's outputs -------------------------------------------------------------------
@dataclass
class Choice(SampleOutputs):
    """One sample's outputs so far (`SampleOutputs`) and when its first and latest tokens
    came, gathered by `absorb`."""

    first_at: float | None = None
    last_at: float | None = None


def absorb(state: ServerState, c: Choice, out: StrOut, now: float, t0: float) -> None:
    """Add `out` to `c`, and its timings and counts to the server's metrics."""
    if out.token_ids:
        if c.first_at is None:
            state.metrics.ttft.observe(now - t0)
        elif c.last_at is not None:
            state.metrics.itl.observe((now - c.last_at) / len(out.token_ids))
        c.first_at = c.first_at or now
        c.last_at = now
    c.add(out)
    if out.finish_reason:
        state.metrics.generation_tokens += len(c.token_ids)
        if out.error:
            state.metrics.requests_failed += 1


def finish_of(c: Choice) -> str | None:
    """The finish reason a response reports for `c`."""
    if c.finish_reason == "abort" and c.error:
        return "abort"
    return c.finish_reason


def text_of(state: ServerState, tid: int, texts: dict[int, str]) -> str:
    """Token `tid`'s text: as the detokenizer sent it, else decoded here."""
    if tid in texts:
        return texts[tid]
    return state.tokenizer.decode([tid]) if state.tokenizer is not None else ""


# ---- encoding -------------------------------------------------------------------------------
# orjson: a completion chunk encodes in ~0.6 us against ~12 us with `json` (timeit on the
# 2-core CPU machine, docs/benchmarks.md, Serving at 1024 streams), and at 1024 streams the
# server encodes one per stream per step. Non-ASCII stays UTF-8 (as `ensure_ascii=False`
# did); NaN becomes null.
_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON of `obj`."""
    return orjson.dumps(obj, option=_JSON_OPTIONS)


def dumps(items: list[Any], as_list: bool = False) -> bytes:
    """JSON of `items` (one item, or with `as_list` a list), encoded item by item so that a
    large body lets other threads (and the event loop) run between items."""
    parts = [json_bytes(x) for x in items]
    return b"[" + b",".join(parts) + b"]" if as_list else parts[0]


def encode_listed(body: BaseModel, key: str) -> bytes:
    """JSON of `body` (a response model), with its list under `key` last and encoded item by
    item, so that a large body lets other threads (and the event loop) run between items."""
    head = body.model_dump_json(exclude={key}).encode()
    parts = [pydantic_core.to_json(x) for x in getattr(body, key)]
    return head[:-1] + b',"' + key.encode() + b'":[' + b",".join(parts) + b"]}"


def json_response(body: bytes) -> Response:
    return Response(content=body, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChunkEncoder:
    """SSE events of one streamed response. Its chunks share their leading fields, `head` (a
    chunk model whose choices are left out: id, object, created, model): those are encoded
    once, from the model, and each chunk encodes only its choices, plain data in the shape of
    the chunk model's choices (a token's chunk is one small encode, never a model built and
    validated), and with `include_usage` its usage (null but on the last chunk)."""

    def __init__(self, head: CompletionChunk | ChatCompletionChunk, include_usage: bool) -> None:
        fields = head.model_dump_json(exclude={"choices", "usage"}).encode()
        self.prefix = b"data: " + fields[:-1] + b',"choices":'
        self.include_usage = include_usage

    def chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        if self.include_usage:
            end = b"null" if usage is None else pydantic_core.to_json(usage)
            return self.prefix + json_bytes(choices) + b',"usage":' + end + b"}\n\n"
        return self.prefix + json_bytes(choices) + b"}\n\n"


def event_stream(request: Request, events: AsyncIterator[bytes]) -> StreamingResponse:
    """An SSE response of `events`; a client that leaves before the end is logged (closing
    `events` aborts what it still streams)."""

    async def logged() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for event in events:
                yield event
            finished = True
        finally:
            if not finished:
                logger.info(
                    "client disconnected: aborted %s %s (streaming)",
                    request.method,
                    request.url.path,
                )
            await events.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(logged(), media_type="text/event-stream")
