"""The server's OpenAPI document: the error shape every route answers with, the documented
responses (with the response models of `openai_types` where a route declares them with
`answers`), and the request bodies that routes parse themselves (`inputs.json_body`), which
FastAPI cannot see."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from braid.runtime.server.openai_types import ErrorResponse
from braid.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from braid.runtime.server.protocol_native import (
    AbortRequest,
    CloseSessionRequest,
    EndProgramRequest,
    GenerateRequest,
)

_BODY_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    EmbeddingRequest,
    GenerateRequest,
    TokenizeRequest,
    AbortRequest,
    CloseSessionRequest,
    EndProgramRequest,
)
_ERROR = {
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
}
# The app's responses: every route may answer with any of these.
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the request is invalid (the message names the field)", **_ERROR},
    401: {"description": "missing or invalid API key", **_ERROR},
    403: {"description": "a cross-origin or foreign-Host request", **_ERROR},
    413: {"description": "the body is larger than --max-request-bytes", **_ERROR},
    503: {"description": "the runtime is down or does not answer", **_ERROR},
    "default": {"description": "any other error", **_ERROR},
}
# Models that routes declare with `takes` (besides _BODY_MODELS) and `answers`, by name.
_DECLARED: dict[str, type[BaseModel]] = {}
STREAMED = {
    200: {"description": "the result, or its SSE stream", "content": {"text/event-stream": {}}}
}
EMPTY = {200: {"description": "done (no body)", "content": {}}}


def takes(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a route whose body `json_body(model)` parses (FastAPI cannot see it); the
    model's schema joins the document's components."""
    _DECLARED[model.__name__] = model
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def answers(model: type[BaseModel], streamed: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's documented 200: a JSON body of `model` (whose schema joins the document's
    components), or with `streamed` also an SSE stream (of `model`'s chunks)."""
    _DECLARED[model.__name__] = model
    content: dict[str, Any] = {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
    }
    if streamed:
        content["text/event-stream"] = {}
    what = "the result, or with stream its SSE chunks" if streamed else "the result"
    return {200: {"description": what, "content": content}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """`app`'s OpenAPI document, with the body models and the error shape (built once)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (*_BODY_MODELS, *_DECLARED.values(), ErrorResponse):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
        app.openapi_schema = doc
    return app.openapi_schema
