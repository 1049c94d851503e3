"""`braid serve --dp-size 2`: two real SmolLM2 workers behind SGLang's router (sglang-router,
cache-aware policy), all started and stopped by one `braid serve`: requests spread over both
workers; requests sharing a long prefix land where it is cached; a killed worker leaves
rotation while requests keep succeeding; SIGTERM leaves no process; the language's
RuntimeEndpoint works against the router."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import braid
from tests.server.conftest import start_server

pytest.importorskip("sglang_router", reason="--dp-size needs sglang-router (braid[router])")


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    # The router's default metrics port (29000) is held by another process, as by a second
    # server on the machine: braid gives its router a free one.
    held = socket.socket()
    try:
        held.bind(("0.0.0.0", 29000))
        held.listen()
    except OSError:
        pass  # in use already, which is the case to test
    try:
        s = start_server(tmp_path_factory.mktemp("dp"), "--dp-size", "2", timeout=300)
    finally:
        held.close()
    workers = re.search(r"2 workers: (\S+) (\S+);", s.log()).groups()
    metrics = re.search(r"the router's metrics at (\S+)", s.log()).group(1)
    assert httpx.get(metrics, timeout=10).status_code == 200
    yield s, list(workers)
    s.stop()


def _stats(url: str) -> dict:
    return httpx.get(url + "/get_server_info").json()["stats"]


def _complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_spread_over_both_workers(dp):
    server, workers = dp
    before = [_stats(w)["finished_requests"] for w in workers]
    prompts = [
        f"Request {i}: {'abcdefghij'[i % 10] * (3 + i)} tell me a number." for i in range(16)
    ]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: _complete(server.url, p), prompts))
    done = [_stats(w)["finished_requests"] - b for w, b in zip(workers, before)]
    assert sum(done) == 16 and min(done) >= 2, done


def test_requests_sharing_a_long_prefix_go_where_it_is_cached(dp):
    server, workers = dp
    shared = "You are a careful assistant who answers in one word. " * 30
    _complete(server.url, shared + "First question?")
    before = [_stats(w)["cached_prompt_tokens"] for w in workers]
    for i in range(6):
        _complete(server.url, shared + f"Question number {i}?")
    cached = [_stats(w)["cached_prompt_tokens"] - b for w, b in zip(workers, before)]
    # Every follow-up found the shared prefix in the one worker that had computed it.
    assert max(cached) >= 6 * 250 and min(cached) == 0, cached


def test_chat_through_the_router(dp):
    """The router adds its own fields to each chat and /generate body it forwards (at their
    defaults); the workers, whose bodies are closed, take them."""
    server, _ = dp
    msg = [{"role": "user", "content": "Say hi."}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msg, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


def test_runtime_endpoint_programs_run_against_the_router(dp):
    server, _ = dp

    @braid.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + braid.gen("answer", max_tokens=6, temperature=0)

    endpoint = braid.RuntimeEndpoint(server.url)
    state = qa.run(question="What is the capital of France?", backend=endpoint)
    assert isinstance(state["answer"], str) and state["answer"]


def test_a_killed_worker_leaves_rotation_and_sigterm_leaves_no_process(dp):
    server, workers = dp
    pids = [httpx.get(w + "/get_server_info").json()["pids"] for w in workers]
    os.kill(pids[1]["server"], signal.SIGKILL)
    # The supervisor notices and takes it out of the router (then says so).
    server.wait_for_log("worker-1 is out of the router's rotation", timeout=20)
    for i in range(8):
        assert _complete(server.url, f"After the kill, request {i}.")["choices"]
    assert "worker-1 exited" in server.log()
    logs = re.search(r"logs in (\S+)\)", server.log()).group(1)
    server.stop()
    assert server.proc.returncode == 0
    # A clean exit leaves no log directory behind (one per start piled up in /tmp).
    assert not os.path.exists(logs), logs
    everyone = [p for ps in pids for p in ps.values()]
    deadline = time.time() + 10
    while any(_alive(p) for p in everyone) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in everyone)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
