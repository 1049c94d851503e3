"""SGLang's native generation route: `POST /generate` (text or token ids in, SGLang's result
layout and meta info out)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from braid.runtime.errors import ParamError
from braid.runtime.outputs import finish_reason_info, spec_meta_info
from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import check_model, json_body, tokenize_prompts, validate_prompts
from braid.runtime.server.openapi import STREAMED, takes
from braid.runtime.server.outputs import (
    GONE,
    SSE_DONE,
    Choice,
    absorb,
    count_request,
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
from braid.runtime.server.protocol_native import (
    GenerateRequest,
    SessionParams,
    native_sampling_params,
)
from braid.runtime.server.session_trees import Continuation
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
        check_model(state, req.model)
        req.refuse_inert()  # a ParamError names the field
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
        each = _PerPrompt(req, len(prompts))
        # Bad words tokenized once, here off the event loop.
        params = [
            state.tm.resolve(_prompt_params(state, req, each, i)) for i in range(len(prompts))
        ]
        images = _image_sources(req, len(prompts), single)
        for i, sources in enumerate(images):
            state.media.check_count(len(sources), "image_data" if single else f"image_data[{i}]")
        for i, ((_, ids), sources) in enumerate(zip(prompts, images)):
            if not sources:
                state.media.check_no_placeholders(ids, "text" if single else f"text[{i}]")
        continued = None
        if state.sessions.is_open(session[0]):
            prompts, continued = _continue_session(
                state, req, prompts, params, images, each, single
            )
        elif req.session_params is not None and _continues(req.session_params):
            raise APIError(
                400,
                "session_params.rid, offset, replace and drop_previous_output continue a "
                f"session opened with /open_session; {req.session_params.id!r} is not open",
                "session_params.id",
            )
        if not any(images):
            prompts = validate_prompts(
                state, prompts, params, "text", max_tokens_field=_given_max_tokens(req, each)
            )
        if continued is not None:
            continued.prompt = prompts[0][1]
        return prompts, params, single, images, (*session, continued), each

    @app.post("/generate", openapi_extra=takes(GenerateRequest), responses=STREAMED)
    async def generate(
        request: Request, req: Annotated[GenerateRequest, json_body(GenerateRequest)]
    ):
        prompts, params, single, sources, session, each = await asyncio.to_thread(
            prepare_generate, req
        )
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
            with_images = [bool(s) for s in sources]
            prompts = await asyncio.to_thread(
                validate_prompts,
                state,
                prompts,
                params,
                "text",
                images=with_images,
                max_tokens_field=_given_max_tokens(req, each),
            )
        # SGLang's layout: one result per sample, prompt-major; a list unless one prompt was
        # sampled once.
        rids = each.rids(single)
        t0 = time.perf_counter()
        session_id, session_ttl, position, continued = session
        streams = submit_all(
            state,
            [(rid, ids) for rid, (_, ids) in zip(rids, prompts)],
            params,
            session_id,
            images,
            session_ttl_s=session_ttl,
            program_position=position,
            program_id=req.program_id,
            cache_salt=req.cache_salt,
            group=req.rid if isinstance(req.rid, str) else None,
            priority=req.priority,
        )
        count_request(state, sum(len(ids) for _, ids in prompts))
        prompt_of = [i for i in range(len(prompts)) for _ in range(params[i].n)]
        sample_rids = [
            f"{rids[p]}/{k}" if params[p].n > 1 else rids[p]
            for p in range(len(prompts))
            for k in range(params[p].n)
        ]
        choices = [Choice() for _ in streams]
        if continued is not None:  # a request of an opened session: later ones may continue it
            for rid in state.sessions.add(continued, choices[0]):
                state.tm.abort(rid)

        def entry(lp, tid: int, texts: dict[int, str]) -> list[Any]:
            return [None if lp is None else lp, tid, text_of(state, tid, texts)]

        def native(i: int) -> dict[str, Any]:
            c = choices[i]
            p = prompt_of[i]
            ids = prompts[p][1]
            top = each.top_logprobs_num[p]
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
            if each.return_logprob[p]:
                meta["output_token_logprobs"] = [
                    entry(lp.logprob, lp.token_id, c.token_texts) for lp in c.logprobs
                ]
                meta["output_token_logprobs_length"] = len(c.logprobs)
                if top:
                    meta["output_top_logprobs"] = [
                        [entry(v, t, c.token_texts) for t, v in lp.top[:top]] for lp in c.logprobs
                    ]
                if c.prompt_logprobs is not None:
                    start = max(0, each.logprob_start_len[p])
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
            if single and params[0].n == 1:
                return dumps([native(0)])
            return dumps([native(i) for i in range(len(streams))], as_list=True)

        return json_response(await asyncio.to_thread(build))


class _PerPrompt:
    """The body's fields that SGLang takes per prompt, as one list each with an entry per
    prompt: a list given in the body (one entry per prompt, else a 400 naming the field) or
    the one value repeated."""

    def __init__(self, req: GenerateRequest, prompts: int) -> None:
        self.prompts = prompts
        self.sampling_params = self._each(req.sampling_params, "sampling_params")
        self.return_logprob = self._each(req.return_logprob, "return_logprob")
        self.top_logprobs_num = self._each(req.top_logprobs_num, "top_logprobs_num")
        self.logprob_start_len = self._each(req.logprob_start_len, "logprob_start_len")
        self._rid = req.rid
        self._new = f"gen-{uuid.uuid4().hex[:12]}"  # the request's id when the body gives none
        if isinstance(req.rid, list):
            self._each(req.rid, "rid")
            seen: set[str] = set()
            for i, rid in enumerate(req.rid):
                if rid in seen:
                    raise APIError(400, f"rid[{i}]: {rid!r} is given twice", "rid")
                seen.add(rid)

    def _each(self, value: Any, name: str) -> list[Any]:
        if not isinstance(value, list):
            return [value] * self.prompts
        if len(value) != self.prompts:
            raise APIError(
                400,
                f"{name}: a list of {len(value)} for {self.prompts} prompt(s): give one entry "
                "per prompt, or one value for all",
                name,
            )
        return list(value)

    def rids(self, single: bool) -> list[str]:
        """Each prompt's request id: the body's own (one per prompt), else the one given
        (suffixed by the prompt's index in a batch) or a new one."""
        if isinstance(self._rid, list):
            return list(self._rid)
        base = self._rid or self._new
        return [base if single else f"{base}-{i}" for i in range(self.prompts)]


def _continues(p: SessionParams) -> bool:
    """Whether `session_params` asks to continue an earlier request of its session."""
    return p.rid is not None or bool(p.offset) or bool(p.replace) or bool(p.drop_previous_output)


def _continue_session(
    state: ServerState,
    req: GenerateRequest,
    prompts: list,
    params: list,
    images,
    each: _PerPrompt,
    single: bool,
) -> tuple[list, Continuation]:
    """The prompt of a request in a session opened with /open_session (`session_trees`): one
    prompt (not a batch, even of one), one sample, no images (refused otherwise, naming the
    field)."""
    if not single:
        where = "text" if req.text is not None else "input_ids"
        raise APIError(400, "a request of an opened session has one prompt, not a list", where)
    if params[0].n != 1:
        raise APIError(400, "a request of an opened session samples once (n = 1)", "n")
    if images[0]:
        raise APIError(
            400, "image_data in a session opened with /open_session is not supported", "image_data"
        )
    params_of = req.session_params or SessionParams(id=req.session_id)
    text, ids = prompts[0]
    bos = getattr(state.tokenizer, "bos_token_id", None)
    continued = state.sessions.prompt_for(
        params_of, each.rids(True)[0], list(ids), bos, state.tm.in_flight
    )
    return [(text, continued.prompt)], continued


def _given_max_tokens(req: GenerateRequest, each: _PerPrompt) -> list[str | None]:
    """Each prompt's field that gives its most new tokens, as the body spells it
    ("sampling_params.max_new_tokens", "sampling_params[1].max_tokens"), or None where it
    takes the default (which the context cuts short)."""
    out: list[str | None] = []
    listed = isinstance(req.sampling_params, list)
    for i, raw in enumerate(each.sampling_params):
        where = f"sampling_params[{i}]" if listed else "sampling_params"
        given = [k for k in ("max_new_tokens", "max_tokens") if (raw or {}).get(k) is not None]
        out.append(f"{where}.{given[0]}" if given else None)
    return out


def _prompt_params(state: ServerState, req: GenerateRequest, each: _PerPrompt, i: int):
    """Prompt i's sampling parameters: its `sampling_params` with its logprob fields."""
    raw = each.sampling_params[i]
    try:
        params = native_sampling_params(raw, state.defaults)
    except ParamError as e:
        if not isinstance(req.sampling_params, list):
            raise
        field, msg = f"sampling_params[{i}]", str(e)
        if msg.startswith("sampling_params"):  # the prompt's entry named in place of the field
            msg = field + msg.removeprefix("sampling_params")
        else:
            msg = f"{field}: {msg}"
        raise ParamError(field, msg) from None
    if each.return_logprob[i]:
        top = each.top_logprobs_num[i]
        params = params.replace(logprobs=top)
        if each.logprob_start_len[i] >= 0:
            params = params.replace(
                prompt_logprobs=top, logprob_start_len=each.logprob_start_len[i]
            )
    return params


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
