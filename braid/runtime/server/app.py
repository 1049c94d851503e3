"""The HTTP server: OpenAI-compatible and native endpoints over one `TokenizerManager`.

`create_app` builds the app: its lifespan (the runtime's start and shutdown), the middleware,
the error handlers, and the routes of each API, one module each: `serving_admin` (health,
info, tokenize, sessions, aborts, metrics), `serving_completions`, `serving_chat`,
`serving_native` (/generate), `serving_responses` (/v1/responses), `serving_embeddings`
(/v1/embeddings), `serving_playground` (the chat page at `/`).

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a
4xx status that names the problem; a failure inside the runtime is a 500 only when the runtime
itself died (then the server exits).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from braid.runtime.server import (
    serving_admin,
    serving_chat,
    serving_completions,
    serving_embeddings,
    serving_native,
    serving_playground,
    serving_responses,
)
from braid.runtime.server.guard import APIError, Guard, GuardConfig, error_response
from braid.runtime.server.http import SHUTTING_DOWN
from braid.runtime.server.openapi import ERRORS, openapi_schema
from braid.runtime.server.state import ServerState
from braid.runtime.tokenizer.manager import RuntimeDied

__all__ = ["APIError", "ServerState", "create_app"]

logger = logging.getLogger(__name__)

# Route modules in the order their routes are registered (the OpenAPI document's order).
_APIS = (
    serving_admin,
    serving_completions,
    serving_chat,
    serving_native,
    serving_responses,
    serving_embeddings,
    serving_playground,
)


# The scheduler's throughput line: one every this many seconds of work (docs/server.md).
THROUGHPUT_LOG_S = 10.0


def create_app(state: ServerState, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app serving `state`; its lifespan starts the runtime (then calls `on_ready`) and
    shuts it down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.tm.start()
        await state.tm.control("log_throughput", arg=str(THROUGHPUT_LOG_S))
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

    app = FastAPI(title="braid", lifespan=lifespan, responses=ERRORS)
    app.state.braid = state
    # run_server's shutdown hooks: a child that exits once a stop signal came is no failure
    # (a terminal's Ctrl-C reaches the whole group); the requests in flight end cleanly.
    app.state.on_stopping = state.tm.stopping
    app.state.on_drain = lambda: state.tm.end_in_flight(SHUTTING_DOWN)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    guard = GuardConfig(
        api_key=state.api_key,
        max_body_bytes=state.max_body_bytes,
        bind_host=state.bind_host,
        allowed_origins=state.allowed_origins,
        allowed_hosts=state.allowed_hosts,
        # /metrics open, as vLLM's key guards only /v1: Prometheus scrapes without the key.
        public_paths=frozenset({"/health", "/metrics", *serving_playground.PUBLIC_PATHS}),
    )
    app.add_middleware(Guard, cfg=guard)
    if state.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],  # the openai JS client sends its x-stainless-* headers
        )
    _add_error_handlers(app)
    for api in _APIS:
        api.add_routes(app, state)
    return app


def _allowed(request: Request) -> list[str]:
    """The methods the app's routes serve on the request's path."""
    methods: set[str] = set()
    for route in request.app.routes:
        regex, served = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and served and regex.match(request.url.path):
            methods |= served
    return sorted(methods)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})  # 405 keeps its Allow header
        if exc.status_code == 405:
            # Starlette names the methods of the first route on the path; a path served by
            # several routes (GET and DELETE /v1/responses/{id}) allows all of theirs.
            response.headers["Allow"] = ", ".join(_allowed(request))
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
        # A value braid's checks refused: a `ParamError` names its field, as data.
        e = APIError.refused(exc)
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RuntimeDied)
    async def on_died(request: Request, exc: RuntimeDied):
        return error_response(503, f"the runtime is down: {exc}", kind="server_error")

    @app.exception_handler(TimeoutError)
    async def on_timeout(request: Request, exc: TimeoutError):
        return error_response(503, "the scheduler did not answer in time", kind="server_error")
