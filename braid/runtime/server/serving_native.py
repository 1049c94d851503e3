"""SGLang's native generation route: `POST /generate` (text or token ids in, SGLang's result
layout and meta info out)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from braid.runtime.outputs import finish_reason_info, spec_meta_info
from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import json_body, tokenize_prompts, validate_prompts
from braid.runtime.server.openapi import STREAMED, takes
from braid.runtime.server.outputs import (
    GONE,
    SSE_DONE,
    Choice,
    absorb,
    dumps,
    event_stream,
    finish_of,
    first_output,
    json_response,
    sse,
    submit_all,
    text_of,
    unless_gone,
)
from braid.runtime.server.protocol import GenerateRequest, native_sampling_params
from braid.runtime.server.state import ServerState


def session_of(req: GenerateRequest) -> tuple[str | None, float | None, int | None]:
    """The request's session id, pin TTL and call position, from session_id / session_ttl /
    session_position or SGLang's session_params (not both)."""
    if req.session_params is not None:
        if req.session_id is not None or req.session_ttl is not None:
            raise APIError(
                400, "give session_params or session_id / session_ttl, not both", "session_params"
            )
        if req.session_position is not None:
            raise APIError(
                400, "give session_params or session_position, not both", "session_params"
            )
        return req.session_params.id, req.session_params.ttl, req.session_params.position
    if req.session_ttl is not None and req.session_id is None:
        raise APIError(400, "session_ttl needs a session_id", "session_ttl")
    if req.session_position is not None and req.session_id is None and req.program_id is None:
        raise APIError(
            400, "session_position needs a session_id or a program_id", "session_position"
        )
    return req.session_id, req.session_ttl, req.session_position


def add_routes(app: FastAPI, state: ServerState) -> None:
    def prepare_generate(req: GenerateRequest):
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        session = session_of(req)
        single = isinstance(req.text, str) or (
            req.input_ids is not None and all(isinstance(t, int) for t in req.input_ids)
        )
        where = "text" if req.text is not None else "input_ids"
        prompts = tokenize_prompts(
            state, req.text if req.text is not None else req.input_ids, where
        )
        params = native_sampling_params(req.sampling_params, state.defaults)
        if req.return_logprob:
            params = params.replace(logprobs=req.top_logprobs_num)
            if req.logprob_start_len >= 0:
                params = params.replace(
                    prompt_logprobs=req.top_logprobs_num, logprob_start_len=req.logprob_start_len
                )
        images = _image_sources(req, len(prompts), single)
        for i, sources in enumerate(images):
            state.media.check_count(len(sources), "image_data" if single else f"image_data[{i}]")
        for i, ((_, ids), sources) in enumerate(zip(prompts, images)):
            if not sources:
                state.media.check_no_placeholders(ids, "text" if single else f"text[{i}]")
        if not any(images):
            validate_prompts(state, prompts, params, "text")
        return prompts, params, single, images, session

    @app.post("/generate", openapi_extra=takes(GenerateRequest), responses=STREAMED)
    async def generate(
        request: Request, req: Annotated[GenerateRequest, json_body(GenerateRequest)]
    ):
        prompts, params, single, sources, session = await asyncio.to_thread(prepare_generate, req)
        images = None
        if any(sources):
            # Images load and process in the media workers; their placeholders then expand.
            prepared = await asyncio.gather(
                *(
                    state.media.prepare(ids, s, "image_data" if single else f"image_data[{i}]")
                    for i, ((_, ids), s) in enumerate(zip(prompts, sources))
                )
            )
            prompts = [(text, ids) for (text, _), (ids, _) in zip(prompts, prepared)]
            images = [wire for _, wire in prepared]
            validate_prompts(state, prompts, params, "text")
        top = req.top_logprobs_num
        # SGLang's layout: one result per sample, prompt-major; a list unless one prompt was
        # sampled once.
        n = params.n
        base = req.rid or f"gen-{uuid.uuid4().hex[:12]}"
        rids = [base if single else f"{base}-{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        state.metrics.requests += 1
        state.metrics.prompt_tokens += sum(len(ids) for _, ids in prompts)
        session_id, session_ttl, position = session
        streams = submit_all(
            state,
            [(rid, ids) for rid, (_, ids) in zip(rids, prompts)],
            params,
            session_id,
            images,
            session_ttl_s=session_ttl,
            program_position=position,
            program_id=req.program_id,
        )
        prompt_of = [i for i in range(len(prompts)) for _ in range(n)]
        sample_rids = [f"{rids[p]}/{k % n}" if n > 1 else rids[p] for k, p in enumerate(prompt_of)]
        choices = [Choice() for _ in streams]

        def entry(lp, tid: int, texts: dict[int, str]) -> list[Any]:
            return [None if lp is None else lp, tid, text_of(state, tid, texts)]

        def native(i: int) -> dict[str, Any]:
            c = choices[i]
            ids = prompts[prompt_of[i]][1]
            meta = {
                "id": sample_rids[i],
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": len(c.token_ids),
                "cached_tokens": c.cached_tokens,
                "finish_reason": finish_reason_info(
                    finish_of(c), c.stop_reason, len(c.token_ids), c.error
                ),
                "e2e_latency": time.perf_counter() - t0,
            }
            if c.spec is not None:
                meta |= spec_meta_info(c.spec)
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
            outs = await unless_gone(request, first_output(streams))
            if outs is GONE:
                return Response(status_code=499)

            async def events():
                async for i, out in outs:
                    absorb(state, choices[i], out, time.perf_counter(), t0)
                    yield sse({"index": i, **native(i)})
                yield SSE_DONE

            return event_stream(request, events())

        async def collect() -> None:
            async for i, out in await first_output(streams):
                absorb(state, choices[i], out, time.perf_counter(), t0)

        if await unless_gone(request, collect()) is GONE:
            return Response(status_code=499)

        def build() -> bytes:
            if single and n == 1:
                return dumps([native(0)])
            return dumps([native(i) for i in range(len(streams))], as_list=True)

        return json_response(await asyncio.to_thread(build))


def _image_sources(req: GenerateRequest, prompts: int, single: bool) -> list[list[str]]:
    """`image_data` as one list of sources per prompt (SGLang's shapes: a string or a list of
    strings for one prompt, a list per prompt for a batch)."""
    data = req.image_data
    if data is None:
        return [[] for _ in range(prompts)]
    if single:
        if isinstance(data, str):
            return [[data]]
        if all(isinstance(d, str) for d in data):
            return [list(data)]
        raise APIError(
            400, "image_data: one prompt takes a string or a list of strings", "image_data"
        )
    if isinstance(data, str) or len(data) != prompts:
        raise APIError(
            400,
            f"image_data: a batch of {prompts} prompts needs a list of {prompts} lists",
            "image_data",
        )
    return [[d] if isinstance(d, str) else list(d) for d in data]
