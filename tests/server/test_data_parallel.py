"""`braid serve --dp-size 2`: two real SmolLM2 workers behind SGLang's router (sglang-router,
cache-aware policy), all started and stopped by one `braid serve`: requests spread over both
workers; requests sharing a long prefix land where it is cached; a killed worker leaves
rotation while requests keep succeeding; SIGTERM leaves no process; the language's
RuntimeEndpoint works against the router. The server is started as an operator might: the
flag abbreviated (`--dp 2`), `--port 0`, and an API key from a file, which the router and
the workers both check."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import braid
from tests.server.conftest import start_server

pytest.importorskip("sglang_router", reason="--dp-size needs sglang-router (braid[router])")

KEY = "dp-test-key-5f2c"
AUTH = {"Authorization": f"Bearer {KEY}"}


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
    tmp = tmp_path_factory.mktemp("dp")
    (tmp / "key").write_text(KEY + "\n")
    flags = ("--dp", "2", "--port", "0", "--api-key-file", str(tmp / "key"))
    try:
        s = start_server(tmp, *flags, timeout=300)
    finally:
        held.close()
    s.port = int(re.search(r"ready at http://[^:]+:(\d+)", s.log()).group(1))
    workers = re.search(r"2 workers: (\S+) (\S+);", s.log()).groups()
    metrics = re.search(r"the router's metrics at (\S+)", s.log()).group(1)
    assert httpx.get(metrics, timeout=10).status_code == 200
    yield s, list(workers)
    s.stop()


def _stats(url: str) -> dict:
    return httpx.get(url + "/get_server_info", headers=AUTH).json()["stats"]


def _complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=AUTH,
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
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": msg, "max_tokens": 3},
        headers=AUTH,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(server.url + "/generate", json=body, headers=AUTH)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


def test_runtime_endpoint_programs_run_against_the_router(dp):
    server, _ = dp

    @braid.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + braid.gen("answer", max_tokens=6, temperature=0)

    endpoint = braid.RuntimeEndpoint(server.url, api_key=KEY)
    state = qa.run(question="What is the capital of France?", backend=endpoint)
    assert isinstance(state["answer"], str) and state["answer"]

    @braid.function
    def sampled(s):
        s += "Q: Name a colour.\nA:" + braid.gen("answer", max_tokens=8, temperature=1.0)

    # A seed reaches the workers through the router (which drops keys it does not know).
    seeded = {sampled.run(seed=3, backend=endpoint)["answer"] for _ in range(3)}
    assert len(seeded) == 1, seeded
    assert endpoint.flush_cache() is True


def test_the_router_and_the_workers_ask_for_the_key_which_no_command_line_shows(dp):
    """The router is given the key (it asks the workers for their model with it, and
    fans /flush_cache out with it), from its environment: no process's command line holds
    it. Without the key the router's worker list and /flush_cache refuse, as the workers'
    routes do (its /v1/models answers anyone: docs/parallelism.md)."""
    server, workers = dp
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == ["smollm2-135m"], models
    r = httpx.post(server.url + "/flush_cache", headers=AUTH)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/workers").status_code == 401
    assert httpx.post(server.url + "/flush_cache").status_code == 401
    body = {"model": "x", "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    assert httpx.get(workers[0] + "/get_server_info").status_code == 401
    tree = _descendants(server.proc.pid)
    assert len(tree) >= 3  # the router and two workers, at least
    for pid in [server.proc.pid, *tree]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), pid


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().split(")")[-1].split()[1])
            except OSError:
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def test_a_model_the_engine_refuses_ends_the_start_before_any_worker_starts():
    """The engine's checks on config.json (here: the embedded GGUF model cannot be split over
    2 tensor-parallel ranks) run before `--dp-size` starts anything: exit 2 with one line."""
    argv = [sys.executable, "-m", "braid", "serve", "--dp-size", "2", "--tp-size", "2"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor parallelism" in lines[0], out.stderr[-2000:]


def test_a_killed_worker_leaves_rotation_and_sigterm_leaves_no_process(dp):
    server, workers = dp
    pids = [httpx.get(w + "/get_server_info", headers=AUTH).json()["pids"] for w in workers]
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
