"""What a hostile client broke (issue 13), each against a real `braid serve`: a request's chat
template renders in a sandbox with limits, heavy inputs never stall the event loop, a client
that leaves aborts its request, a refused request leaks no request id, cross-origin and
foreign-Host requests are refused, idle connections are closed, and a stopped scheduler shows
in /health while /metrics and /get_server_info still answer."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server, wait_idle

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
# The event loop's latency and the deadlines are wall-clock bounds: `make test` runs this file
# after the parallel part, alone (a busy neighbour once held a health check for 0.58 s).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("serve-hostile"),
        "--allow-request-chat-template",
        "--max-samples-per-request",
        "8",
        "--header-timeout",
        "2",
        "--heartbeat-timeout",
        "3",
    )
    yield s
    s.stop()


class HealthProbe:
    """A client that asks /health every 20 ms on its own thread and keeps the latencies."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                c.get(self.url + "/health")
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def worst(self) -> float:
        return max(self.latencies)


def post(url: str, body, timeout: float = 60.0) -> httpx.Response:
    if isinstance(body, bytes):
        h = {"content-type": "application/json"}
        return httpx.post(url, content=body, headers=h, timeout=timeout)
    return httpx.post(url, json=body, timeout=timeout)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def test_a_request_template_renders_in_a_sandbox_with_limits(server):
    tpl = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    ok = post(server.url + CH, {"messages": MSG, "chat_template": tpl, "max_tokens": 1})
    want = httpx.post(server.url + "/tokenize", json={"prompt": "[user] hi"}).json()["count"]
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == want
    with HealthProbe(server.url) as probe:
        t = time.perf_counter()
        huge = post(server.url + CH, {"messages": MSG, "chat_template": "{{ 'x' * 50000000 }}"})
        assert "would make 50000000" in error_of(huge, 400) and time.perf_counter() - t < 2
        loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        slow = post(server.url + CH, {"messages": MSG, "chat_template": loops})
        assert "longer than" in error_of(slow, 400)
    assert probe.worst < 0.25, probe.worst
    again = post(server.url + CH, {"messages": MSG, "chat_template": tpl, "max_tokens": 1})
    assert again.status_code == 200  # a fresh worker replaced the one that overran


def test_a_request_template_takes_chat_template_kwargs(server):
    """A request's own template (rendered in the sandbox) reads chat_template_kwargs."""
    tpl = "{% for m in messages %}{{ m.content }}{% endfor %}{% if loud %} LOUD LOUD{% endif %}"
    counts = []
    for kwargs in ({}, {"loud": True}):
        body = {"messages": MSG, "chat_template": tpl, "max_tokens": 1}
        r = post(server.url + CH, {**body, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    url = server.url + "/tokenize"
    want = [httpx.post(url, json={"prompt": t}).json()["count"] for t in ("hi", "hi LOUD LOUD")]
    assert counts == want and want[0] < want[1]


def test_reasoning_effort_reaches_a_template_that_reads_it(server):
    """OpenAI's `reasoning_effort` is a template variable (gpt-oss's template reads it): a
    template that reads it renders it; one that does not refuses it by name (it would change
    nothing), as does giving it twice."""
    tpl = "{% for m in messages %}{{ m.content }}{% endfor %} effort={{ reasoning_effort }}"
    body = {"messages": MSG, "chat_template": tpl, "max_tokens": 1}
    counts = []
    for effort in ("low", "a much longer effort level"):
        r = post(server.url + CH, {**body, "reasoning_effort": effort})
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    url = server.url + "/tokenize"
    texts = ("hi effort=low", "hi effort=a much longer effort level")
    assert counts == [httpx.post(url, json={"prompt": t}).json()["count"] for t in texts]
    plain = {**body, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    r = post(server.url + CH, {**plain, "reasoning_effort": "low"})
    assert "reasoning_effort: this model's chat template does not read it" in error_of(r, 400)
    twice = {**body, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "x"}}
    assert "given twice" in error_of(post(server.url + CH, twice), 400)


def test_heavy_inputs_do_not_block_the_event_loop(server):
    fields = [f"field_{i}" for i in range(200)]
    schema = {
        "type": "object",
        "properties": {f: {"type": "integer"} for f in fields},
        "required": fields,
    }
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": {}}},
        }
        for i in range(300)
    ]
    with HealthProbe(server.url) as probe:
        long = post(server.url + C, {"prompt": "Tell me a story. " * 600_000, "max_tokens": 1})
        assert "context length" in error_of(long, 400)
        ids = post(server.url + C, {"prompt": list(range(1000)) * 1000, "max_tokens": 1})
        assert "context length" in error_of(ids, 400)
        big = post(server.url + C, {"prompt": "{", "json_schema": schema, "max_tokens": 1})
        assert big.status_code == 200, big.text
        many = {"messages": MSG, "tools": tools, "tool_choice": "none", "max_tokens": 1}
        many = post(server.url + CH, many)
        assert many.status_code == 200, many.text
    assert probe.worst < 0.25, (probe.worst, len(probe.latencies))


def test_a_client_that_leaves_aborts_its_request(server):
    # 4000 tokens take far longer than 1.5 s on any CPU (300 did not always, on a fast one);
    # the client gives up after 1.5 s and the server stops too.
    body = {"prompt": "Tell me a story", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + C, json=body, timeout=1.5)
    stats = wait_idle(server.url, timeout=5)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]
    assert "client disconnected: aborted POST /v1/completions" in server.log()


def test_a_refused_request_leaks_no_request_id(server):
    big = {"text": "x", "rid": "leakA", "sampling_params": {"max_new_tokens": 10**20}}
    assert "64 bits" in error_of(post(server.url + G, big), 400)
    lone = b'{"text": "x", "rid": "leakA", "sampling_params": {"stop": ["\\ud800"]}}'
    assert "surrogate" in error_of(post(server.url + G, lone), 400)
    ok = post(
        server.url + G, {"text": "x", "rid": "leakA", "sampling_params": {"max_new_tokens": 1}}
    )
    assert ok.status_code == 200 and ok.json()["meta_info"]["id"] == "leakA"


def test_cross_origin_and_foreign_host_requests_are_refused(server):
    evil = {"Origin": "https://evil.example", "content-type": "text/plain"}
    r = httpx.post(server.url + "/flush_cache", content="x", headers=evil)
    assert "cross-origin" in error_of(r, 403)
    r = httpx.get(server.url + "/v1/models", headers={"Host": "evil.example"})
    assert "Host" in error_of(r, 403)
    same = httpx.post(server.url + "/flush_cache", headers={"Origin": server.url})
    assert same.status_code == 200


def test_error_shapes_and_small_things(server):
    assert "not allowed" in error_of(httpx.put(server.url + "/health"), 405)
    assert httpx.head(server.url + "/health").status_code == 200
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == card["id"] == "smollm2-135m"  # no path on the server's disk
    assert "no route" in error_of(httpx.get(server.url + "/v2/whatever"), 404)


def test_an_idle_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        t = time.perf_counter()
        assert sock.recv(1) == b""  # --header-timeout 2: closed without a word
        assert 1.5 < time.perf_counter() - t < 5


def test_a_stopped_scheduler_shows_in_health_not_in_metrics(server):
    pid = httpx.get(server.url + "/get_server_info").json()["pids"]["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.time() + 15
        while httpx.get(server.url + "/health").status_code == 200:
            assert time.time() < deadline, "health stayed 200 with the scheduler stopped"
            time.sleep(0.5)
        assert "has not reported" in error_of(httpx.get(server.url + "/health"), 503)
        t = time.perf_counter()
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200
        info = httpx.get(server.url + "/get_server_info", timeout=5).json()
        assert time.perf_counter() - t < 3 and info["stats"]["stale"] is True
        assert "has not reported" in info["problem"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.time() + 10
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.time() < deadline
        time.sleep(0.2)
    out = post(server.url + C, {"prompt": "Hi", "max_tokens": 2})
    assert out.status_code == 200 and json.loads(out.text)["usage"]["completion_tokens"] == 2


def test_a_rid_is_free_again_the_moment_its_client_leaves(server):
    # The abandoned sample's late outputs carry its own wire id: the new request with the same
    # rid gets only its own tokens.
    body = {"text": "Tell me a story", "rid": "again", "sampling_params": {"max_new_tokens": 4000}}
    body["sampling_params"]["ignore_eos"] = True
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + G, json=body, timeout=1.5)
    body["sampling_params"] = {"max_new_tokens": 2, "temperature": 0}
    out = post(server.url + G, body).json()
    assert out["meta_info"]["id"] == "again" and len(out["output_ids"]) == 2
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    wait_idle(server.url, timeout=5)


def test_host_names_a_server_answers():
    from braid.runtime.server.guard import GuardConfig, origin_problem

    def refused(bind: str, host: str, allowed: tuple[str, ...] = ()) -> bool:
        cfg = GuardConfig(bind_host=bind, allowed_hosts=allowed)
        return origin_problem(cfg, {"host": host}) is not None

    assert not refused("127.0.0.1", "localhost:30000") and not refused("127.0.0.1", "[::1]:80")
    assert refused("127.0.0.1", "api.example.com")  # a proxy passing its public Host...
    assert not refused("127.0.0.1", "api.example.com", ("api.example.com",))  # ...allowed
    assert not refused("0.0.0.0", "10.1.2.3:30000") and not refused("0.0.0.0", "[fe80::1]:1")
    assert refused("0.0.0.0", "evil.example:30000")  # a rebound domain
    assert not refused("0.0.0.0", "anything", ("*",))
