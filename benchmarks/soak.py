"""Soak (issue 13): minutes of mixed and hostile traffic against one `braid serve` on
127.0.0.1, then checks that nothing leaked.

    python benchmarks/soak.py                                  # 300 s, 16 clients
    python benchmarks/soak.py --duration-s 90 --warmup-s 20    # a short trial

What runs, in order:
1. `braid serve` starts on the embedded model with moderate limits (--kv-tokens, 8 samples
   per request, 1 MiB bodies), and a probe process asks `/health` every 50 ms until the end.
2. KV fill: random-token prompts totalling 1.1x the KV pool, so every KV page has been
   written once (the pool is allocated untouched; its first use would otherwise look like
   RSS growth).
3. Warm-up (--warmup-s of the --duration-s): the mixed traffic below; then the clients
   drain, the server goes idle and the scheduler's RSS is sampled.
4. The rest of --duration-s: the same traffic, then drain and idle again.
5. Checks: the scheduler's RSS against step 3; every rid of the pool submitted once more
   (a leaked rid would answer 400 "already in use"); every session closed; the cache
   flushed, and then every KV page must be free with no session pinned.

--concurrency clients each send one request after another, drawn by weight from: plain and
streamed completions and chats, n = 2..4, json_schema / regex / choice constrained outputs,
tools with tool_choice "required", /generate in program sessions, /generate with a rid from
a fixed pool (reused as soon as its last request ended), clients that leave mid-request
(streamed or not), /abort_request of an in-flight rid, and bad inputs (expected 4xx). Every
outcome is counted by kind and status; a 5xx, an unexpected status, a malformed or wrong
answer or a transport error is a failure.

Targets (the exit status is 1 and each miss is printed): no failure; KV back to baseline;
no rid leaked; scheduler RSS within 10% of its post-warm-up value; /health always 200 and
never slower than 100 ms. Writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, write_result  # noqa: E402
from braid.runtime.server.launcher import start_server  # noqa: E402

MAX_SAMPLES = 8  # --max-samples-per-request: n = 2..4 fits, n = 9 is a bad input
MAX_BODY = 1 << 20  # --max-request-bytes
HEALTH_LIMIT_S = 0.100
RSS_TOLERANCE = 0.10
RID_POOL = 24
SESSIONS = 8
SESSION_MAX_CHARS = 1500  # a session this long is closed and a fresh one started
# Bounds a hang, not latency: a 40-token request at batch 16 on 2 busy cores can take a minute.
REQUEST_TIMEOUT_S = 180.0
RID_BUSY_TIMEOUT_S = 15.0  # a rid still "in use" this long after its request ended is leaked

# The probe runs in its own process: a thread of this one would share its GIL and its
# (lowered) CPU priority, and would time this process's stalls as the server's.
PROBE = """
import json, sys, threading, time
import httpx
url, interval = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
samples = []
with httpx.Client(timeout=10.0) as c:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            status = c.get(url + "/health").status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        dt = time.perf_counter() - t
        samples.append([time.time(), dt, status])
        stop.wait(max(0.0, interval - dt))
json.dump(samples, sys.stdout)
"""

WEIGHTS = {
    "completion": 10,
    "completion_stream": 8,
    "chat": 6,
    "chat_stream": 10,
    "n_samples": 6,
    "json_schema": 5,
    "regex": 4,
    "choice": 4,
    "tools": 5,
    "session": 10,
    "generate_rid": 8,
    "disconnect": 8,
    "abort": 6,
    "bad_input": 10,
}

WORDS = (
    "the a river stone light market winter engine garden letter window city music paper "
    "storm quiet bright old small green north story question answer number road bridge "
    "tower forest island harbor lamp clock mirror silver copper glass wind rain cloud star "
    "field valley mountain train ship book table chair door house friend teacher doctor "
    "walks finds builds carries opens watches follows remembers writes counts sings"
).split()
PREFIXES = [
    "You are a careful assistant. Answer briefly and precisely.",
    "Here is a short story about a lighthouse keeper and the sea.",
    "Translate the following notes into plain English for a child.",
    "Summarise the list of facts below in one sentence.",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer"},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
CITIES = ["Paris", "Rome", "Oslo"]
ZONES = ["UTC", "CET"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time now in a zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ZONES}},
                "required": ["zone"],
            },
        },
    },
]
TOOL_ARGS = {"get_weather": ("city", CITIES), "get_time": ("zone", ZONES)}


class Unexpected(Exception):
    """An answer the soak counts as a failure (wrong status, malformed, wrong content)."""


@dataclass
class Bad:
    """A request the server must refuse with `status` (a GET when there is no body)."""

    name: str
    path: str
    status: int
    body: bytes | None


def bad_inputs(context_length: int) -> list[Bad]:
    c, ch, g = "/v1/completions", "/v1/chat/completions", "/generate"
    msg = [{"role": "user", "content": "hi"}]
    table: list[tuple[str, str, int, object]] = [
        ("invalid_json", c, 400, b'{"prompt": "hi", "max_tokens": '),
        ("lone_surrogate", ch, 400, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("lone_surrogate_stop", g, 400, b'{"text": "x", "sampling_params": {"stop": ["\\ud800"]}}'),
        ("huge_int", c, 400, {"prompt": "hi", "max_tokens": 10**30}),
        ("huge_int_generate", g, 400, {"text": "hi", "sampling_params": {"max_new_tokens": 2**64}}),
        ("n_over_limit", c, 400, {"prompt": "hi", "n": MAX_SAMPLES + 1, "max_tokens": 1}),
        ("unknown_route", "/v1/nothing", 404, None),
        ("wrong_method", c, 405, None),
        ("oversized_body", c, 413, {"prompt": "x" * (MAX_BODY + 1024), "max_tokens": 1}),
        ("not_utf8", c, 400, b'{"prompt": "\xff\xfe", "max_tokens": 1}'),
        ("not_an_object", g, 400, b"[1, 2, 3]"),
        ("deep_nesting", c, 400, b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("bad_grammar", c, 400, {"prompt": "x", "regex": "(a)\\1", "max_tokens": 4}),
        ("token_out_of_vocab", c, 400, {"prompt": [1, 10**6], "max_tokens": 1}),
        ("prompt_too_long", c, 400, {"prompt": [17] * (context_length + 8), "max_tokens": 1}),
        ("unknown_sampling_field", g, 400, {"text": "hi", "sampling_params": {"bogus": 1}}),
        ("negative_temperature", ch, 400, {"messages": msg, "temperature": -1}),
        ("empty_messages", ch, 400, {"messages": []}),
        ("required_without_tools", ch, 400, {"messages": msg, "tool_choice": "required"}),
        ("echo_with_stream", c, 400, {"prompt": "hi", "echo": True, "stream": True}),
        ("abort_without_rid", "/abort_request", 400, {}),
        ("rid_too_long", g, 400, {"text": "hi", "rid": "r" * 300}),
    ]

    def encode(body: object) -> bytes | None:
        return body if body is None or isinstance(body, bytes) else json.dumps(body).encode()

    return [Bad(name, path, status, encode(body)) for name, path, status, body in table]


@dataclass
class Session:
    sid: str
    text: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def expect_status(r: httpx.Response, status: int, what: str) -> None:
    if r.status_code != status:
        raise Unexpected(f"{what}: HTTP {r.status_code} (expected {status}): {r.text[:300]}")


def check_finish(finish: str | None, allowed: tuple[str, ...], what: str) -> None:
    if finish not in allowed:
        raise Unexpected(f"{what}: finish_reason {finish!r} (expected one of {allowed})")


def check_constrained(kind: str, text: str) -> None:
    """A constrained output that ended by itself must satisfy its constraint exactly."""
    if kind == "json_schema":
        try:
            obj = json.loads(text)
        except ValueError:
            raise Unexpected(f"json_schema: not JSON: {text!r}") from None
        if (
            set(obj) != {"answer", "score"}
            or obj["answer"] not in ("yes", "no")
            or type(obj["score"]) is not int
        ):
            raise Unexpected(f"json_schema: does not match the schema: {text!r}")
    elif kind == "regex" and not re.fullmatch(REGEX, text):
        raise Unexpected(f"regex: {text!r} does not match {REGEX!r}")
    elif kind == "choice" and text not in CHOICES:
        raise Unexpected(f"choice: {text!r} is not one of {CHOICES}")


def check_tool_calls(calls: list[dict], what: str) -> None:
    if not calls:
        raise Unexpected(f"{what}: finish_reason tool_calls without calls")
    for call in calls:
        name = call["function"]["name"]
        if name not in TOOL_ARGS:
            raise Unexpected(f"{what}: call of unknown tool {name!r}")
        key, allowed = TOOL_ARGS[name]
        args = json.loads(call["function"]["arguments"])
        if args.get(key) not in allowed:
            raise Unexpected(f"{what}: {name} arguments {args} do not validate")


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, context_length: int) -> None:
        self.url = url
        self.args = args
        self.context_length = context_length
        self.bad = bad_inputs(context_length)
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.failures: list[dict] = []
        self.started = time.time()
        self.rid_free: asyncio.Queue[str] = asyncio.Queue()
        for i in range(RID_POOL):
            self.rid_free.put_nowait(f"soak-rid-{i}")
        self.rid_uses = 0
        self.rid_busy_retries = 0
        self.session_gen = 0
        self.sessions: list[Session] = []
        self.session_ids: list[str] = []
        for _ in range(SESSIONS):
            self.sessions.append(self._new_session(random.Random(self.session_gen)))
        self.sessions_closed: Counter = Counter()
        self.unexpected_aborts = 0
        self.rid_left: set[str] = set()  # pool rids whose last request's client left
        self.latency: dict[str, list[float]] = defaultdict(list)
        limits = httpx.Limits(max_connections=2 * args.concurrency + 8)
        self.client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits)

    # ---- bookkeeping ----------------------------------------------------------------------
    @property
    def requests(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())

    def fail(self, kind: str, detail: str) -> None:
        self.outcomes[kind]["failed"] += 1
        self.failures.append(
            {"t_s": round(time.time() - self.started, 2), "kind": kind, "detail": detail}
        )

    def _new_session(self, rng: random.Random) -> Session:
        self.session_gen += 1
        sid = f"soak-session-{self.session_gen}"
        self.session_ids.append(sid)
        return Session(sid, self.prompt(rng, 12))

    def prompt(self, rng: random.Random, words: int | None = None) -> str:
        n = words if words is not None else rng.randint(4, 40)
        return f"{rng.choice(PREFIXES)} {' '.join(rng.choices(WORDS, k=n))}"

    def messages(self, rng: random.Random) -> list[dict]:
        msgs = [{"role": "user", "content": self.prompt(rng)}]
        if rng.random() < 0.3:
            msgs = [
                {"role": "system", "content": rng.choice(PREFIXES)},
                *msgs,
                {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=6))},
                {"role": "user", "content": "And then?"},
            ]
        return msgs

    def sampling(self, rng: random.Random, lo: int = 1, hi: int = 16) -> dict:
        out = {"max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 0.7, 1.0])}
        if rng.random() < 0.3:
            out["seed"] = rng.randrange(1 << 31)
        return out

    async def lease_rid(self) -> str:
        rid = await self.rid_free.get()
        self.rid_uses += 1
        return rid

    def release_rid(self, rid: str, left: bool = False) -> None:
        """Back to the pool at once (`left`: its client left; the server may still hold it)."""
        (self.rid_left.add if left else self.rid_left.discard)(rid)
        self.rid_free.put_nowait(rid)

    # ---- HTTP -----------------------------------------------------------------------------
    async def post(self, path: str, body: dict) -> httpx.Response:
        return await self.client.post(self.url + path, json=body)

    async def post_rid(self, path: str, body: dict) -> httpx.Response:
        """POST a body with a pool rid; a rid the server still holds from a request whose
        client just left is retried until RID_BUSY_TIMEOUT_S."""
        deadline = time.monotonic() + RID_BUSY_TIMEOUT_S
        while True:
            r = await self.post(path, body)
            if r.status_code != 400 or "already in use" not in r.text:
                return r
            self.rid_busy_retries += 1
            if time.monotonic() > deadline:
                raise Unexpected(f"rid {body['rid']} still in use after {RID_BUSY_TIMEOUT_S} s")
            await asyncio.sleep(0.2)

    async def sse(
        self,
        path: str,
        body: dict,
        leave_after: int | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> tuple[list, bool]:
        """The events of a stream and whether it ended with [DONE]; with `leave_after`, the
        client disconnects after that many events; `on_event` is called after each."""
        events: list[dict] = []
        async with self.client.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                expect_status(r, 200, path)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return events, True
                events.append(json.loads(line[6:]))
                if on_event is not None:
                    on_event()
                if leave_after is not None and len(events) >= leave_after:
                    return events, False
        return events, False

    async def sse_rid(
        self,
        body: dict,
        leave_after: int | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> tuple[list, bool]:
        """`sse` on /generate with a pool rid, retried as `post_rid` does."""
        deadline = time.monotonic() + RID_BUSY_TIMEOUT_S
        while True:
            try:
                return await self.sse("/generate", body, leave_after, on_event)
            except Unexpected as e:
                if "already in use" not in str(e):
                    raise
                self.rid_busy_retries += 1
                if time.monotonic() > deadline:
                    raise Unexpected(
                        f"rid {body['rid']} still in use after {RID_BUSY_TIMEOUT_S} s"
                    ) from None
                await asyncio.sleep(0.2)

    # ---- answers --------------------------------------------------------------------------
    def openai_full(self, r: httpx.Response, n: int, chat: bool, what: str) -> list[dict]:
        expect_status(r, 200, what)
        choices = r.json()["choices"]
        if len(choices) != n:
            raise Unexpected(f"{what}: {len(choices)} choices, expected {n}")
        for c in choices:
            if "error" in c:
                raise Unexpected(f"{what}: choice failed: {c['error']}")
            allowed = ("stop", "length", "tool_calls") if chat else ("stop", "length")
            check_finish(c["finish_reason"], allowed, what)
        return choices

    def openai_stream(self, events: list, done: bool, n: int, chat: bool, what: str) -> dict:
        """Reassemble a stream: {index: (text, finish_reason, tool_calls)}."""
        if not done:
            raise Unexpected(f"{what}: the stream ended without [DONE]")
        text: dict[int, str] = defaultdict(str)
        finish: dict[int, str] = {}
        calls: dict[int, dict[int, dict]] = defaultdict(dict)
        for ev in events:
            for c in ev["choices"]:
                if "error" in c:
                    raise Unexpected(f"{what}: stream failed: {c['error']}")
                i = c["index"]
                if chat:
                    delta = c.get("delta", {})
                    text[i] += delta.get("content") or ""
                    for tc in delta.get("tool_calls") or []:
                        if tc.get("id") is not None:
                            calls[i][tc["index"]] = {
                                "function": {"name": tc["function"]["name"], "arguments": ""}
                            }
                        slot = calls[i][tc["index"]]["function"]
                        slot["arguments"] += tc["function"].get("arguments") or ""
                else:
                    text[i] += c.get("text", "")
                if c.get("finish_reason"):
                    finish[i] = c["finish_reason"]
        if sorted(finish) != list(range(n)):
            raise Unexpected(f"{what}: finish reasons for {sorted(finish)}, expected 0..{n - 1}")
        return {i: (text[i], finish[i], [calls[i][k] for k in sorted(calls[i])]) for i in range(n)}

    def native(self, out: dict, rid: str, what: str, allowed: tuple[str, ...]) -> str:
        meta = out["meta_info"]
        if meta["id"] != rid:
            raise Unexpected(f"{what}: meta_info.id {meta['id']!r}, expected {rid!r}")
        finish = meta["finish_reason"]["type"] if meta["finish_reason"] else None
        if finish == "abort" and "abort" not in allowed:
            self.unexpected_aborts += 1
            if rid in self.rid_left:
                raise Unexpected(
                    f"{what}: rid {rid} reused right after its client left a request got "
                    f"finish_reason abort and {meta['completion_tokens']} token(s) "
                    f"({out['text']!r}): the left request's output"
                )
        check_finish(finish, allowed, f"{what} {rid}")
        return finish

    # ---- the kinds ------------------------------------------------------------------------
    async def completion(self, rng: random.Random) -> str:
        body = {"prompt": self.prompt(rng), **self.sampling(rng)}
        self.openai_full(await self.post("/v1/completions", body), 1, False, "completion")
        return "200"

    async def completion_stream(self, rng: random.Random) -> str:
        body = {"prompt": self.prompt(rng), "stream": True, **self.sampling(rng)}
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        events, done = await self.sse("/v1/completions", body)
        self.openai_stream(events, done, 1, False, "completion_stream")
        return "200"

    async def chat(self, rng: random.Random) -> str:
        body = {"messages": self.messages(rng), **self.sampling(rng)}
        self.openai_full(await self.post("/v1/chat/completions", body), 1, True, "chat")
        return "200"

    async def chat_stream(self, rng: random.Random) -> str:
        body = {"messages": self.messages(rng), "stream": True, **self.sampling(rng)}
        events, done = await self.sse("/v1/chat/completions", body)
        self.openai_stream(events, done, 1, True, "chat_stream")
        return "200"

    async def n_samples(self, rng: random.Random) -> str:
        n = rng.randint(2, 4)
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"n": n, **self.sampling(rng, 1, 12), "temperature": 0.8}
        body.update({"messages": self.messages(rng)} if chat else {"prompt": self.prompt(rng)})
        if rng.random() < 0.5:
            body["stream"] = True
            events, done = await self.sse(path, body)
            self.openai_stream(events, done, n, chat, f"n={n}")
            return "200 streamed"
        self.openai_full(await self.post(path, body), n, chat, f"n={n}")
        return "200"

    async def _constrained(self, rng: random.Random, kind: str, extra: dict, chat: bool) -> str:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {**self.sampling(rng, 12, 16), **extra}
        body.update({"messages": self.messages(rng)} if chat else {"prompt": self.prompt(rng)})
        if rng.random() < 0.3:
            body["stream"] = True
            events, done = await self.sse(path, body)
            text, finish, _ = self.openai_stream(events, done, 1, chat, kind)[0]
        else:
            c = self.openai_full(await self.post(path, body), 1, chat, kind)[0]
            text, finish = (
                (c["message"]["content"] or "") if chat else c["text"],
                c["finish_reason"],
            )
        if finish == "stop":
            check_constrained(kind, text)
        return f"200 {finish}"

    async def json_schema(self, rng: random.Random) -> str:
        fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
        return await self._constrained(rng, "json_schema", {"response_format": fmt}, chat=True)

    async def regex(self, rng: random.Random) -> str:
        return await self._constrained(rng, "regex", {"regex": REGEX}, chat=False)

    async def choice(self, rng: random.Random) -> str:
        return await self._constrained(rng, "choice", {"choice": CHOICES}, chat=rng.random() < 0.5)

    async def tools(self, rng: random.Random) -> str:
        # The forced call text is ~20 tokens: 40 lets most calls finish.
        body = {
            "messages": [{"role": "user", "content": f"Weather or time in {rng.choice(CITIES)}?"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": rng.random() < 0.5,
            "max_tokens": 40,
            "temperature": rng.choice([0.0, 0.7]),
        }
        if rng.random() < 0.4:
            body["stream"] = True
            events, done = await self.sse("/v1/chat/completions", body)
            _, finish, calls = self.openai_stream(events, done, 1, True, "tools")[0]
        else:
            c = self.openai_full(await self.post("/v1/chat/completions", body), 1, True, "tools")
            finish, calls = c[0]["finish_reason"], c[0]["message"].get("tool_calls") or []
        check_finish(finish, ("tool_calls", "length"), "tools")
        if finish == "tool_calls":
            check_tool_calls(calls, "tools")
        return f"200 {finish}"

    async def session(self, rng: random.Random) -> str:
        free = [s for s in self.sessions if not s.lock.locked()]
        if not free:
            return f"all sessions busy: completion {await self.completion(rng)}"
        s = rng.choice(free)
        async with s.lock:
            rid = await self.lease_rid()
            try:
                body = {
                    "text": s.text,
                    "rid": rid,
                    "session_id": s.sid,
                    "sampling_params": {"max_new_tokens": rng.randint(4, 16), "temperature": 0.7},
                }
                if rng.random() < 0.3:
                    body["stream"] = True
                    events, done = await self.sse_rid(body)
                    if not done or not events:
                        raise Unexpected("session: the stream ended without [DONE]")
                    out = events[-1]
                else:
                    r = await self.post_rid("/generate", body)
                    expect_status(r, 200, "session")
                    out = r.json()
                self.native(out, rid, "session", ("stop", "length"))
            finally:
                self.release_rid(rid)
            s.text += out["text"] + " " + " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            if len(s.text) > SESSION_MAX_CHARS:
                await self.close_session(s.sid)
                fresh = self._new_session(rng)
                s.sid, s.text = fresh.sid, fresh.text
        return "200"

    async def close_session(self, sid: str) -> None:
        r = await self.post("/close_session", {"session_id": sid})
        expect_status(r, 200, "close_session")
        self.sessions_closed["closed" if r.json()["success"] else "not pinned"] += 1

    async def generate_rid(self, rng: random.Random) -> str:
        rid = await self.lease_rid()
        try:
            body = {
                "text": self.prompt(rng),
                "rid": rid,
                "sampling_params": {"max_new_tokens": rng.randint(1, 16), "temperature": 0.7},
            }
            if rng.random() < 0.4:
                body["stream"] = True
                events, done = await self.sse_rid(body)
                if not done or not events:
                    raise Unexpected("generate_rid: the stream ended without [DONE]")
                self.native(events[-1], rid, "generate_rid", ("stop", "length"))
                return "200 streamed"
            r = await self.post_rid("/generate", body)
            expect_status(r, 200, "generate_rid")
            self.native(r.json(), rid, "generate_rid", ("stop", "length"))
            return "200"
        finally:
            self.release_rid(rid)

    async def disconnect(self, rng: random.Random) -> str:
        """A client that leaves mid-request; its rid (if any) goes straight back to the pool."""
        long = {"max_tokens": rng.randint(24, 48), "ignore_eos": True}
        way = rng.choice(["stream", "full", "generate", "generate_stream"])
        if way == "stream":
            body = {"prompt": self.prompt(rng), "stream": True, **long}
            _, done = await self.sse("/v1/completions", body, leave_after=rng.randint(1, 4))
            return "finished first" if done else "left a stream"
        if way == "full":
            body = {"messages": self.messages(rng), **long}
            try:
                r = await asyncio.wait_for(
                    self.post("/v1/chat/completions", body), rng.uniform(0.05, 2.0)
                )
            except TimeoutError:
                return "left"
            self.openai_full(r, 1, True, "disconnect")
            return "finished first"
        rid = await self.lease_rid()
        left = False
        try:
            sp = {"max_new_tokens": long["max_tokens"], "ignore_eos": True}
            body = {"text": self.prompt(rng), "rid": rid, "sampling_params": sp}
            if way == "generate_stream":
                body["stream"] = True
                events, done = await self.sse_rid(body, leave_after=rng.randint(1, 3))
                if done:
                    self.native(events[-1], rid, "disconnect", ("stop", "length"))
                    return "finished first"
                left = True
                return "left a rid stream"
            try:
                r = await asyncio.wait_for(self.post_rid("/generate", body), rng.uniform(0.05, 2.0))
            except TimeoutError:
                left = True
                return "left a rid"
            expect_status(r, 200, "disconnect")
            self.native(r.json(), rid, "disconnect", ("stop", "length"))
            return "finished first"
        finally:
            self.release_rid(rid, left)

    async def abort(self, rng: random.Random) -> str:
        """/abort_request of an in-flight rid: it must end with finish_reason abort (or have
        finished before the abort came)."""
        rid = await self.lease_rid()
        try:
            sp = {"max_new_tokens": rng.randint(32, 64), "ignore_eos": True}
            body = {"text": self.prompt(rng), "rid": rid, "sampling_params": sp}
            streamed = rng.random() < 0.5
            if streamed:
                body["stream"] = True
                first = asyncio.Event()

                async def consume() -> tuple[list, bool]:
                    try:
                        return await self.sse_rid(body, on_event=first.set)
                    finally:
                        first.set()

                task = asyncio.create_task(consume())
                try:
                    await asyncio.wait_for(first.wait(), REQUEST_TIMEOUT_S)
                    # The request is in the scheduler now: the abort must reach it.
                    await asyncio.sleep(rng.uniform(0.0, 1.0))
                    expect_status(await self.post("/abort_request", {"rid": rid}), 200, "abort")
                    events, done = await task
                finally:
                    if not task.done():
                        task.cancel()
                if not done or not events:
                    raise Unexpected("abort: the stream ended without [DONE]")
                out = events[-1]
            else:
                task = asyncio.create_task(self.post_rid("/generate", body))
                try:
                    await asyncio.sleep(rng.uniform(0.1, 1.5))
                    expect_status(await self.post("/abort_request", {"rid": rid}), 200, "abort")
                    r = await task
                finally:
                    if not task.done():
                        task.cancel()
                expect_status(r, 200, "abort")
                out = r.json()
            finish = self.native(out, rid, "abort", ("abort", "length"))
            label = "aborted" if finish == "abort" else "finished before the abort"
            return f"{label} (streamed)" if streamed else label
        finally:
            self.release_rid(rid)

    async def bad_input(self, rng: random.Random) -> str:
        bad = rng.choice(self.bad)
        headers = {"content-type": "application/json"}
        method = "GET" if bad.body is None else "POST"
        try:
            r = await self.client.request(
                method, self.url + bad.path, content=bad.body, headers=headers
            )
        except httpx.TransportError as e:
            # A refusal the client cannot read (the connection reset under it) fails too.
            raise Unexpected(f"bad input {bad.name}: {type(e).__name__}: {e}") from None
        if r.status_code != bad.status:
            raise Unexpected(f"bad input {bad.name}: HTTP {r.status_code}, expected {bad.status}")
        if "error" not in r.json():
            raise Unexpected(f"bad input {bad.name}: no error object in {r.text[:200]}")
        return f"{bad.name} {r.status_code}"

    # ---- driving --------------------------------------------------------------------------
    async def run_one(self, kind: str, rng: random.Random) -> None:
        fn: Callable = getattr(self, kind)
        t0 = time.perf_counter()
        try:
            label = await fn(rng)
        except Unexpected as e:
            self.fail(kind, str(e))
        except httpx.TimeoutException as e:
            self.fail(kind, f"no answer within {REQUEST_TIMEOUT_S:.0f} s ({type(e).__name__})")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as e:
            self.fail(kind, f"{type(e).__name__}: {e}")
        else:
            self.outcomes[kind][label] += 1
            self.latency[kind].append(time.perf_counter() - t0)

    async def worker(self, index: int, until: float, phase: int) -> None:
        rng = random.Random(f"{self.args.seed}/{phase}/{index}")
        names, weights = list(WEIGHTS), list(WEIGHTS.values())
        while time.monotonic() < until:
            await self.run_one(rng.choices(names, weights)[0], rng)

    async def traffic(self, seconds: float, phase: int, bar: tqdm) -> None:
        until = time.monotonic() + seconds

        async def tick() -> None:
            while True:
                await asyncio.sleep(1.0)
                bar.update(1)
                bar.set_postfix(requests=self.requests, failed=len(self.failures))

        ticker = asyncio.create_task(tick())
        try:
            await asyncio.gather(
                *(self.worker(i, until, phase) for i in range(self.args.concurrency))
            )
        finally:
            ticker.cancel()

    async def stats(self) -> dict:
        r = await self.client.get(self.url + "/get_server_info")
        expect_status(r, 200, "get_server_info")
        return r.json()["stats"]

    async def wait_idle(self, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = await self.stats()
            if s["running_requests"] == 0 and s["queued_requests"] == 0 and not s.get("stale"):
                return s
            if time.monotonic() > deadline:
                raise Unexpected(f"the server did not go idle within {timeout:.0f} s: {s}")
            await asyncio.sleep(0.25)

    async def fill_kv(self, capacity: int, vocab: int) -> dict:
        """Write every KV page once: distinct random-token prompts totalling 1.1x the pool."""
        rng = random.Random(self.args.seed)
        length = min(2048, self.context_length - 2)
        count = math.ceil(1.1 * capacity / length)
        t0 = time.perf_counter()
        for start in range(0, count, 2):
            batch = [
                [rng.randrange(100, vocab) for _ in range(length)]
                for _ in range(min(2, count - start))
            ]
            rs = await asyncio.gather(
                *(self.post("/v1/completions", {"prompt": p, "max_tokens": 1}) for p in batch)
            )
            for r in rs:
                expect_status(r, 200, "KV fill")
        return {"prompts": count, "prompt_len": length, "seconds": time.perf_counter() - t0}

    async def rid_check(self) -> list[str]:
        """Submit every pool rid once more; returns those that did not answer 200."""
        leaked = []
        for i in range(RID_POOL):
            rid = f"soak-rid-{i}"
            body = {"text": "x", "rid": rid, "sampling_params": {"max_new_tokens": 1}}
            r = await self.post("/generate", body)
            if r.status_code != 200 or r.json()["meta_info"]["id"] != rid:
                leaked.append(f"{rid}: HTTP {r.status_code} {r.text[:200]}")
        return leaked


def scheduler_rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


async def settled_rss(pid: int) -> int:
    """The scheduler's RSS once it has been idle for a while (no request, no control message):
    an idle scheduler gives the heap its work freed back to the OS after 0.5 s."""
    await asyncio.sleep(1.5)
    return scheduler_rss(pid)


def server_log_summary(log: str) -> dict:
    lines = log.splitlines()
    tracebacks = [i for i, x in enumerate(lines) if x.startswith("Traceback")]
    errors = [x for x in lines if " ERROR " in x or "ERROR:" in x]
    warnings = [x for x in lines if " WARNING " in x or "WARNING:" in x]
    disconnects = sum("client disconnected" in x for x in lines)
    return {
        "lines": len(lines),
        "tracebacks": len(tracebacks),
        "first_traceback": "\n".join(lines[tracebacks[0] : tracebacks[0] + 30])
        if tracebacks
        else None,
        "errors": len(errors),
        "first_errors": errors[:10],
        "warnings": len(warnings),
        "warning_kinds": Counter(
            re.sub(r"\d+", "N", x.split(" ", 3)[-1])[:80] for x in warnings
        ).most_common(10),
        "client_disconnect_lines": disconnects,
    }


def health_summary(samples: list, phases: dict[str, tuple[float, float]]) -> dict:
    lat = [s[1] for s in samples]
    bad = [s for s in samples if s[2] != 200]
    slow = sorted((s for s in samples if s[1] > HEALTH_LIMIT_S), key=lambda s: -s[1])
    t0 = samples[0][0] if samples else 0.0

    def phase_of(t: float) -> str:
        return next((name for name, (a, b) in phases.items() if a <= t < b), "between phases")

    by_phase = {}
    for name, (a, b) in phases.items():
        xs = [s[1] for s in samples if a <= s[0] < b]
        by_phase[name] = {
            "samples": len(xs),
            "max_ms": 1e3 * max(xs) if xs else None,
            "p99_ms": 1e3 * pct(xs, 99) if xs else None,
            "over_100ms": sum(x > HEALTH_LIMIT_S for x in xs),
        }
    return {
        "interval_ms": 50,
        "samples": len(samples),
        "max_ms": 1e3 * max(lat) if lat else None,
        "p50_ms": 1e3 * pct(lat, 50),
        "p99_ms": 1e3 * pct(lat, 99),
        "p999_ms": 1e3 * pct(lat, 99.9),
        "over_100ms": len(slow),
        "not_200": len(bad),
        "not_200_examples": [{"t_s": s[0] - t0, "status": s[2]} for s in bad[:10]],
        "slowest": [
            {"t_s": round(s[0] - t0, 2), "ms": round(1e3 * s[1], 1), "phase": phase_of(s[0])}
            for s in slow[:20]
        ],
        "by_phase": by_phase,
    }


async def soak(url: str, args: argparse.Namespace, info: dict, probe_t0: float) -> dict:
    pid = info["pids"]["scheduler"]
    capacity = int(info["kv_capacity_tokens"])
    s = Soak(url, args, int(info["context_length"]))
    phases: dict[str, tuple[float, float]] = {}
    rss_series = []
    warmup = min(args.warmup_s, args.duration_s / 2)

    async def sample_rss() -> None:
        while True:
            rss_series.append([round(time.time() - probe_t0, 1), scheduler_rss(pid)])
            await asyncio.sleep(10.0)

    sampler = asyncio.create_task(sample_rss())
    try:
        t = time.time()
        fill = await s.fill_kv(capacity, int(info.get("vocab_size") or 49152))
        phases["kv fill"] = (t, time.time())
        print(
            f"KV fill: {fill['prompts']} x {fill['prompt_len']} tokens in {fill['seconds']:.1f} s"
        )
        with tqdm(total=int(args.duration_s), unit="s", desc="soak") as bar:
            t = time.time()
            await s.traffic(warmup, 0, bar)
            warm_idle = await s.wait_idle()
            phases["warm-up"] = (t, time.time())
            rss_warm = await settled_rss(pid)
            t = time.time()
            await s.traffic(args.duration_s - warmup, 1, bar)
            end_idle = await s.wait_idle()
            phases["soak"] = (t, time.time())
        rss_end = await settled_rss(pid)
        t = time.time()
        traffic_s = phases["soak"][1] - phases["warm-up"][0]
        leaked = await s.rid_check()
        for sid in s.session_ids:
            await s.close_session(sid)
        before_flush = await s.wait_idle()
        flush = await s.client.post(url + "/flush_cache")
        after_flush = await s.wait_idle()
        phases["checks"] = (t, time.time())
    finally:
        sampler.cancel()
        await s.client.aclose()
    kv_ok = (
        flush.status_code == 200
        and after_flush["kv_free_tokens"] == after_flush["kv_capacity_tokens"]
        and after_flush["kv_cached_tokens"] == 0
        and after_flush["pinned_sessions"] == 0
        and before_flush["kv_free_tokens"] + before_flush["kv_cached_tokens"]
        == before_flush["kv_capacity_tokens"]
    )
    return {
        "soak": s,
        "phases": phases,
        "fill": fill,
        "traffic_s": traffic_s,
        "rss": {
            "warm_bytes": rss_warm,
            "end_bytes": rss_end,
            "change": (rss_end - rss_warm) / rss_warm,
            "series_s_bytes": rss_series,
        },
        "rids": {
            "pool": RID_POOL,
            "uses": s.rid_uses,
            "busy_retries": s.rid_busy_retries,
            "leaked": leaked,
        },
        "kv": {
            "ok": kv_ok,
            "flush_status": flush.status_code,
            "idle_after_warmup": warm_idle,
            "idle_at_end": end_idle,
            "before_flush": before_flush,
            "after_flush": after_flush,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=300.0, help="traffic, warm-up included")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="traffic before the RSS baseline")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()

    flags = [
        "--host",
        "127.0.0.1",
        "--max-samples-per-request",
        str(MAX_SAMPLES),
        "--max-request-bytes",
        str(MAX_BODY),
    ]
    log_dir = tempfile.mkdtemp(prefix="braid-soak-")
    server = start_server(log_dir, *flags, kv_tokens=args.kv_tokens)
    probe = None
    try:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        model = httpx.get(server.url + "/get_model_info", timeout=30).json()
        info["vocab_size"] = model["vocab_size"]
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, server.url, "0.05"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        probe_t0 = time.time()
        # The clients share the 2 cores with the server under test; real clients run
        # elsewhere, so this process yields the CPU to braid's (the probe keeps its priority).
        os.nice(10)
        result = asyncio.run(soak(server.url, args, info, probe_t0))
    finally:
        samples = []
        if probe is not None:
            out, _ = probe.communicate("", timeout=30)
            samples = json.loads(out) if out else []
        alive = server.proc.poll() is None
        log = server.log()
        server.stop()

    s: Soak = result["soak"]
    health = health_summary(samples, result["phases"])
    logs = server_log_summary(log)
    rss = result["rss"]
    targets = {
        "no failed request": (not s.failures, f"{len(s.failures)} failed"),
        "KV back to baseline": (
            result["kv"]["ok"],
            f"after flush {result['kv']['after_flush']['kv_free_tokens']:.0f} of "
            f"{result['kv']['after_flush']['kv_capacity_tokens']:.0f} tokens free, "
            f"{result['kv']['after_flush']['pinned_sessions']:.0f} sessions pinned",
        ),
        "no rid leaked": (not result["rids"]["leaked"], f"{len(result['rids']['leaked'])} leaked"),
        "scheduler RSS within 10%": (
            abs(rss["change"]) <= RSS_TOLERANCE,
            f"{rss['warm_bytes'] / 2**20:.0f} -> {rss['end_bytes'] / 2**20:.0f} MiB "
            f"({100 * rss['change']:+.1f}%)",
        ),
        "/health always 200, never over 100 ms": (
            health["not_200"] == 0 and health["max_ms"] is not None and health["max_ms"] <= 100,
            f"max {health['max_ms'] or float('nan'):.1f} ms, {health['over_100ms']} over 100 ms, "
            f"{health['not_200']} not 200 of {health['samples']}",
        ),
        "server alive, no traceback in its log": (
            alive and logs["tracebacks"] == 0,
            f"alive {alive}, {logs['tracebacks']} tracebacks",
        ),
    }

    by_kind = {k: dict(sorted(c.items())) for k, c in sorted(s.outcomes.items())}
    print(
        f"\n{s.requests} requests in {result['traffic_s']:.0f} s "
        f"({s.requests / result['traffic_s']:.1f}/s), concurrency {args.concurrency}"
    )
    for kind, labels in by_kind.items():
        if kind != "bad_input":
            print(f"  {kind:>17}: " + ", ".join(f"{k} {v}" for k, v in labels.items()))
    bad_total = Counter()
    for label, v in by_kind.get("bad_input", {}).items():
        bad_total[label.rsplit(" ", 1)[-1] if label != "failed" else "failed"] += v
    print(f"  {'bad_input':>17}: " + ", ".join(f"{k} {v}" for k, v in sorted(bad_total.items())))
    print(f"rids: {s.rid_uses} uses of {RID_POOL}, {s.rid_busy_retries} busy retries")
    print(f"sessions: {len(s.session_ids)} used, close results {dict(s.sessions_closed)}")
    print(
        f"/health: {health['samples']} probes, p50 {health['p50_ms']:.1f} ms, "
        f"p99 {health['p99_ms']:.1f} ms, max {health['max_ms'] or float('nan'):.1f} ms"
    )
    for f in s.failures[:10]:
        print(f"  failure at {f['t_s']} s [{f['kind']}]: {f['detail']}")
    missed = []
    for name, (met, detail) in targets.items():
        print(f"{'met' if met else 'MISSED':>6}  {name}: {detail}")
        if not met:
            missed.append(name)

    write_result(
        "soak",
        str(info["device"]).split(":")[0],
        args.out,
        {
            "model": info.get("model_path") or "smollm2-135m (embedded)",
            "server_flags": [*flags, "--max-total-tokens", str(args.kv_tokens)],
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "weights": WEIGHTS,
            "kv_fill": result["fill"],
            "requests": s.requests,
            "requests_per_s": s.requests / result["traffic_s"],
            "outcomes": by_kind,
            "latency_s": {
                k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99), "max": max(v)}
                for k, v in sorted(s.latency.items())
            },
            "failures": len(s.failures),
            "failure_examples": s.failures[:50],
            "unexpected_aborts": s.unexpected_aborts,
            "rids": result["rids"],
            "sessions": {"used": len(s.session_ids), "close": dict(s.sessions_closed)},
            "kv": result["kv"],
            "scheduler_rss": rss,
            "health": health,
            "server_log": logs,
            "targets": {name: {"met": met, "detail": d} for name, (met, d) in targets.items()},
        },
    )
    if missed:
        print("targets missed: " + "; ".join(missed))
        sys.exit(1)


if __name__ == "__main__":
    main()
