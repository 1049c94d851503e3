"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes a chat request (`responses_input`) and runs on the chat path (`serving_chat.
build_chat`: the chat template, tools, constraints, reasoning parser); its output becomes
Responses output items: a `reasoning` item (with `--reasoning-parser`), a `message` item with
the text, and a `function_call` item per tool call. Streamed, the same items arrive as OpenAI's
typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each with its
`sequence_number`.

With `store` (the default) the response and the conversation it ends go to the response store
(`response_store`, an SQLite file), where `previous_response_id` continues it and `GET` /
`DELETE /v1/responses/{id}` find it.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from braid.runtime.function_call.base import ContentDelta, ToolCallDelta, ToolCallStream
from braid.runtime.models.source import cache_root
from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import check_model, json_body
from braid.runtime.server.openapi import STREAMED, takes
from braid.runtime.server.outputs import (
    GONE,
    Choice,
    absorb,
    count_request,
    event_stream,
    finish_of,
    first_output,
    json_bytes,
    json_response,
    submit_all,
    unless_gone,
)
from braid.runtime.server.response_store import ResponseStore, StoreUnavailable
from braid.runtime.server.responses_input import (
    ResponsesRequest,
    chat_request,
    input_messages,
)
from braid.runtime.server.serving_chat import (
    ChatResponse,
    ReasoningTextDelta,
    SeparatedStream,
    _chat_message,
    build_chat,
)
from braid.runtime.server.state import ServerState
from braid.runtime.tokenizer.manager import RuntimeDied

_MISSING = {
    "description": "no stored response has this id",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_FOUND = {
    200: {"description": "the stored response", "content": {"application/json": {}}},
    404: _MISSING,
}
_DELETED = {
    200: {"description": "deleted", "content": {"application/json": {}}},
    404: _MISSING,
}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @functools.cache
    def store() -> ResponseStore:
        # Opened on first use: a server that never stores creates no file.
        path = state.server_args.get("response_store") or cache_root() / "responses.sqlite3"
        return ResponseStore(path, state.server_args.get("response_store_size") or 10_000)

    async def opened() -> ResponseStore:
        """`store()`, on a worker thread; a 503 naming the setting if it cannot be opened."""
        try:
            return await asyncio.to_thread(store)
        except StoreUnavailable as e:
            raise APIError(
                503,
                f"{e}: start the server with a writable --response-store (or BRAID_CACHE_DIR), "
                "or send store: false",
                "store",
            ) from None

    async def stored(method: str, response_id: str) -> Any:
        """`store().<method>(response_id)`, on a worker thread (SQLite blocks)."""
        found = await opened()
        return await asyncio.to_thread(lambda: getattr(found, method)(response_id))

    @app.post("/v1/responses", openapi_extra=takes(ResponsesRequest), responses=STREAMED)
    async def create(
        request: Request, body: Annotated[ResponsesRequest, json_body(ResponsesRequest)]
    ):
        check_model(state, body.model)
        body.refusals()
        if body.max_output_tokens is not None and body.max_output_tokens < 1:
            raise APIError(400, "max_output_tokens: must be at least 1", "max_output_tokens")
        messages = input_messages(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            found = await stored("messages", body.previous_response_id)
            if found is None:
                raise APIError(
                    400,
                    f"previous_response_id: no stored response {body.previous_response_id!r}",
                    "previous_response_id",
                )
            history = found
        kept = await opened() if body.store else None
        try:
            chat = await build_chat(state, chat_request(body, history, messages))
            run = ResponseRun(state, body, chat, history + messages, kept)
            return await run.respond(request)  # a refusal is raised before any response
        except APIError as e:
            raise _in_responses_terms(e) from None
        except ValueError as e:
            raise _in_responses_terms(APIError.refused(e)) from None

    @app.get("/v1/responses/{response_id}", responses=_FOUND)
    async def retrieve(response_id: str, stream: bool = False):
        if stream:
            raise APIError(
                400, "stream: replaying a stored response's events is not supported", "stream"
            )
        found = await stored("get", response_id)
        if found is None:
            raise _not_found(response_id)
        return json_response(json_bytes(found))

    @app.delete("/v1/responses/{response_id}", responses=_DELETED)
    async def delete(response_id: str):
        if not await stored("delete", response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


# Fields the chat path names, as a Responses body names them.
_RENAMED = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^(max_tokens|max_completion_tokens)\b"), "max_output_tokens"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^messages\b"), "input"),
    (re.compile(r"^json_schema\b"), "text.format.schema"),
    (re.compile(r"^reasoning_effort\b"), "reasoning.effort"),
    # chat's shape of a named tool choice, in a message, as the Responses body writes it
    (re.compile(r"'function': \{'name': \.\.\.\}"), "'name': ..."),
)


def _in_responses_terms(e: APIError) -> APIError:
    """A chat-path error with the field it names spelled as in the Responses body."""
    message, param = e.message, e.param
    for pattern, name in _RENAMED:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    return APIError(e.status, message, param, e.kind)


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}", "response_id")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseRun:
    """One response: `chat`'s one sample, answered as a Responses object or its events, and
    stored (with `conversation`, the messages before the output) when `store` is given."""

    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        chat: ChatResponse,
        conversation: list[dict[str, Any]],
        store: ResponseStore | None,
    ) -> None:
        self.state, self.body, self.chat = state, body, chat
        self.conversation = conversation
        self.store = store
        self.id = _item_id("resp")
        self.created_at = time.time()
        self.choice = Choice()

    # ---- the response object ----------------------------------------------------------------
    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The response object with `output` so far; `status` other than in_progress adds
        the usage and how it ended."""
        body = self.body
        done = status != "in_progress"
        tools = [{"strict": None, "parameters": None, **t} for t in (body.tools or [])]
        r: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": time.time() if done else None,
            "error": self.error() if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.state.served_model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": self.chat.params.temperature,
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": tools,
            "top_p": self.chat.params.top_p,
            "truncation": "disabled",
            "background": False,
            "service_tier": "default",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": self.usage(output) if done else None,
        }
        return r

    def usage(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.choice
        thought = "".join(
            part["text"]
            for item in output
            if item["type"] == "reasoning"
            for part in item.get("content") or []
        )
        tok = self.state.tokenizer
        reasoning = len(tok.encode(thought, add_special_tokens=False)) if thought and tok else 0
        out = len(c.token_ids)
        return {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, out)},
            "total_tokens": c.prompt_tokens + out,
        }

    def status(self) -> str:
        c = self.choice
        if c.error or finish_of(c) == "abort":  # aborted (/abort_request): it did not complete
            return "failed"
        return "incomplete" if finish_of(c) == "length" else "completed"

    def error(self) -> dict[str, str]:
        """A failed response's `error`."""
        if self.choice.error:
            return {"code": "server_error", "message": self.choice.error}
        return {"code": "cancelled", "message": "the request was aborted before it completed"}

    def save(self, response: dict[str, Any]) -> None:
        """Store `response` and its conversation (blocking), if storing."""
        if self.store is None or response["status"] == "failed":
            return
        said: dict[str, Any] = {"role": "assistant", "content": None}
        calls = []
        for item in response["output"]:
            if item["type"] == "message":
                said["content"] = "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
        if calls:
            said["tool_calls"] = calls
        elif said["content"] is None:
            said["content"] = ""
        self.store.put(response, [*self.conversation, said])

    # ---- answering ----------------------------------------------------------------------------
    async def respond(self, request: Request) -> Response:
        chat, state = self.chat, self.state
        self.t0 = time.perf_counter()
        streams = submit_all(
            state,
            [(self.id, chat.prompts[0][1])],
            chat.params,
            images=chat.images,
            grammar_waits=chat.grammar_waits(),
            cache_salt=self.body.cache_salt,
            group=self.id,
            priority=self.body.priority,
        )
        count_request(state, len(chat.prompts[0][1]))
        if not self.body.stream:
            return await self._whole(request, streams)
        outs = await unless_gone(request, first_output(streams))
        if outs is GONE:
            return Response(status_code=499)
        return event_stream(request, self._events(outs))

    async def _whole(self, request: Request, streams: list[AsyncIterator[Any]]) -> Response:
        async def collect() -> None:
            async for _, out in await first_output(streams):
                absorb(self.state, self.choice, out, time.perf_counter(), self.t0)

        if await unless_gone(request, collect()) is GONE:
            return Response(status_code=499)
        chat, c = self.chat, self.choice
        if c.error and self.state.tm.failure:
            raise RuntimeDied(self.state.tm.failure)
        reasoning = chat.reasoning(chat.prompts[0][0]) if chat.reasoning is not None else None
        message = _chat_message(c, chat.plan, reasoning)[0].model_dump()
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            output.append(_message_item(_item_id("msg"), message["content"]))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            output.append(_call_item(_item_id("fc"), call["id"], fn["name"], fn["arguments"]))
        status = self.status()
        if status == "incomplete" and output:  # the item cut off, as the stream marks it
            output[-1]["status"] = "incomplete"
        response = self.response(status, output)
        await asyncio.to_thread(self.save, response)
        return json_response(json_bytes(response))

    def _parser(self) -> ToolCallStream | None:
        """The stream that turns output text into deltas; None when it is all text."""
        chat = self.chat
        calls = chat.plan.stream() if chat.plan is not None else None
        if chat.reasoning is not None:
            return SeparatedStream(chat.reasoning(chat.prompts[0][0]), calls)
        return calls

    async def _events(self, outs: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
        events = EventWriter(self)
        yield events.emit("response.created", response=self.response("in_progress", []))
        yield events.emit("response.in_progress", response=self.response("in_progress", []))
        parser = self._parser()
        async for _, out in outs:
            absorb(self.state, self.choice, out, time.perf_counter(), self.t0)
            if parser is None:
                deltas: list[Any] = [ContentDelta(out.text)] if out.text else []
            else:
                deltas = parser.feed(out.text) if out.text else []
                if out.finish_reason:
                    deltas += parser.finish()
            for d in deltas:
                for event in events.delta(d):
                    yield event
        for event in events.close():
            yield event
        response = self.response(self.status(), events.output)
        await asyncio.to_thread(self.save, response)
        final = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield events.emit(final.get(response["status"], "response.failed"), response=response)


class EventWriter:
    """The typed SSE events of one streamed response: output items opened, filled by deltas
    and closed in order, every event numbered."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # the open item's text or arguments so far

    def emit(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(event) + b"\n\n"

    @property
    def index(self) -> int:
        return len(self.output)

    def delta(self, d: Any) -> list[bytes]:
        """The events for one parser delta (content, reasoning, or a tool call's piece)."""
        events: list[bytes] = []
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                events += self.close()
                item = _call_item(_item_id("fc"), d.id, d.name or "", "", "in_progress")
                events += self._open(item)
            if d.arguments and self.open is not None:
                self.text += d.arguments
                events.append(
                    self.emit(
                        "response.function_call_arguments.delta",
                        item_id=self.open["id"],
                        output_index=self.index,
                        delta=d.arguments,
                    )
                )
            return events
        if isinstance(d, ReasoningTextDelta):
            kind, text = "reasoning", d.text
        elif isinstance(d, ContentDelta):
            kind, text = "message", d.text
        else:
            raise TypeError(f"unexpected delta {d!r}")
        if not text:
            return events
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            if kind == "reasoning":
                item = {**_reasoning_item(_item_id("rs"), ""), "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {**_message_item(_item_id("msg"), ""), "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["status"] = "in_progress"
            events += self._open(item)
            events.append(self._part("response.content_part.added", part))
        self.text += text
        assert self.open is not None
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(
            self.emit(
                name,
                item_id=self.open["id"],
                output_index=self.index,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text = item, ""
        return [self.emit("response.output_item.added", output_index=self.index, item=item)]

    def _part(self, kind: str, part: dict[str, Any]) -> bytes:
        assert self.open is not None
        return self.emit(
            kind, item_id=self.open["id"], output_index=self.index, content_index=0, part=part
        )

    def close(self) -> list[bytes]:
        """The events that finish the open item, if any."""
        item, text = self.open, self.text
        if item is None:
            return []
        events: list[bytes] = []
        at = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "function_call":
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            events.append(
                self.emit(
                    "response.function_call_arguments.done", **at, name=item["name"], arguments=text
                )
            )
        elif item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            events.append(
                self.emit("response.reasoning_text.done", **at, content_index=0, text=text)
            )
            events.append(self._part("response.content_part.done", done["content"][0]))
        else:
            done = _message_item(item["id"], text)
            events.append(
                self.emit(
                    "response.output_text.done", **at, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(self._part("response.content_part.done", done["content"][0]))
        if self.run.status() == "incomplete":
            done["status"] = "incomplete"
        events.append(self.emit("response.output_item.done", output_index=self.index, item=done))
        self.output.append(done)
        self.open, self.text = None, ""
        return events


def _message_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
