"""The HTTP front of `braid serve`: uvicorn's h11 protocol with deadlines for slow clients, and a
runner that returns after SIGTERM/SIGINT instead of dying of the signal.

uvicorn on its own times a connection out only while it is idle after a response
(`timeout_keep_alive`, cancelled by any byte that arrives). A connection that never sends a
request, sends its headers a byte at a time, or never finishes its body stays open for good, and
uvicorn re-raises the signal it shut down for, so `kill` makes the process exit with status 143.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import HANDLED_SIGNALS

from braid.runtime.server.guard import send_error

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5.0  # uvicorn's own default
GRACEFUL_S = 5.0
SHUTTING_DOWN = "the server is shutting down"
MAX_HEADER_BYTES = 16 * 1024  # Node's limit; nginx's default buffers hold 4 x 8 KiB


@dataclass(frozen=True)
class HttpLimits:
    """How long a client may take to send a request, and how large its headers may be."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    """The request line and headers must be complete this long after the connection opened, or
    after the previous response on it ended (keep-alive); otherwise the connection is closed."""
    body_timeout_s: float = BODY_TIMEOUT_S
    """The body must be complete this long after the headers; otherwise 408 and close. This is a
    deadline for the whole body, not an idle timeout, so a body sent a byte at a time cannot hold
    a connection open."""
    keep_alive_s: float = KEEP_ALIVE_S
    """A connection that sends nothing this long after a response is closed (uvicorn's timer)."""
    max_header_bytes: int = MAX_HEADER_BYTES
    """A request line plus headers larger than this gets 400 and a close."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")


class ServerStartError(RuntimeError):
    """The server did not start: its address could not be bound, or the app's start-up failed."""


class _HeaderCappedConnection(h11.Connection):
    """h11's size limit holds only for headers still incomplete in its buffer: a header block
    that arrives whole in one read passes at any size. This applies the limit to those too."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            size = (
                len(event.method)
                + len(event.target)
                + sum(len(k) + len(v) + 4 for k, v in event.headers)
            )
            if size > self.max_header_bytes:
                # uvicorn answers this as it does h11's own protocol errors: 400 and a close
                raise h11.RemoteProtocolError("request headers too large", error_status_hint=431)
        return event


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each part of a request the client sends.

    One deadline runs at a time, chosen by the client's h11 state: while it is IDLE (no complete
    request line and headers yet) the header deadline, while it is in SEND_BODY the body deadline.
    Once the request is complete nothing runs: the app may take as long as it needs to answer.
    uvicorn's keep-alive timer still runs beside the header deadline after each response.
    Headers over `max_header_bytes` get 400 and a close, however they arrive.
    """

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = _HeaderCappedConnection(limits.max_header_bytes)
        self._deadline: asyncio.TimerHandle | None = None
        # the client state the running deadline belongs to; a new state starts a new deadline
        self._deadline_state: object | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track_state()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _track_state(self) -> None:
        if self.transport.is_closing():
            self._cancel_deadline()
            return
        state = self.conn.their_state
        if state is self._deadline_state:
            return
        self._cancel_deadline()
        self._deadline_state = state
        if state is h11.IDLE:
            self._deadline = self.loop.call_later(
                self.limits.header_timeout_s, self._headers_too_slow
            )
        elif state is h11.SEND_BODY:
            self._deadline = self.loop.call_later(self.limits.body_timeout_s, self._body_too_slow)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_state = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        logger.debug(
            "braid serve: closed a connection from %s: no complete request headers within %g s",
            _address(self.client),
            self.limits.header_timeout_s,
        )
        self.transport.close()

    def _body_too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        logger.info(
            "braid serve: %s %s from %s: body not complete within %g s of its headers",
            self.scope["method"],
            self.scope["path"],
            _address(self.client),
            self.limits.body_timeout_s,
        )
        # The app is still waiting for the rest of the body; from now on it reads a disconnect
        # and whatever it sends is dropped.
        self.cycle.disconnected = True
        if self.conn.our_state is h11.SEND_RESPONSE:
            self._send_408()
        self.transport.close()

    def _send_408(self) -> None:
        message = (
            f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
            "of its headers"
        )
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": 408}
        body = json.dumps({"error": error}).encode()
        headers = self.server_state.default_headers + [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))


class _Server(uvicorn.Server):
    """uvicorn's server, except that it does not raise the signal it shut down for again
    afterwards (uvicorn does, so that the process dies of it), so the caller returns normally;
    and it tells `watch` when a stop signal first comes and when shutdown has stopped accepting
    (before the wait for requests in flight)."""

    def __init__(self, config: uvicorn.Config, watch: _AppWatch) -> None:
        super().__init__(config)
        self.watch = watch

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self.watch.stopping()
        super().handle_exit(sig, frame)

    async def _wait_tasks_to_complete(self) -> None:
        self.watch.drain()
        await super()._wait_tasks_to_complete()

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _AppWatch:
    """Wraps the ASGI app for what uvicorn does not do.

    It keeps the exception the app's lifespan raised: uvicorn logs a start-up failure and calls
    `sys.exit(3)`, and `run_server` raises ServerStartError with this instead. An exception
    a request raises after the app was told the client is gone (a body cut off at its deadline,
    a client that hung up) is one debug line, not an error traceback: a client that sends bodies
    slowly on purpose must not be able to fill the log.

    And it ends the requests in flight at shutdown (`drain`): the app's `state.on_drain` ends
    their work (braid's app: every sample ends with finish_reason "abort", so a stream sends its
    last chunk and `[DONE]`), and from then on a response not yet started is replaced by a 503
    JSON error. `state.on_stopping` is called when the first stop signal comes.
    """

    def __init__(self, app: Any, log_requests: bool = False) -> None:
        self.app = app
        self.log_requests = log_requests  # one INFO line per request as it ends
        self.lifespan_error: BaseException | None = None
        self.draining = False

    def _hook(self, name: str) -> Callable[[], object] | None:
        return getattr(getattr(self.app, "state", None), name, None)

    def stopping(self) -> None:
        hook = self._hook("on_stopping")
        if hook is not None:
            hook()

    def drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        hook = self._hook("on_drain")
        ended = hook() if hook is not None else None
        if isinstance(ended, int) and ended:  # the samples the app ended
            logger.info("braid serve: shutting down: ended %d samples in flight", ended)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":

            async def quiet_send(message: Any) -> None:
                # The start-up failure's traceback (uvicorn would log it): run_server's
                # caller logs one line with the error instead.
                if message["type"] == "lifespan.startup.failed":
                    message = {**message, "message": ""}
                await send(message)

            try:
                await self.app(scope, receive, quiet_send)
            except BaseException as e:
                self.lifespan_error = e
                raise
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        told = False
        started = replaced = False
        status, t0 = 0, time.perf_counter()

        async def watched_receive() -> Any:
            nonlocal told
            message = await receive()
            told = told or message["type"] == "http.disconnect"
            return message

        async def watched_send(message: Any) -> None:
            nonlocal started, replaced, status
            if replaced:
                return
            if message["type"] == "http.response.start" and not started:
                if self.draining:
                    replaced, status = True, 503
                    await send_error(send, 503, SHUTTING_DOWN)
                    return
                started, status = True, message["status"]
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except asyncio.CancelledError:
            # uvicorn cancels what is left when its wait at shutdown runs out
            if not self.draining:
                raise
            logger.debug("braid serve: %s %s cancelled at shutdown", scope["method"], scope["path"])
            if not started and not replaced:
                await send_error(send, 503, SHUTTING_DOWN)
        except Exception as e:
            if not told:
                raise
            logger.debug(
                "braid serve: %s %s ended after its client left: %r",
                scope["method"],
                scope["path"],
                e,
            )
        finally:
            if self.log_requests:
                logger.info(
                    "%s %s %s %s in %.3f s%s",
                    _address(scope.get("client")),
                    scope["method"],
                    scope["path"],
                    status or "-",
                    time.perf_counter() - t0,
                    " (client left)" if told else "",
                )


def _no_startup_failure_line(record: logging.LogRecord) -> bool:
    """uvicorn's "Application startup failed. Exiting.": run_server raises ServerStartError
    with the reason, and its caller logs that."""
    return record.getMessage() != "Application startup failed. Exiting."


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound so that a taken port or a bad address fails the caller
    (`braid serve` binds before loading the model, as vLLM does: a mistake costs no load);
    not listening yet, so that clients are refused, not queued, until the app's start-up is
    done and uvicorn starts serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        why = getattr(e, "strerror", None) or e
        raise ServerStartError(f"cannot listen on {host}:{port}: {why}") from e
    return sock


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def run_server(
    app: Any,
    host: str,
    port: int,
    *,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
    keep_alive_s: float = KEEP_ALIVE_S,
    max_header_bytes: int = MAX_HEADER_BYTES,
    graceful_s: float = GRACEFUL_S,
    sock: socket.socket | None = None,
    log_requests: bool = False,
) -> None:
    """Serve the ASGI `app` on host:port (through `sock` if given, a `bind_listener` socket)
    until SIGTERM or SIGINT, then shut down and return; `log_requests` logs one line per
    request as it ends (client, method, path, status, seconds).

    Shutting down stops accepting, calls the app's `state.on_drain` if it has one (braid's app
    ends its requests in flight there: see `_AppWatch`), lets running requests finish for up to
    `graceful_s` (then cancels them) and runs the app's lifespan shutdown. An app's
    `state.on_stopping` is called as the first stop signal comes. The signal is not raised
    again, so the caller decides the exit status. A second SIGINT during the wait skips the rest
    of it and the lifespan shutdown (uvicorn's force exit).

    Raises ValueError for a bad limit and ServerStartError when the address cannot be bound
    (port in use, unknown host) or the app's lifespan start-up fails; nothing is served then.
    The limits are those of `HttpLimits`.
    """
    limits = HttpLimits(
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        keep_alive_s=keep_alive_s,
        max_header_bytes=max_header_bytes,
    )
    watch = _AppWatch(app, log_requests)
    config = uvicorn.Config(
        watch,
        host=host,
        port=port,
        http=functools.partial(LimitedH11Protocol, limits=limits),  # type: ignore[arg-type]
        ws="none",
        lifespan="on",
        log_level="warning",
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]
    )
    sock = sock if sock is not None else bind_listener(host, port)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(_no_startup_failure_line)
    try:
        _Server(config, watch).run(sockets=[sock])
    except SystemExit as e:
        if e.code != STARTUP_FAILURE:
            raise
        error = watch.lifespan_error
        reason = f": {error}" if error is not None else ""
        raise ServerStartError(f"application start-up failed{reason}") from error
    finally:
        uvicorn_log.removeFilter(_no_startup_failure_line)
        sock.close()
