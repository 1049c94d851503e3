"""The HTTP server: OpenAI-compatible and native endpoints over one `TokenizerManager`.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a
4xx status that names the problem; a failure inside the runtime is a 500 only when the runtime
itself died (then the server exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from braid.runtime.function_call.base import ToolCallStream
from braid.runtime.function_call.tools import ToolPlan, finish_reason
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.outputs import finish_reason_info
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.guard import (
    MAX_BODY_BYTES,
    APIError,
    Guard,
    GuardConfig,
    error_response,
)
from braid.runtime.server.metrics import ServerMetrics
from braid.runtime.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CloseSessionRequest,
    CompletionRequest,
    GenerateRequest,
    TokenizeRequest,
    native_sampling_params,
)
from braid.runtime.tokenizer.manager import RuntimeDied, TokenizerManager
from braid.runtime.tokenizer.roles import RoleTemplate, role_template
from braid.runtime.tokenizer.template_sandbox import TemplateSandbox
from braid.runtime.tokenizer.tokenizer import render_chat

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    tm: TokenizerManager
    tokenizer: Any
    served_model_name: str
    model_path: str
    defaults: SamplingParams
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    server_args: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None  # the format parser for tool_choice "auto"
    strict_model_name: bool = False  # 404 for a model name that is not the served one
    bind_host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_samples: int = 128  # samples one request may ask for (n x prompts)
    # A request's own chat_template: refused unless allowed; then rendered in a sandbox process.
    allow_request_chat_template: bool = False
    template_sandbox: TemplateSandbox | None = None
    # /health fails when the scheduler sends no heartbeat for this long, or is in one step
    # for longer than health_stuck_s.
    health_silent_s: float = 10.0
    health_stuck_s: float = 120.0

    @functools.cached_property
    def role_template(self) -> RoleTemplate:
        """The chat template's role boundaries, for language clients (RuntimeEndpoint)."""
        return role_template(self.tokenizer)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the context, whatever it says: every token spells
        at most the longest vocabulary entry (twice that, for normalisers that shrink text).
        Such a prompt is refused without being tokenized (10 MB takes the tokenizer ~10 s)."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * max(longest, 1) * self.tm.ready.context_length


# ---- helpers ------------------------------------------------------------------------------
def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return head if head.replace("_", "").isalnum() else None


def _check_model(state: ServerState, model: str | None) -> None:
    """As SGLang does, a server serves its one model whatever name a request gives (empty,
    another alias, a path): clients written for another server work unchanged. With
    `--strict-model-name`, any name but the served name (or the model path) is a 404."""
    if not state.strict_model_name or model is None:
        return
    if model not in (state.served_model_name, state.model_path):
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.served_model_name!r}",
            "model",
            "model_not_found",
        )


def _encode(
    state: ServerState, text: str, where: str, add_special_tokens: bool = True
) -> list[int]:
    """`text`'s token ids; a text that cannot fit the context is refused before tokenizing."""
    if len(text) > state.max_prompt_chars:
        raise APIError(
            400,
            f"{where}: {len(text)} characters is longer than the context length allows "
            f"({state.tm.ready.context_length} tokens)",
            where.split(" ")[0],
        )
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _tokenize_prompts(
    state: ServerState, prompt: Any, where: str = "prompt"
) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, f"{where}: must not be empty", where)
    if len(prompt) > state.max_samples:
        raise APIError(
            400,
            f"{where}: {len(prompt)} prompts is more than this server takes in one request "
            f"({state.max_samples}; --max-samples-per-request)",
            where,
        )
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"{where}: must not be empty", where)
            if state.tokenizer is None:
                raise APIError(400, f"{where}: this model has no tokenizer; send token ids", where)
            out.append((p, _encode(state, p, where)))
        else:
            out.append((None, list(p)))
    return out


def _check_fan_out(state: ServerState, params: SamplingParams, prompts: int) -> None:
    if params.n * prompts > state.max_samples:
        each = f" x {prompts} prompts" if prompts > 1 else ""
        raise APIError(
            400,
            f"n: {params.n} samples{each} is more than this server runs for one request "
            f"({state.max_samples}; --max-samples-per-request)",
            "n",
        )


def _validate(state: ServerState, prompts: list, params: SamplingParams, where: str) -> None:
    _check_fan_out(state, params, len(prompts))
    for i, (_, ids) in enumerate(prompts):
        state.tm.validate(ids, params, where=where if len(prompts) == 1 else f"{where} {i}")


# ---- bodies, disconnects, first outputs -----------------------------------------------------
async def _raw_body(request: Request) -> bytes:
    return await request.body()


def _validation_error(e: ValidationError) -> APIError:
    first = e.errors()[0] if e.errors() else {}
    names: list[str] = []  # the field's path; pydantic's union-member tags are left out
    for x in first.get("loc", []):
        if isinstance(x, int) and names:
            names[-1] += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier():
            names.append(x)
    param = ".".join(names) or None
    what = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {what}", param)


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """`raw` as a `model`; an `APIError` (400) names what is wrong."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def _body(model: type[BaseModel]) -> Any:
    """A dependency: the JSON body parsed and validated as `model` on a worker thread (FastAPI
    runs plain functions off the event loop). JSON decoding and pydantic hold the GIL while they
    run, so this bounds, not removes, what a large body costs the loop (see docs/server.md)."""

    def parse(raw: bytes = Depends(_raw_body)) -> Any:
        return parse_body(model, raw)

    return Depends(parse)


_GONE = object()  # the client disconnected


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, aw: Any) -> Any:
    """`aw`'s result, or `_GONE` if the client disconnects first: then `aw` is cancelled, which
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
        return _GONE
    return work.result()


def _refused(out: StrOut) -> APIError | None:
    """The 400 for an output that says the scheduler refused the request (a grammar that does
    not compile, or does not compile in time)."""
    if out.finish_reason and out.refused and out.error:
        return APIError(400, out.error, _param_of(out.error))
    return None


async def _first_output(
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


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    token_texts: dict[int, str] = field(default_factory=dict)
    first_at: float | None = None
    last_at: float | None = None


def _absorb(state: ServerState, c: _Choice, out: StrOut, now: float, t0: float) -> None:
    if out.token_ids:
        if c.first_at is None:
            state.metrics.ttft.observe(now - t0)
        elif c.last_at is not None:
            state.metrics.itl.observe((now - c.last_at) / len(out.token_ids))
        c.first_at = c.first_at or now
        c.last_at = now
    c.text += out.text
    c.token_ids += out.token_ids
    c.prompt_tokens, c.cached_tokens = out.prompt_tokens, out.cached_tokens
    if out.logprobs:
        c.logprobs += out.logprobs
    if out.prompt_logprobs is not None:
        c.prompt_logprobs = out.prompt_logprobs
    if out.token_texts:
        c.token_texts.update(out.token_texts)
    if out.finish_reason:
        c.finish_reason, c.stop_reason, c.error = out.finish_reason, out.stop_reason, out.error
        state.metrics.generation_tokens += len(c.token_ids)
        if out.error:
            state.metrics.requests_failed += 1


def _usage(choices: list[_Choice], prompt_choice: list[int]) -> dict[str, Any]:
    prompt = sum(choices[i].prompt_tokens for i in prompt_choice)
    cached = sum(choices[i].cached_tokens for i in prompt_choice)
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish(c: _Choice) -> str | None:
    if c.finish_reason == "abort" and c.error:
        return "abort"
    return c.finish_reason


def _dumps(
    head: dict[str, Any] | None, key: str | None, items: list[Any], as_list: bool = False
) -> bytes:
    """JSON of `head` with `items` under `key` (or of `items` alone: one item, or a list),
    encoded item by item so that a large body lets other threads (and the event loop) run
    between items."""
    parts = [json.dumps(x, ensure_ascii=False, separators=(",", ":")) for x in items]
    if head is None:
        return ("[" + ",".join(parts) + "]" if as_list else parts[0]).encode()
    encoded = json.dumps(head, ensure_ascii=False, separators=(",", ":"))
    return (encoded[:-1] + f',"{key}":[' + ",".join(parts) + "]}").encode()


def _json_response(body: bytes) -> Response:
    return Response(content=body, media_type="application/json")


def _event_stream(request: Request, events: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response of `events`; a client that leaves before the end is logged (closing
    `events` aborts what it still streams)."""

    async def logged() -> AsyncIterator[str]:
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _text_of(state: ServerState, tid: int, texts: dict[int, str]) -> str:
    if tid in texts:
        return texts[tid]
    return state.tokenizer.decode([tid]) if state.tokenizer is not None else ""


def _chat_logprobs(state: ServerState, c: _Choice, top: int) -> dict[str, Any]:
    content = []
    for lp in c.logprobs:
        tok = _text_of(state, lp.token_id, c.token_texts)
        content.append(
            {
                "token": tok,
                "logprob": lp.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _text_of(state, tid, c.token_texts)),
                        "logprob": v,
                        "bytes": list(t.encode()),
                    }
                    for tid, v in lp.top[:top]
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(state: ServerState, c: _Choice, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs; `offset` is where this part of the text starts."""
    tokens, token_lps, tops, offsets, pos = [], [], [], [], offset
    for lp in c.logprobs:
        tok = _text_of(state, lp.token_id, c.token_texts)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({_text_of(state, tid, c.token_texts): v for tid, v in lp.top})
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _echo(
    state: ServerState, req: CompletionRequest, prompt: tuple[str | None, list[int]], c: _Choice
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
        tok = _text_of(state, tid, c.token_texts)
        tokens.append(tok)
        values.append(None if lp is None else lp.logprob)
        tops.append(
            None if lp is None else {_text_of(state, t, c.token_texts): v for t, v in lp.top}
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


def _template_messages(state: ServerState, req: ChatCompletionRequest) -> list[dict[str, Any]]:
    if state.tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer or chat template", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    raise APIError(
                        400,
                        f"messages[{i}].content: part type {part.get('type')!r} is not supported "
                        "by this text-only model",
                        "messages",
                    )
            content = "".join(parts)
        messages.append({**m.model_dump(exclude_none=True), "content": content or ""})
    return messages


def _render_messages(
    state: ServerState, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> str:
    """The conversation as prompt text, with the server's chat template (on a worker thread;
    a request's own template goes to the sandbox process instead, see `chat`)."""
    text = render_chat(
        state.tokenizer,
        _template_messages(state, req),
        add_generation_prompt=req.add_generation_prompt,
        tools=tools,
    )
    return text


def _tool_plan(state: ServerState, req: ChatCompletionRequest) -> ToolPlan | None:
    try:
        return ToolPlan.resolve(
            req.tools, req.tool_choice, req.parallel_tool_calls, parser=state.tool_call_parser
        )
    except ValueError as e:
        msg = str(e)
        raise APIError(400, msg, msg.split(":", 1)[0]) from None


def _chat_message(c: _Choice, plan: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish reason."""
    if plan is None:
        return {"role": "assistant", "content": c.text}, _finish(c)
    content, calls = plan.parse(c.text)
    if _finish(c) == "length":
        # Cut off by max_tokens: a call whose arguments did not finish is no call (OpenAI sends
        # finish_reason "length" and no broken tool_calls); the text is the content.
        calls = [call for call in calls if _is_json_object(call.arguments)]
        if not calls:
            return {"role": "assistant", "content": c.text}, "length"
    if not calls:
        return {"role": "assistant", "content": content}, _finish(c)
    message = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [call.to_openai() for call in calls],
    }
    return message, finish_reason(_finish(c), len(calls))


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _tool_deltas(ts: ToolCallStream, out: StrOut) -> list[dict[str, Any]]:
    deltas = ts.feed(out.text) if out.text else []
    if out.finish_reason:
        deltas += ts.finish()
    return [d.to_openai() for d in deltas]


# ---- the app ------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error, from every route (unknown ones too): OpenAI's shape."""

    error: ErrorInfo


_BODY_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    GenerateRequest,
    TokenizeRequest,
    AbortRequest,
    CloseSessionRequest,
)
_ERROR = {
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the request is invalid (the message names the field)", **_ERROR},
    401: {"description": "missing or invalid API key", **_ERROR},
    403: {"description": "a cross-origin or foreign-Host request", **_ERROR},
    413: {"description": "the body is larger than --max-request-bytes", **_ERROR},
    503: {"description": "the runtime is down or does not answer", **_ERROR},
    "default": {"description": "any other error", **_ERROR},
}
_STREAMED = {
    200: {"description": "the result, or its SSE stream", "content": {"text/event-stream": {}}}
}


_EMPTY = {200: {"description": "done (no body)", "content": {}}}


def _takes(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a route whose body `_body(model)` parses (FastAPI cannot see it)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (*_BODY_MODELS, ErrorResponse):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
        app.openapi_schema = doc
    return app.openapi_schema


def create_app(state: ServerState, on_ready=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.tm.start()
        if state.template_sandbox is not None:
            await asyncio.to_thread(state.template_sandbox.start)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await state.tm.shutdown()
            if state.template_sandbox is not None:
                state.template_sandbox.close()
            if not state.tm.failure:
                logger.info("braid serve: shut down cleanly (runtime processes stopped)")

    app = FastAPI(title="braid", lifespan=lifespan, responses=_ERRORS)
    app.state.braid = state
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    guard = GuardConfig(
        api_key=state.api_key,
        max_body_bytes=state.max_body_bytes,
        bind_host=state.bind_host,
        allowed_origins=state.allowed_origins,
        allowed_hosts=state.allowed_hosts,
    )
    app.add_middleware(Guard, cfg=guard)
    if state.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # the openai JS client sends its x-stainless-* headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})  # 405 keeps its Allow header
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", []) if x != "body") or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        msg = str(exc)
        return error_response(400, msg, _param_of(msg))

    @app.exception_handler(RuntimeDied)
    async def on_died(request: Request, exc: RuntimeDied):
        return error_response(503, f"the runtime is down: {exc}", kind="server_error")

    @app.exception_handler(TimeoutError)
    async def on_timeout(request: Request, exc: TimeoutError):
        return error_response(503, "the scheduler did not answer in time", kind="server_error")

    async def off_loop(fn, *args):
        return await asyncio.to_thread(fn, *args)

    # ---- info ----
    @app.get("/health", response_class=Response, responses=_EMPTY)
    async def health():
        problem = state.tm.problem(state.health_silent_s, state.health_stuck_s)
        if problem:
            return error_response(503, problem)
        return Response(status_code=200)

    app.head("/health", response_class=Response, responses=_EMPTY, operation_id="health_head")(
        health
    )

    @app.get("/health_generate", response_class=Response, responses=_EMPTY)
    async def health_generate(request: Request):
        problem = state.tm.problem(state.health_silent_s, state.health_stuck_s)
        if problem:
            return error_response(503, problem)
        rid = f"health-{uuid.uuid4().hex[:8]}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        state.tm.submit(rid, [0], params)

        async def one() -> str | None:
            async for out in state.tm.stream(rid):
                if out.finish_reason and out.error:
                    return out.error
            return None

        error = await asyncio.wait_for(_unless_gone(request, one()), 60.0)
        if error is _GONE:
            return Response(status_code=499)
        return error_response(503, error) if error else Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        r = state.tm.ready
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "braid",
            "root": state.served_model_name,  # the model's path stays on the server
            "max_model_len": r.context_length if r else None,
        }
        return {"object": "list", "data": [card]}

    @app.get("/get_model_info")
    async def model_info():
        r = state.tm.ready
        return {
            # SGLang clients load the tokenizer from here (a client on the server's machine).
            "model_path": state.model_path,
            "tokenizer_path": state.model_path if state.tokenizer is not None else None,
            "served_model_name": state.served_model_name,
            "is_generation": True,
            "context_length": r.context_length,
            "vocab_size": r.vocab_size,
            "role_template": state.role_template.to_dict(),
        }

    @app.get("/get_server_info")
    async def server_info():
        r = state.tm.ready
        try:  # fresh stats if the scheduler answers within a second, else its last heartbeat
            stats = await state.tm.control("stats", timeout=1.0)
        except TimeoutError:
            stats = {**state.tm.stats_snapshot(), "stale": True}
        return {
            **state.server_args,
            "context_length": r.context_length,
            "kv_capacity_tokens": r.kv_capacity_tokens,
            "max_running_requests": r.max_running_requests,
            "device": r.device,
            "dtype": r.dtype,
            "load_time_s": r.load_time_s,
            "pids": {"server": os.getpid(), **{n: p.pid for n, p in state.tm.procs.items()}},
            "stats": stats,
            "problem": state.tm.problem(state.health_silent_s, state.health_stuck_s),
        }

    @app.post("/flush_cache", response_class=PlainTextResponse)
    async def flush_cache():
        res = await state.tm.control("flush_cache", timeout=10.0)
        if not res.get("flushed"):
            return error_response(400, "cannot flush the cache while requests are running")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/tokenize", openapi_extra=_takes(TokenizeRequest))
    async def tokenize(body: Annotated[TokenizeRequest, _body(TokenizeRequest)]):
        """vLLM's /tokenize: the prompt's token ids as this server would feed them."""
        ids = (await off_loop(_tokenize_prompts, state, body.prompt))[0][1]
        return {"tokens": ids, "count": len(ids), "max_model_len": state.tm.ready.context_length}

    @app.post("/close_session", openapi_extra=_takes(CloseSessionRequest))
    async def close_session(body: Annotated[CloseSessionRequest, _body(CloseSessionRequest)]):
        """Release what a program session keeps cached."""
        result = await state.tm.control("close_session", timeout=10.0, arg=body.session_id)
        return {"success": bool(result.get("closed"))}

    @app.post(
        "/abort_request",
        openapi_extra=_takes(AbortRequest),
        response_class=Response,
        responses=_EMPTY,
    )
    async def abort_request(body: Annotated[AbortRequest, _body(AbortRequest)]):
        state.tm.abort(body.rid)
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(
            state.metrics.render(state.tm.stats_snapshot()),
            media_type="text/plain; version=0.0.4",
        )

    # ---- OpenAI ----
    def prepare_completion(req: CompletionRequest):
        _check_model(state, req.model)
        if req.echo and req.stream:
            raise APIError(400, "echo: not supported with stream=true", "echo")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of: not supported (only best_of equal to n)", "best_of")
        prompts = _tokenize_prompts(state, req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        if max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        if req.echo and max_tokens == 0:
            max_tokens = 1  # echo only: one token is generated and dropped
        params = req.sampling_params(state.defaults, max_tokens=max_tokens, logprobs=req.logprobs)
        if req.echo and req.logprobs is not None:
            params = params.replace(prompt_logprobs=req.logprobs)
        _validate(state, prompts, params, "prompt")
        return prompts, params

    @app.post("/v1/completions", openapi_extra=_takes(CompletionRequest), responses=_STREAMED)
    async def completions(
        request: Request, req: Annotated[CompletionRequest, _body(CompletionRequest)]
    ):
        prompts, params = await off_loop(prepare_completion, req)
        return await _run_openai(state, request, "text_completion", req, prompts, params)

    def prepare_chat(req: ChatCompletionRequest, text: str | None):
        plan = _tool_plan(state, req)
        if text is None:
            text = _render_messages(state, req, plan.template_tools if plan else None)
        ids = _encode(state, text, "messages", add_special_tokens=False)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens == 0:
            raise APIError(400, "max_tokens must be >= 1", "max_tokens")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(state.defaults, max_tokens=max_tokens, logprobs=logprobs)
        if plan is not None:
            try:
                params = plan.sampling_params(params)
            except ValueError as e:
                raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
        _validate(state, [(text, ids)], params, "messages")
        return text, ids, params, plan

    @app.post(
        "/v1/chat/completions", openapi_extra=_takes(ChatCompletionRequest), responses=_STREAMED
    )
    async def chat(
        request: Request, req: Annotated[ChatCompletionRequest, _body(ChatCompletionRequest)]
    ):
        _check_model(state, req.model)
        if not req.messages:
            raise APIError(400, "messages: must not be empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
        text = None
        if req.chat_template is not None:
            text = await render_request_template(req)
        text, ids, params, plan = await off_loop(prepare_chat, req, text)
        return await _run_openai(
            state, request, "chat.completion", req, [(text, ids)], params, plan
        )

    async def render_request_template(req: ChatCompletionRequest) -> str:
        sandbox = state.template_sandbox
        if not state.allow_request_chat_template or sandbox is None:
            raise APIError(
                400,
                "chat_template: this server does not take a chat template from requests "
                "(the operator can allow it with --allow-request-chat-template)",
                "chat_template",
            )
        plan = await off_loop(_tool_plan, state, req)
        messages = await off_loop(_template_messages, state, req)
        return await asyncio.get_running_loop().run_in_executor(
            sandbox.executor,
            functools.partial(
                sandbox.render,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template,
                tools=plan.template_tools if plan else None,
            ),
        )

    # ---- native ----
    def prepare_generate(req: GenerateRequest):
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        single = isinstance(req.text, str) or (
            req.input_ids is not None and all(isinstance(t, int) for t in req.input_ids)
        )
        where = "text" if req.text is not None else "input_ids"
        prompts = _tokenize_prompts(
            state, req.text if req.text is not None else req.input_ids, where
        )
        params = native_sampling_params(req.sampling_params, state.defaults)
        if req.return_logprob:
            params = params.replace(logprobs=req.top_logprobs_num)
            if req.logprob_start_len >= 0:
                params = params.replace(
                    prompt_logprobs=req.top_logprobs_num, logprob_start_len=req.logprob_start_len
                )
        _validate(state, prompts, params, "text")
        return prompts, params, single

    @app.post("/generate", openapi_extra=_takes(GenerateRequest), responses=_STREAMED)
    async def generate(request: Request, req: Annotated[GenerateRequest, _body(GenerateRequest)]):
        prompts, params, single = await off_loop(prepare_generate, req)
        top = req.top_logprobs_num
        # SGLang's layout: one result per sample, prompt-major; a list unless one prompt was
        # sampled once.
        n = params.n
        base = req.rid or f"gen-{uuid.uuid4().hex[:12]}"
        rids = [base if single else f"{base}-{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        state.metrics.requests += 1
        state.metrics.prompt_tokens += sum(len(ids) for _, ids in prompts)
        streams = _submit_all(
            state, [(rid, ids) for rid, (_, ids) in zip(rids, prompts)], params, req.session_id
        )
        prompt_of = [i for i in range(len(prompts)) for _ in range(n)]
        sample_rids = [f"{rids[p]}/{k % n}" if n > 1 else rids[p] for k, p in enumerate(prompt_of)]
        choices = [_Choice() for _ in streams]

        def entry(lp, tid: int, texts: dict[int, str]) -> list[Any]:
            return [None if lp is None else lp, tid, _text_of(state, tid, texts)]

        def native(i: int) -> dict[str, Any]:
            c = choices[i]
            ids = prompts[prompt_of[i]][1]
            meta = {
                "id": sample_rids[i],
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": len(c.token_ids),
                "cached_tokens": c.cached_tokens,
                "finish_reason": finish_reason_info(
                    _finish(c), c.stop_reason, len(c.token_ids), c.error
                ),
                "e2e_latency": time.perf_counter() - t0,
            }
            if req.return_logprob:
                meta["output_token_logprobs"] = [
                    entry(lp.logprob, lp.token_id, c.token_texts) for lp in c.logprobs
                ]
                meta["output_token_logprobs_length"] = len(c.logprobs)
                if top:
                    meta["output_top_logprobs"] = [
                        [entry(v, t, c.token_texts) for t, v in lp.top[:top]] for lp in c.logprobs
                    ]
                if c.prompt_logprobs is not None:
                    start = max(0, req.logprob_start_len)
                    scored = list(enumerate(c.prompt_logprobs))[start:]
                    meta["input_token_logprobs"] = [
                        entry(None if lp is None else lp.logprob, ids[pos], c.token_texts)
                        for pos, lp in scored
                    ]
                    if top:
                        meta["input_top_logprobs"] = [
                            None
                            if lp is None
                            else [entry(v, t, c.token_texts) for t, v in lp.top[:top]]
                            for _, lp in scored
                        ]
            return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}

        if req.stream:
            outs = await _unless_gone(request, _first_output(streams))
            if outs is _GONE:
                return Response(status_code=499)

            async def events():
                async for i, out in outs:
                    _absorb(state, choices[i], out, time.perf_counter(), t0)
                    yield _sse({"index": i, **native(i)})
                yield "data: [DONE]\n\n"

            return _event_stream(request, events())

        async def collect() -> None:
            async for i, out in await _first_output(streams):
                _absorb(state, choices[i], out, time.perf_counter(), t0)

        if await _unless_gone(request, collect()) is _GONE:
            return Response(status_code=499)

        def build() -> bytes:
            if single and n == 1:
                return _dumps(None, None, [native(0)])
            return _dumps(None, None, [native(i) for i in range(len(streams))], as_list=True)

        return _json_response(await asyncio.to_thread(build))

    return app


def _submit_all(
    state: ServerState,
    jobs: list[tuple[str, list[int]]],
    params: SamplingParams,
    session_id: str | None = None,
) -> list[AsyncIterator[StrOut]]:
    """Submit `params.n` samples of every (rid, prompt): all of them or (on an error) none."""
    rids: list[str] = []
    try:
        for rid, ids in jobs:
            rids += state.tm.submit(rid, ids, params, session_id=session_id)
    except BaseException:
        for r in rids:
            state.tm.cancel(r)
        raise
    return [state.tm.stream(r) for r in rids]


async def _run_openai(
    state: ServerState,
    request: Request,
    kind: str,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    tools: ToolPlan | None = None,
):
    """Submit every (prompt, sample), then answer in full or as an SSE stream. With `tools`
    (chat only), outputs become content and tool calls."""
    chat = kind == "chat.completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    t0 = time.perf_counter()
    state.metrics.requests += 1
    state.metrics.prompt_tokens += sum(len(ids) for _, ids in prompts)
    streams = _submit_all(
        state, [(f"{rid}-{i}", ids) for i, (_, ids) in enumerate(prompts)], params
    )
    prompt_choice = [i * params.n for i in range(len(prompts))]
    choices = [_Choice() for _ in streams]
    prompt_of = [i for i in range(len(prompts)) for _ in range(params.n)]
    top = params.logprobs or 0

    def logprobs_of(c: _Choice, offset: int = 0):
        if params.logprobs is None:
            return None
        return _chat_logprobs(state, c, top) if chat else _completion_logprobs(state, c, offset)

    if not req.stream:

        async def collect() -> None:
            async for i, out in await _first_output(streams):
                _absorb(state, choices[i], out, time.perf_counter(), t0)

        if await _unless_gone(request, collect()) is _GONE:
            return Response(status_code=499)
        failed = [c.error for c in choices if c.error]
        if failed and state.tm.failure:
            raise RuntimeDied(state.tm.failure)

        def build() -> bytes:  # a worker thread's job: long logprob lists take a while
            body_choices = []
            for i, c in enumerate(choices):
                item: dict[str, Any] = {
                    "index": i,
                    "finish_reason": _finish(c),
                    "logprobs": logprobs_of(c),
                }
                if chat:
                    item["message"], item["finish_reason"] = _chat_message(c, tools)
                elif getattr(req, "echo", False):
                    item.update(_echo(state, req, prompts[prompt_of[i]], c))
                else:
                    item["text"] = c.text
                if c.stop_reason is not None:
                    item["stop_reason"] = c.stop_reason
                if c.error:  # it failed after it started: the reason, finish_reason "abort"
                    item["error"] = {"message": c.error, "type": "server_error"}
                body_choices.append(item)
            head = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": state.served_model_name,
                "usage": _usage(choices, prompt_choice),
            }
            return _dumps(head, "choices", body_choices)

        return _json_response(await asyncio.to_thread(build))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices_payload: list[dict[str, Any]], usage=None) -> str:
        body = {
            "id": rid,
            "object": chunk_kind,
            "created": created,
            "model": state.served_model_name,
            "choices": choices_payload,
        }
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    outs = await _unless_gone(request, _first_output(streams))
    if outs is _GONE:
        return Response(status_code=499)

    async def events():
        if chat:
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(len(choices))
                ]
            )
        sent_logprobs = [0] * len(choices)  # logprobs already streamed, per choice
        sent_text = [0] * len(choices)
        # One tool-call stream per choice when the output is parsed into calls.
        parsers = [tools.stream() for _ in choices] if chat and tools is not None else []
        calls: list[ToolCallStream] | None = parsers if parsers and parsers[0] else None
        async for i, out in outs:
            c = choices[i]
            _absorb(state, c, out, time.perf_counter(), t0)
            deltas = _tool_deltas(calls[i], out) if calls is not None else None
            if (not out.text if deltas is None else not deltas) and not out.finish_reason:
                continue  # held-back text: its tokens' logprobs go with the next chunk
            delta_c = _Choice(logprobs=c.logprobs[sent_logprobs[i] :], token_texts=c.token_texts)
            sent_logprobs[i] = len(c.logprobs)
            lp = logprobs_of(delta_c, sent_text[i])
            sent_text[i] = len(c.text)
            item: dict[str, Any] = {
                "index": i,
                "logprobs": lp,
                "finish_reason": _finish(c) if out.finish_reason else None,
            }
            if out.error:  # the stream's last chunk says why it failed
                item["error"] = {"message": out.error, "type": "server_error"}
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
                            }
                        ]
                    )
                continue
            if chat:
                item["delta"] = {"content": out.text} if out.text else {}
            else:
                item["text"] = out.text
            yield chunk([item])
        if include_usage:
            yield chunk([], _usage(choices, prompt_choice))
        yield "data: [DONE]\n\n"

    return _event_stream(request, events())
