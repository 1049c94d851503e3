"""What stands between the network and the routes: one error shape, and the checks every
request passes before any route sees it.

`Guard` is a plain ASGI middleware (no `BaseHTTPMiddleware`: it must see the body as it arrives
and must not buffer streamed responses). In order, it refuses:
- a cross-origin browser request (an `Origin` that is not the server's own and not in
  `--allowed-origins`), and, on a loopback server, a `Host` that is not loopback (DNS
  rebinding): a server on 127.0.0.1 is reachable from every web page its user opens;
- a request without the API key, when one is set (`public_paths` are open: `/health`,
  `/metrics`, the playground page and its assets);
- a body larger than `--max-request-bytes`, counted as it arrives, so a chunked body with no
  Content-Length stops at the limit too (413).
It then hands the route the buffered body, and turns any exception that escapes a route into
an OpenAI-style 500 (the server keeps serving).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fastapi.responses import Response

from braid.runtime.errors import error_param
from braid.runtime.server.openai_types import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_KIND = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
}
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class APIError(Exception):
    """An error answered as it is: its status, message, `param` (the request field at fault,
    or None) and `kind` (OpenAI's error type; by default the status's)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or _KIND.get(status, "server_error")

    @classmethod
    def refused(cls, e: ValueError) -> APIError:
        """The 400 for `e`, a value braid's checks refused: its `param` if it is a
        `ParamError`."""
        return cls(400, str(e), error_param(e))


def error_body(status: int, message: str, param: str | None = None, kind: str = "") -> bytes:
    """The JSON of OpenAI's error body (`ErrorResponse`)."""
    kind = kind or _KIND.get(status, "server_error")
    info = ErrorInfo(message=message, type=kind, param=param, code=status)
    return ErrorResponse(error=info).model_dump_json().encode()


def error_response(status: int, message: str, param: str | None = None, kind: str = "") -> Response:
    return Response(
        error_body(status, message, param, kind), status_code=status, media_type="application/json"
    )


async def send_error(send: Send, status: int, message: str) -> None:
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status in (408, 413):  # the body was not read to its end: the connection cannot go on
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


MAX_BODY_BYTES = 16 * 1024 * 1024
WILDCARD = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    bind_host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()  # "*" allows any
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides loopback ones ("*": any)
    public_paths: frozenset[str] = frozenset({"/health"})  # served without the API key


def _host_name(netloc: str) -> str:
    """The host of a `Host` header or URL netloc, without the port ("[::1]:80" -> "::1")."""
    if netloc.startswith("["):
        return netloc[1 : netloc.find("]")] if "]" in netloc else netloc
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _host_allowed(cfg: GuardConfig, name: str) -> bool:
    """Whether a request addressed to `name` is one this server answers. A loopback server
    answers loopback names (a browser page that rebinds its own domain to 127.0.0.1 keeps its
    domain in Host); a server on a wildcard address also answers IP literals and this
    machine's names; `--allowed-hosts` adds names (a reverse proxy's), "*" any."""
    if "*" in cfg.allowed_hosts or name in LOOPBACK or name in cfg.allowed_hosts:
        return True
    if cfg.bind_host in LOOPBACK:
        return False
    if cfg.bind_host in WILDCARD:
        return _is_ip(name) or name in _machine_names()
    return name == cfg.bind_host.lower()


@functools.cache
def _machine_names() -> frozenset[str]:
    return frozenset(n.lower() for n in (socket.gethostname(), socket.getfqdn()))


def origin_problem(cfg: GuardConfig, headers: dict[str, str]) -> str | None:
    """Why a request must be refused for where it comes from, or None."""
    host = headers.get("host", "")
    if host and not _host_allowed(cfg, _host_name(host).lower()):
        return (
            f"Host {host!r} is refused: this server (on {cfg.bind_host}) answers only the "
            "names it listens on (add others with --allowed-hosts)"
        )
    origin = headers.get("origin")
    if origin is None or origin in cfg.allowed_origins or "*" in cfg.allowed_origins:
        return None
    if origin != "null" and urlsplit(origin).netloc == host:
        return None  # same origin: a page this server served
    return f"cross-origin request from {origin!r} refused (allow an origin with --allowed-origins)"


class Guard:
    def __init__(self, app: Callable, cfg: GuardConfig) -> None:
        self.app = app
        self.cfg = cfg
        # A refused body is read and dropped up to this much before the 413, so the client
        # (still sending) gets the answer rather than a reset; past it the connection just ends.
        self._drain_bytes = max(4 * cfg.max_body_bytes, 64 * 1024 * 1024)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.cfg
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = origin_problem(cfg, headers)
        if problem:
            await send_error(send, 403, problem)
            return
        if cfg.api_key is not None and scope["path"] not in cfg.public_paths:
            auth = headers.get("authorization", "")
            if auth != f"Bearer {cfg.api_key}":
                msg = "missing API key" if not auth else "invalid API key"
                await send_error(send, 401, f"{msg}: send 'Authorization: Bearer <key>'")
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > cfg.max_body_bytes:
            await _drain(receive, self._drain_bytes)
            await send_error(send, 413, _too_large(length, cfg.max_body_bytes))
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive, send)
            if body is None:
                return
            receive = _replay(body, receive)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # a route's bug must cost one request, never the server
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                await send_error(send, 500, f"internal error: {type(e).__name__}: {e}")

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None if the client went away or it passed the limit (413
        sent)."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.cfg.max_body_bytes:
                if message.get("more_body", False):
                    await _drain(receive, self._drain_bytes)
                await send_error(send, 413, _too_large(f"over {total}", self.cfg.max_body_bytes))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a body, at most `budget` bytes (the body deadline of
    `http.py` bounds the time)."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


def _too_large(size: str, limit: int) -> str:
    return f"request body is {size} bytes; the limit is {limit} (--max-request-bytes)"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the client's own messages (so a
    route can still hear the client disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
