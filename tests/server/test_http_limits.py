"""`run_server` against raw sockets: deadlines for slow clients, keep-alive, header size, and how
the process ends. The app runs in a subprocess (tests/server/http_limits_app.py) with 1 s header
and body deadlines, a 0.6 s keep-alive and a 4 KiB header limit."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h11
import httpx
import pytest

from braid.runtime.server.http import ServerStartError, run_server
from braid.runtime.server.launcher import free_port

from .http_limits_app import create_app

ROOT = Path(__file__).resolve().parents[2]
# Deadlines measured in wall-clock time: `make test` runs this file alone, after the rest.
pytestmark = pytest.mark.serial
TIMEOUT = 1.0  # header and body deadline the app is started with
KEEP_ALIVE = 0.6
MAX_HEADER_BYTES = 4096
LIMIT_FLAGS = (
    *("--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT)),
    *("--keep-alive", str(KEEP_ALIVE), "--max-header-bytes", str(MAX_HEADER_BYTES)),
)
WAIT = 4.0  # how long a test waits for the server to close a connection


def launch(log_path: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    """The test app on a free port, ready; its stdout and stderr go to `log_path`."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.server.http_limits_app", "--port", str(port)]
            + [*LIMIT_FLAGS, *flags],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + 30
    while proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=1).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("test server did not come up in 30 s")
        time.sleep(0.05)
    raise AssertionError(f"test server exited with {proc.returncode}: {log_path.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> tuple[int, Path]:
    log_path = tmp_path_factory.mktemp("http-limits") / "server.log"
    proc, port = launch(log_path)
    yield port, log_path
    proc.kill()
    proc.wait(5)


@pytest.fixture
def port(server) -> int:
    return server[0]


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails if it is still open after WAIT."""
    data = b""
    sock.settimeout(WAIT)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"connection still open after {WAIT} s; got {data!r}") from None
        if not chunk:
            return data
        data += chunk


def drip_until_closed(sock: socket.socket, every: float = 0.2) -> float:
    """Sends one header byte every `every` s (never ending the headers); returns when closed."""
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    start = time.monotonic()
    sock.settimeout(every)
    while time.monotonic() - start < WAIT:
        try:
            sock.sendall(b"a")
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
    raise AssertionError(f"a dripping client kept the connection open for {WAIT} s")


def exchange(
    sock: socket.socket, conn: h11.Connection, method: str, target: str, body: bytes = b""
) -> tuple[int, bytes]:
    headers = [("Host", "x"), ("Content-Length", str(len(body)))]
    sock.sendall(conn.send(h11.Request(method=method, target=target, headers=headers)))
    sock.sendall(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    status, data = None, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            data += event.data
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status, data


def assert_closed_near(elapsed: float, limit: float) -> None:
    assert 0.7 * limit <= elapsed <= limit + 1.0, f"closed after {elapsed:.2f} s, limit {limit} s"


def test_connection_that_sends_nothing_is_closed_at_the_header_deadline(port):
    with connect(port) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        assert_closed_near(time.monotonic() - start, TIMEOUT)


def test_headers_that_stall_halfway_are_closed_without_a_response(port):
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        assert read_until_closed(sock) == b""
        assert_closed_near(time.monotonic() - start, TIMEOUT)


def test_headers_dripped_a_byte_at_a_time_are_closed_at_the_deadline(port):
    # each byte would reset an idle timer; the header deadline counts from the connection
    with connect(port) as sock:
        assert_closed_near(drip_until_closed(sock), TIMEOUT)


@pytest.mark.parametrize(
    "head, partial_body",
    [
        (b"Transfer-Encoding: chunked", b"5\r\nhello\r\n"),
        (b"Content-Length: 100", b"hello"),
    ],
    ids=["chunked", "content-length"],
)
def test_body_that_never_finishes_gets_408_and_a_close(port, head, partial_body):
    with connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n" + partial_body)
        start = time.monotonic()
        data = read_until_closed(sock)
        assert_closed_near(time.monotonic() - start, TIMEOUT)
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head_bytes.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 408 and error["param"] is None
    assert "body" in error["message"]


def test_keep_alive_reuse_works_and_a_stalled_next_request_is_closed(port):
    conn = h11.Connection(h11.CLIENT)
    with connect(port) as sock:
        # the header deadline restarts after each response: the second request comes after the
        # first deadline would have passed, then the third request's headers are left half sent
        time.sleep(0.85 * TIMEOUT)
        assert exchange(sock, conn, "POST", "/echo", b"one") == (200, b"one")
        time.sleep(0.5 * KEEP_ALIVE)
        assert exchange(sock, conn, "POST", "/echo", b"two") == (200, b"two")
        start = time.monotonic()
        sock.sendall(b"GET /ping HTTP/1.1\r\nHo")
        assert read_until_closed(sock) == b""
        assert_closed_near(time.monotonic() - start, TIMEOUT)


def test_idle_keep_alive_connection_closes_at_the_keep_alive_timeout(port):
    conn = h11.Connection(h11.CLIENT)
    with connect(port) as sock:
        assert exchange(sock, conn, "GET", "/ping")[0] == 200
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        elapsed = time.monotonic() - start
    assert elapsed < 0.5 * (KEEP_ALIVE + TIMEOUT), f"closed after {elapsed:.2f} s"


def test_a_slow_app_is_not_cut_off_by_the_deadlines(port):
    r = httpx.get(f"http://127.0.0.1:{port}/sleep", params={"s": 1.5 * TIMEOUT}, timeout=WAIT)
    assert r.status_code == 200 and r.json() == {"slept": 1.5 * TIMEOUT}


def test_headers_over_the_limit_get_400(port):
    big = {"X-Big": "a" * (MAX_HEADER_BYTES + 1000)}
    assert httpx.get(f"http://127.0.0.1:{port}/ping", headers=big).status_code == 400
    assert httpx.get(f"http://127.0.0.1:{port}/ping", headers={"X-Small": "a"}).status_code == 200


def test_unfinished_headers_over_the_limit_get_400(port):
    with connect(port) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1000))
        assert read_until_closed(sock).startswith(b"HTTP/1.1 400 ")


def test_a_cut_off_body_is_one_log_line_not_a_traceback(server):
    port, log_path = server
    with connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
    time.sleep(0.3)  # the app reads the disconnect and gives up
    log = log_path.read_text()
    assert "POST /echo from 127.0.0.1" in log and "body not complete within 1 s" in log
    assert "Traceback" not in log


def test_sigterm_shuts_down_and_the_process_exits_0(tmp_path):
    log_path = tmp_path / "server.log"
    proc, port = launch(log_path)
    try:
        with connect(port):  # an idle connection must not hold up the shutdown
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == 0, log_path.read_text()
    assert log_path.read_text().splitlines()[-1] == "stopped"


def test_lifespan_failure_raises_server_start_error():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.server.http_limits_app", "--port", str(free_port())]
        + ["--fail-startup"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last == "start-up failed: application start-up failed: weights not found"
    # The reason once, as the caller says it: not uvicorn's traceback and exit line too.
    assert "Traceback" not in proc.stderr and "Exiting" not in proc.stderr, proc.stderr


def test_port_in_use_raises_server_start_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"cannot listen on 127.0.0.1:{port}"):
            run_server(create_app(), "127.0.0.1", port)
