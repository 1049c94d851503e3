"""OpenAI's embeddings: `POST /v1/embeddings`.

Each input becomes an embedding request (`GenerateReq.embed`): a prefill through the same
scheduler as everything else, whose final hidden states are pooled (`braid.runtime.pooling`),
never sampled. The response is OpenAI's list of `{object: "embedding", index, embedding}`, a
vector of floats or, with `encoding_format: "base64"`, the base64 of its little-endian float32
bytes (what the openai client asks for by default).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from braid.runtime.ipc.to_scheduler import EmbedSpec
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.models.config import ModelConfig
from braid.runtime.pooling import PoolingConfig, floats, prompt_keep
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import check_model, json_body, tokenize_prompts
from braid.runtime.server.openai_types import Embedding, EmbeddingList, EmbeddingUsage
from braid.runtime.server.openapi import answers, takes
from braid.runtime.server.outputs import (
    GONE,
    encode_listed,
    first_output,
    json_response,
    unless_gone,
)
from braid.runtime.server.protocol import EmbeddingRequest
from braid.runtime.server.state import ServerState
from braid.runtime.tokenizer.manager import RuntimeDied

_PARAMS = SamplingParams(max_tokens=0)  # an embedding samples nothing


def add_routes(app: FastAPI, state: ServerState) -> None:
    model_dir = Path(state.model_path)
    config = ModelConfig.from_dir(model_dir)
    pooling = PoolingConfig.from_model(
        model_dir, config.hidden_size, config.raw, state.tm.config.pooling
    )

    def prepare(req: EmbeddingRequest) -> tuple[list[list[int]], EmbedSpec]:
        check_model(state, req.model)
        spec = pooling.spec(req.normalize, req.dimensions)  # ParamErrors name their field
        keep = prompt_keep(req.truncate_prompt_tokens, state.tm.ready.context_length)
        prompts = [ids for _, ids in tokenize_prompts(state, req.input, "input")]
        if keep is not None:
            prompts = [ids[-keep:] for ids in prompts]
        for i, ids in enumerate(prompts):
            where = "input" if len(prompts) == 1 else f"input[{i}]"
            state.media.check_no_placeholders(ids, where)
            state.tm.validate(ids, _PARAMS, where=where, embed=True)
        return prompts, spec

    @app.post(
        "/v1/embeddings", openapi_extra=takes(EmbeddingRequest), responses=answers(EmbeddingList)
    )
    async def embeddings(
        request: Request, req: Annotated[EmbeddingRequest, json_body(EmbeddingRequest)]
    ):
        prompts, spec = await asyncio.to_thread(prepare, req)
        rid = f"embd-{uuid.uuid4().hex[:12]}"
        state.metrics.requests += 1
        state.metrics.prompt_tokens += sum(len(ids) for ids in prompts)
        streams = _submit(state, rid, prompts, spec)
        vectors: list[bytes | None] = [None] * len(prompts)
        failed: list[str] = []

        async def collect() -> None:
            async with contextlib.aclosing(await first_output(streams)) as outs:
                async for i, out in outs:
                    if out.finish_reason is None:
                        continue
                    if out.refused is not None and out.error:  # closing `outs` aborts the others
                        raise APIError(400, out.error, out.refused.param)
                    if out.embedding is None:
                        failed.append(out.error or "the request ended without an embedding")
                    vectors[i] = out.embedding

        if await unless_gone(request, collect()) is GONE:
            return Response(status_code=499)
        if failed:
            if state.tm.failure:
                raise RuntimeDied(state.tm.failure)
            state.metrics.requests_failed += 1
            raise APIError(500, f"embedding failed: {failed[0]}", kind="server_error")

        def build() -> bytes:
            data = []
            for i, vec in enumerate(vectors):
                value: Any = (
                    base64.b64encode(vec).decode("ascii")
                    if req.encoding_format == "base64"
                    else floats(vec)
                )
                data.append(Embedding(index=i, embedding=value))
            tokens = sum(len(ids) for ids in prompts)
            body = EmbeddingList(
                id=rid,
                created=int(time.time()),
                model=state.served_model_name,
                data=data,
                usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
            )
            return encode_listed(body, "data")

        return json_response(await asyncio.to_thread(build))


def _submit(
    state: ServerState, rid: str, prompts: list[list[int]], spec: EmbedSpec
) -> list[AsyncIterator[StrOut]]:
    """Submit one embedding request per prompt: all of them (in one message) or (on an error)
    none."""
    with state.tm.together() as rids:
        for i, ids in enumerate(prompts):
            rids += state.tm.submit(f"{rid}-{i}", ids, _PARAMS, embed=spec)
    return [state.tm.stream(r) for r in rids]
