"""`braid serve` stopping with requests in flight: each client gets a clean ending, the log a
line, not a traceback per request."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time

import httpx

from tests.server.conftest import start_server

C = "/v1/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}


def _in_flight(url: str, streamed: int, whole_: int) -> tuple[list, list[threading.Thread]]:
    """Start `streamed` + `whole_` long completions in threads; returns their results (filled
    when each ends: ("stream", data payloads) or ("whole", status, body)) and the threads,
    once the scheduler runs them all."""
    results: list = []

    def stream() -> None:
        with httpx.stream("POST", url + C, json={**LONG, "stream": True}, timeout=60) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        results.append(("stream", r.status_code, data))

    def whole() -> None:
        r = httpx.post(url + C, json=LONG, timeout=60)
        results.append(("whole", r.status_code, r.text))

    threads = [threading.Thread(target=stream) for _ in range(streamed)]
    threads += [threading.Thread(target=whole) for _ in range(whole_)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while httpx.get(url + "/get_server_info").json()["stats"]["running_requests"] < len(threads):
        assert time.time() < deadline, "the requests did not all start"
        time.sleep(0.2)
    return results, threads


def _assert_ended_cleanly(results: list, n: int) -> None:
    assert len(results) == n, results
    for kind, status, body in results:
        if kind == "whole":
            assert status == 503, body
            error = json.loads(body)["error"]
            assert error["message"] == "the server is shutting down"
            assert error["type"] == "server_error" and error["code"] == 503
        else:
            assert status == 200 and body[-1] == "[DONE]", body[-3:]
            last = json.loads(body[-2])["choices"][0]
            assert last["finish_reason"] == "abort", last
            assert last["error"]["message"] == "the server is shutting down"


def _stop_with_requests_in_flight(s, streamed: int, whole: int, stop) -> str:
    """`stop()` the server while `streamed` + `whole` requests run; checks it exited 0 and
    each request ended cleanly; its log."""
    results, threads = _in_flight(s.url, streamed=streamed, whole_=whole)
    stop()
    s.proc.wait(20)
    for t in threads:
        t.join(10)
    log = s.log()
    assert s.proc.returncode == 0, log
    _assert_ended_cleanly(results, streamed + whole)
    return log


def test_sigterm_ends_requests_in_flight_with_a_503_or_an_abort_chunk(tmp_path):
    s = start_server(tmp_path)
    try:
        log = _stop_with_requests_in_flight(s, 3, 3, lambda: s.proc.send_signal(signal.SIGTERM))
        assert "shutting down: ended 6 samples in flight" in log
        assert "Traceback" not in log and "shut down cleanly" in log
    finally:
        s.stop()


def test_ctrl_c_to_the_process_group_exits_0_without_tracebacks(tmp_path, monkeypatch):
    # A terminal's Ctrl-C sends SIGINT to every process of the group: server and children.
    monkeypatch.setattr(
        subprocess, "Popen", functools.partial(subprocess.Popen, start_new_session=True)
    )
    # The template sandbox's process is in the group too.
    s = start_server(tmp_path, "--allow-request-chat-template")
    try:
        log = _stop_with_requests_in_flight(s, 2, 1, lambda: os.killpg(s.proc.pid, signal.SIGINT))
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert "runtime failure" not in log and "shut down cleanly" in log
    finally:
        s.stop()


def test_health_turning_bad_and_back_logs_once_each(caplog):
    import asyncio
    from pathlib import Path

    from braid.runtime.config import EngineConfig
    from braid.runtime.ipc.to_tokenizer import SchedulerHeartbeat
    from braid.runtime.tokenizer.manager import TokenizerManager

    async def run() -> None:
        tm = TokenizerManager(EngineConfig(), Path("."), frozenset(), spawn=None)  # type: ignore[arg-type]
        tm.ready = object()  # type: ignore[assignment]
        tm.heartbeat = SchedulerHeartbeat({}, 0.1)
        now = asyncio.get_running_loop().time()
        tm._beat_at = now
        assert tm.problem(10.0) is None
        tm._beat_at = now - 20
        assert tm.problem(10.0) and tm.problem(10.0)
        tm._beat_at = now
        assert tm.problem(10.0) is None and tm.problem(10.0) is None

    with caplog.at_level("INFO", logger="braid"):
        asyncio.run(run())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in lines] == ["WARNING", "INFO"], lines
    assert "has not reported" in lines[0][1] and "healthy again" in lines[1][1]
