"""The streamed path under load: a reader that lags gets the outputs that arrived meanwhile as
one (texts, tokens and logprobs intact), many concurrent streams reassemble to the non-streamed
answers, and start-up reports its phases and keeps Triton's kernels under braid's cache dir."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import openai
import pytest

import braid
from braid.runtime.server.launcher import start_server
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = build_tiny_constrained_model(tmp_path_factory.mktemp("tiny") / "llama")
    return path


@pytest.fixture(scope="module")
def tiny_server(tiny_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BRAID_CACHE_DIR", str(cache))
        env.delenv("TRITON_CACHE_DIR", raising=False)
        env.setenv("BRAID_OVERLAP_STARTUP", "1")  # the runtime starts before the tokenizer loads
        s = start_server(tmp_path_factory.mktemp("serve"), "--model", str(tiny_dir))
    s.cache_dir = cache
    yield s
    s.stop()


def _environ(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().split(b"\0")


def test_lagging_reader_gets_the_outputs_since_its_last_read_as_one(tiny_dir):
    with braid.LLM(str(tiny_dir), kv_tokens=4096, show_progress=False) as llm:
        params = braid.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        expected = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]

        async def read_late() -> list:
            tm = llm.tm
            (rid,) = tm.submit("late", [5, 6, 7, 8], params)
            pending = tm._pending[tm._wire[rid]]
            for _ in range(1200):  # nothing is read until the sample has finished
                if pending.finished:
                    break
                await asyncio.sleep(0.05)
            return [out async for out in tm.stream(rid)]

        outs = llm.run_coroutine(read_late()).result(60)
    assert len(outs) == 1, [len(o.token_ids) for o in outs]
    (out,) = outs
    assert out.finish_reason == "length"
    assert out.token_ids == list(expected.token_ids)
    assert out.text == expected.text
    assert out.completion_tokens == 24
    assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_concurrent_streams_reassemble_to_the_whole_answers(tiny_server):
    """64 streams at once on a model whose steps take about a millisecond: the front end lags,
    so a chunk may carry several tokens; every stream still spells the non-streamed text, its
    logprobs cover every token, and its usage counts them."""
    url = f"{tiny_server.url}/v1"
    n, max_tokens = 64, 48
    prompts = [f"hello world {i} " * 3 for i in range(n)]

    async def run():
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        common = dict(model="m", max_tokens=max_tokens, temperature=0, logprobs=1)
        extra = {"ignore_eos": True}

        async def streamed(p):
            stream = await client.completions.create(
                prompt=p,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
                **common,
            )
            text, tokens, chunks, usage, finish = "", [], 0, None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    chunks += 1
                    text += c.text
                    if c.logprobs is not None:
                        tokens += c.logprobs.tokens
                    finish = c.finish_reason or finish
            return text, tokens, chunks, usage, finish

        results = await asyncio.gather(*(streamed(p) for p in prompts))
        whole = await asyncio.gather(
            *(client.completions.create(prompt=p, extra_body=extra, **common) for p in prompts)
        )
        await client.close()
        return results, whole

    results, whole = asyncio.run(run())
    for (text, tokens, _, usage, finish), w in zip(results, whole):
        assert text == w.choices[0].text
        assert finish == "length"
        assert usage.completion_tokens == max_tokens
        assert "".join(tokens) == "".join(w.choices[0].logprobs.tokens)
        assert len(tokens) == max_tokens


def _ready_line(server) -> str:
    return next(x for x in server.log().splitlines() if "ready at http://" in x)


def test_ready_line_reports_startup_phases(tiny_server):
    line = _ready_line(tiny_server)
    pattern = (
        r"in ([\d.]+) s: imports ([\d.]+) s, runtime ([\d.]+) s \(scheduler: process start "
        r"([\d.]+) s, load ([\d.]+) s \[(.*)\]; "
        r"alongside: server imports ([\d.]+) s, tokenizer ([\d.]+) s\), server ([\d.]+) s"
    )
    m = re.search(pattern, line)
    assert m, line
    total, imports, runtime, started, load = map(float, m.groups()[:5])
    server_imports, tokenizer, server = map(float, m.groups()[6:])
    # One after the other: imports, the runtime (the server's own imports and the tokenizer
    # load meanwhile), the server.
    # Each figure is printed to 0.01 s and a process's start is read in clock ticks (10 ms):
    # sums may pass the whole by that much.
    assert 0 < imports + runtime + server <= total + 0.05
    assert 0 < started + load <= runtime + 0.03
    assert 0 < server_imports + tokenizer <= runtime + 0.03
    # The scheduler's load, split: its parts add up to it.
    parts = dict(re.fullmatch(r"([a-z ]+) ([\d.]+) s", p).groups() for p in m[6].split(", "))
    assert list(parts) == ["weights", "kv cache", "rest"], parts  # CPU: no graphs
    assert abs(sum(map(float, parts.values())) - load) < 0.03


def test_the_runtime_starts_before_the_front_end_imports_torch():
    """What `braid serve` does before it starts the runtime's processes (its CLI, the model's
    resolution, the tokenizer manager and the spawn function) imports no torch: the runtime's
    processes import it themselves while the front end does the rest of its start-up (on the
    H200 machine the front end's imports took 4-6 s of every start, most of it torch)."""
    code = (
        "import sys\n"
        "from braid.runtime.server import cli\n"
        "from braid.runtime.assets import ModelAssets\n"
        "from braid.runtime.launch import spawn_runtime\n"
        "from braid.runtime.tokenizer.manager import TokenizerManager\n"
        "ModelAssets.load(None, with_tokenizer=False)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[:500]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_triton_cache_is_under_braids_cache_dir(tiny_server):
    pids = httpx.get(f"{tiny_server.url}/get_server_info").json()["pids"]
    want = f"TRITON_CACHE_DIR={tiny_server.cache_dir / 'triton'}".encode()
    assert want in _environ(pids["scheduler"])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_users_triton_cache_dir_is_kept_and_phases_run_in_turn(tiny_dir, tmp_path, monkeypatch):
    """A user's TRITON_CACHE_DIR is what the runtime sees; with the start-up overlap off
    (BRAID_OVERLAP_STARTUP=0) the tokenizer is a phase of its own, before the runtime's."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("BRAID_OVERLAP_STARTUP", "0")
    s = start_server(tmp_path, "--model", str(tiny_dir), kv_tokens=2048)
    try:
        pids = httpx.get(f"{s.url}/get_server_info").json()["pids"]
        assert f"TRITON_CACHE_DIR={tmp_path / 'mine'}".encode() in _environ(pids["scheduler"])
        line = _ready_line(s)
    finally:
        s.stop()
    pattern = (
        r"in ([\d.]+) s: imports ([\d.]+) s, tokenizer ([\d.]+) s, runtime ([\d.]+) s "
        r"\(scheduler: process start [\d.]+ s, load ([\d.]+) s \[[^]]*\]\), server ([\d.]+) s"
    )
    m = re.search(pattern, line)
    assert m, line
    total, imports, tokenizer, runtime, load, server = map(float, m.groups())
    assert 0 < imports + tokenizer + runtime + server <= total + 0.05
    assert load <= runtime and "alongside" not in line


def test_a_port_in_use_ends_serve_with_a_message_and_no_runtime_left(tiny_dir, tmp_path):
    """serve binds its port before the runtime starts (it used to find a taken port only
    after the model loaded): it says so, exits 2 without loading the model, and leaves none
    of the runtime's processes behind."""
    import os
    import socket
    import subprocess
    import uuid

    import psutil

    mark = f"BRAID_TEST_MARK={uuid.uuid4().hex}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "BRAID_TEST_MARK": mark.split("=", 1)[1], "BRAID_OVERLAP_STARTUP": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "braid", "serve", "--model", str(tiny_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=tmp_path,
        )
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert "KV cache" not in run.stderr, run.stderr[-3000:]  # the model was not loaded
    left = []
    for p in psutil.process_iter():
        try:
            if mark.encode() in b"\0".join(_environ(p.pid)):
                left.append(p)
        except (OSError, psutil.Error):
            continue
    assert not left, [p.cmdline() for p in left]
