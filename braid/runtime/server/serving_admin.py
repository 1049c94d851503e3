"""Operator and utility routes: health, model and server info, the model list, cache flush,
tokenize, program sessions, aborts, metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import asdict
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.guard import APIError, error_response
from braid.runtime.server.inputs import check_model, json_body, tokenize_prompts
from braid.runtime.server.openapi import EMPTY, takes
from braid.runtime.server.outputs import GONE, unless_gone
from braid.runtime.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from braid.runtime.server.protocol_native import (
    AbortRequest,
    CloseSessionRequest,
    EndProgramRequest,
    OpenSessionRequest,
)
from braid.runtime.server.serving_chat import chat_prompt_of, check_template_fields
from braid.runtime.server.state import ServerState

logger = logging.getLogger(__name__)


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_class=Response, responses=EMPTY)
    async def health():
        problem = state.tm.problem(state.health_silent_s, state.health_stuck_s)
        if problem:
            return error_response(503, problem)
        return Response(status_code=200)

    app.head("/health", response_class=Response, responses=EMPTY, operation_id="health_head")(
        health
    )

    @app.get("/health_generate", response_class=Response, responses=EMPTY)
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

        error = await asyncio.wait_for(unless_gone(request, one()), 60.0)
        if error is GONE:
            return Response(status_code=499)
        return error_response(503, error) if error else Response(status_code=200)

    def model_card() -> dict:
        r = state.tm.ready
        return {
            "id": state.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "braid",
            "root": state.served_model_name,  # the model's path stays on the server
            "max_model_len": r.context_length if r else None,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get(
        "/v1/models/{model:path}",
        responses={
            404: {
                "description": "this server does not serve a model by that name",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                },
            }
        },
    )
    async def model(model: str):
        """OpenAI's model retrieval: the served model's card, by its served name (or path)."""
        check_model(state, model, strict=True)
        return model_card()

    @app.get("/version")
    async def version():
        """vLLM's /version: braid's version."""
        return {"version": braid_version()}

    @app.get("/get_model_info")
    @app.get("/model_info", operation_id="model_info_alias")
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
            # A vision-language model: the prompt text for one image of `image_data`.
            "image_placeholder": state.media.placeholder if state.media.supports_images else None,
        }

    @app.get("/get_server_info")
    @app.get("/server_info", operation_id="server_info_alias")
    async def server_info():
        r = state.tm.ready
        try:  # fresh stats if the scheduler answers within a second, else its last heartbeat
            stats, programs = await state.tm.stats_and_programs(timeout=1.0)
        except TimeoutError:
            stats = {**state.tm.stats_snapshot(), "stale": True}
            programs = state.tm.programs_snapshot()
        return {
            **state.server_args,
            "context_length": r.context_length,
            "kv_capacity_tokens": r.kv_capacity_tokens,
            "max_running_requests": r.max_running_requests,
            "device": r.device,
            "dtype": r.dtype,
            "load_time_s": r.load_time_s,
            "pids": {"server": os.getpid(), **{n: p.pid for n, p in state.tm.procs.items()}},
            # What SGLang's router reads of a worker: one data-parallel rank of one model.
            "dp_size": 1,
            "tp_size": state.tm.config.tp_size,
            "model_path": state.model_path,
            "tokenizer_path": state.model_path if state.tokenizer is not None else None,
            "served_model_name": state.served_model_name,
            "stats": stats,
            # The programs in flight or holding session pins, most pinned tokens first: calls
            # received and served, last call position, attained service, pinned KV.
            "programs": [asdict(p) for p in programs],
            "problem": state.tm.problem(state.health_silent_s, state.health_stuck_s),
        }

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report (one entry per data-parallel rank: here one), for routers:
        requests running and waiting, and the KV tokens in use. From the scheduler's last
        heartbeat: never waits on a busy step."""
        s = state.tm.stats_snapshot()
        running, waiting = int(s.get("running_requests", 0)), int(s.get("queued_requests", 0))
        used = s.get("kv_capacity_tokens", 0) - s.get("kv_free_tokens", 0)
        return [
            {
                "dp_rank": 0,
                "load": running + waiting,
                "num_reqs": running,
                "num_waiting_reqs": waiting,
                "num_tokens": int(used),
            }
        ]

    @app.post("/flush_cache", response_class=PlainTextResponse)
    async def flush_cache():
        res = await state.tm.control("flush_cache", timeout=10.0)
        if not res.get("flushed"):
            return error_response(400, "cannot flush the cache while requests are running")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/start_profile", response_class=PlainTextResponse)
    async def start_profile():
        """Start the scheduler's torch profiler (SGLang's and vLLM's endpoint). Its files go
        to the server's `$BRAID_TORCH_PROFILER_DIR`; a client cannot choose where."""
        try:
            await state.tm.profile("start_profile")
        except ValueError as e:
            return error_response(400, str(e))
        return PlainTextResponse("Profile started.\n")

    @app.post("/stop_profile", response_class=PlainTextResponse)
    async def stop_profile():
        """Stop the profile and write its trace and table under the profiler directory."""
        try:
            files = await state.tm.profile("stop_profile")
        except ValueError as e:
            return error_response(400, str(e))
        return PlainTextResponse("Profile written: " + ", ".join(files) + "\n")

    @app.post("/tokenize", openapi_extra=takes(TokenizeRequest))
    async def tokenize(body: Annotated[TokenizeRequest, json_body(TokenizeRequest)]):
        """vLLM's /tokenize: the token ids of a prompt, or of chat messages, as this server
        would feed them (`return_token_strs`: each token's string too)."""
        check_model(state, body.model)
        ids = await asyncio.to_thread(_tokenize, state, body)
        out = {"tokens": ids, "count": len(ids), "max_model_len": state.tm.ready.context_length}
        if body.return_token_strs:
            out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", openapi_extra=takes(DetokenizeRequest))
    async def detokenize(body: Annotated[DetokenizeRequest, json_body(DetokenizeRequest)]):
        """vLLM's /detokenize: the text of token ids."""
        check_model(state, body.model)
        return {"prompt": await asyncio.to_thread(_detokenize, state, body.tokens)}

    @app.post("/open_session", openapi_extra=takes(OpenSessionRequest))
    async def open_session(body: Annotated[OpenSessionRequest, json_body(OpenSessionRequest)]):
        """SGLang's: open a session whose requests may continue each other
        (`session_params.rid`); its id, as a JSON string."""
        sid = state.sessions.open(body.session_id)
        if sid is None:
            raise APIError(400, f"session {body.session_id!r} is open already", "session_id")
        logger.info("session %r opened", sid[:256])
        return sid

    @app.post("/close_session", openapi_extra=takes(CloseSessionRequest))
    async def close_session(body: Annotated[CloseSessionRequest, json_body(CloseSessionRequest)]):
        """Release what a program session keeps cached (and forget an opened session's
        requests)."""
        opened = state.sessions.close(body.session_id)
        result = await state.tm.control("close_session", timeout=10.0, arg=body.session_id)
        return {"success": bool(result.get("closed")) or opened}

    @app.post("/end_program", openapi_extra=takes(EndProgramRequest))
    async def end_program(body: Annotated[EndProgramRequest, json_body(EndProgramRequest)]):
        """A program run named by `program_id` (without sessions) has ended: the scheduler
        forgets it (once its requests in flight are done) and counts its calls."""
        result = await state.tm.control("end_program", timeout=10.0, arg=body.program_id)
        return {"success": bool(result.get("ended"))}

    @app.post(
        "/abort_request",
        openapi_extra=takes(AbortRequest),
        response_class=Response,
        responses=EMPTY,
    )
    async def abort_request(body: Annotated[AbortRequest, json_body(AbortRequest)]):
        aborted = state.tm.abort(body.rid)
        logger.info("abort_request %r: %d running sample(s) aborted", body.rid[:256], aborted)
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(
            state.metrics.render(state.tm.stats_snapshot(), state.tm.programs_snapshot()),
            media_type="text/plain; version=0.0.4",
        )


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    """The ids of `body`'s prompt, or of its messages rendered as `/v1/chat/completions`
    renders them (text only: an image's tokens are made with its pixels)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        for name in ("tools", "chat_template_kwargs", "continue_final_message"):
            if getattr(body, name):
                raise APIError(400, f"{name}: only with messages", name)
        return tokenize_prompts(state, body.prompt, add_special_tokens=body.add_special_tokens)[0][
            1
        ]
    if state.tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer", "messages")
    check_template_fields(body)
    chat = ChatCompletionRequest(
        messages=body.messages,
        tools=body.tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    prompt = chat_prompt_of(state, chat)
    if prompt.sources:
        raise APIError(400, "messages: /tokenize takes text only, not images", "messages")
    return prompt.ids


def braid_version() -> str:
    """The running braid's version (the caller's package, already imported)."""
    import sys

    return sys.modules["braid"].__version__


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    """The text of `tokens` (off the event loop: a body may hold millions of ids)."""
    if state.tokenizer is None:
        raise APIError(400, "tokens: this model has no tokenizer", "tokens")
    vocab = state.tm.ready.vocab_size
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            raise APIError(400, f"tokens[{i}]: {t} is outside the vocabulary ({vocab})", "tokens")
    return state.tokenizer.decode(tokens)
