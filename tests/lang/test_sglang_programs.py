"""SGLang's own frontend test programs run unchanged, with `sglang` aliased to braid, on the
embedded model as users get it (its GGUF blocks kept quantized) through each of braid's three
backends: the Engine in-process, a RuntimeEndpoint on a real `braid serve`, and the OpenAI
backend (the real `openai` client) on that same server.

The programs are `tests/lang/sglang_programs.py`, a transcription of SGLang's
`python/sglang/test/test_programs.py`; if SGLang's file itself is present
(`tests/data/sglang/test_programs.py`, not committed, or `$BRAID_SGLANG_TEST_PROGRAMS`), its
programs run too, and there only a failed assert (an answer a 135M model misses) is allowed.

What each backend covers:

- Engine: all 16 programs, through the in-process runtime: the interpreter (roles, forks and
  joins, streaming, typed and constrained gens, run_batch in both styles with its traced
  prefix cached first), program sessions, and select scoring only the choices' tokens.
- RuntimeEndpoint: all 16, the same programs over `/generate`: sessions opened and closed over
  HTTP, select scores and streaming in the server's wire format.
- OpenAI: 15, all but `test_hellaswag_select`: programs without roles on `/v1/completions` and
  with roles on `/v1/chat/completions` (mt_bench, stream, gen_min_new_tokens), SSE streaming,
  regexes, dtypes and min_tokens sent as extra body fields, select scored by echoing the prompt
  (select, react), run_batch and its traced prefix (few_shot_qa), forks (parallel_decoding,
  parallel_encoding), and the model name the programs load the tokenizer by. HellaSwag adds
  nothing of this backend's to those: its select is the echo request `test_select` makes, only
  160 of them over a 20-shot prompt (on the float model, two minutes of the OpenAI run's
  three and a half on 2 cores: echo scoring recomputes the whole prompt for every choice),
  and what else it exercises (run_batch's generator style; the precache, a no-op on this
  backend) is the program's, and runs on the other two. test_backends.py checks OpenAI's
  select scores against the Engine's.

The programs run all at once a runtime, each under `using_backend`, so the runtime batches
them: first the Engine's 16, then the server's 31 (RuntimeEndpoint's and OpenAI's together, on
its one runtime). Two runtimes are never busy at once: on two cores their torch threads fight
(every program at once took several times longer). Each test then reports one run. HellaSwag's
dataset cannot be downloaded here: a small file of the same format is put where
`download_and_cache_file` looks first.

Each program runs under `sampling_defaults(seed=...)`, a seed of its own (its name's CRC), so
what a sampling program draws does not depend on the order in which the programs running
together reach the runtime: without it, `test_gen_min_new_tokens` failed now and then (its
sampled 64-token answer sometimes re-encodes to 63 tokens, as BPE text may, and which answer
it got depended on test order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import braid as sgl
from braid.lang import sglang_alias
from braid.runtime.models.source import resolve_model
from tests.conftest import assert_kv_all_free_or_cached
from tests.lang import sglang_programs
from tests.server.conftest import start_server, wait_idle

BACKENDS = ["engine", "endpoint", "openai"]
# Backends whose programs run together: those of one runtime (the server serves two backends).
PHASES = [["engine"], ["endpoint", "openai"]]
NAMES = [p.__name__ for p in sglang_programs.PROGRAMS]
# Programs the OpenAI backend does not run, and why (the module docstring says what it covers).
OPENAI_LEAVES_OUT = {
    "test_hellaswag_select": "its select is test_select's echo request, 160 times: 2 minutes",
}
REAL_FILE = Path(
    os.environ.get("BRAID_SGLANG_TEST_PROGRAMS")
    or Path(__file__).parent.parent / "data" / "sglang" / "test_programs.py"
)


def hellaswag_lines(n: int = 20) -> list[dict]:
    """HellaSwag's format (activity_label, ctx, endings, label) with short made-up contents:
    20 lines, as many as the program's 20-shot prompt needs."""
    acts = ["Cooking", "Running", "Painting", "Swimming"]
    return [
        {
            "activity_label": acts[i % 4],
            "ctx": f"Ann starts {acts[i % 4].lower()} and",
            "endings": ["keeps going.", "flies away.", "turns blue.", "sings loudly."],
            "label": 0,
        }
        for i in range(n)
    ]


def _run_one(name, program, backend) -> tuple[BaseException | None, str, float]:
    t0 = time.perf_counter()
    try:
        seed = zlib.crc32(name.removeprefix("real:").encode())
        with sgl.using_backend(backend), sgl.sampling_defaults(seed=seed):
            program()
    except BaseException as e:  # reported by the test for this program
        return e, traceback.format_exc(), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


def _real_programs():
    if not REAL_FILE.is_file():
        return []
    spec = importlib.util.spec_from_file_location("sglang_test_programs_real", REAL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = []
    for fn in sglang_programs.PROGRAMS:
        real = getattr(module, fn.__name__, None)
        if real is not None:
            out.append(real)
    return out


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    """The default model as users get it, its GGUF blocks kept quantized, in process and behind
    one `braid serve`: its native CPU decode runs a row several times faster than the float
    model the other language tests share (whose tokens they compare across backends), and
    the longest program here decodes 650 steps one row at a time."""
    with sgl.LLM(resolve_model(None), kv_tokens=8192, show_progress=False) as llm:
        server = start_server(tmp_path_factory.mktemp("sglang-serve"))
        try:
            yield llm, server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def results(runtimes, tmp_path_factory):
    from braid.lang.backends.engine import EngineBackend

    engine, served = runtimes

    data = tmp_path_factory.mktemp("downloads")
    with open(data / "hellaswag_val.jsonl", "w") as f:
        for line in hellaswag_lines():
            f.write(json.dumps(line) + "\n")
    old = os.environ.get("BRAID_DOWNLOAD_DIR")
    os.environ["BRAID_DOWNLOAD_DIR"] = str(data)
    sglang_alias.install()
    model_path = str(engine.model_path)
    backends = {
        "engine": EngineBackend(engine),
        "endpoint": sgl.RuntimeEndpoint(served.url),
        # The model named by its path: the programs load its tokenizer from what the backend
        # says it serves (get_model_name).
        "openai": sgl.OpenAI(model_path, base_url=served.url + "/v1"),
    }
    programs = {name: fn for name, fn in zip(NAMES, sglang_programs.PROGRAMS)}
    programs.update({f"real:{fn.__name__}": fn for fn in _real_programs()})
    out = {}
    try:
        for phase in PHASES:
            runs = [(name, b) for name, b in RUNS if b in phase and name in programs]
            with ThreadPoolExecutor(len(runs)) as pool:
                futures = {
                    (name, b): pool.submit(_run_one, name, programs[name], backends[b])
                    for name, b in runs
                }
                out.update({key: f.result() for key, f in futures.items()})
    finally:
        sglang_alias.uninstall()
        if old is None:
            os.environ.pop("BRAID_DOWNLOAD_DIR", None)
        else:
            os.environ["BRAID_DOWNLOAD_DIR"] = old
    wait_idle(served.url)
    assert_kv_all_free_or_cached(engine)
    return out


def _runs() -> list[tuple[str, str]]:
    names = NAMES + ([f"real:{n}" for n in NAMES] if REAL_FILE.is_file() else [])
    return [
        (name, b)
        for name in names
        for b in BACKENDS
        if not (b == "openai" and name.removeprefix("real:") in OPENAI_LEAVES_OUT)
    ]


# (program, backend) pairs; SGLang's own file adds its programs when it is present.
RUNS = _runs()


@pytest.mark.parametrize(("program", "backend"), RUNS, ids=[f"{p}-{b}" for p, b in RUNS])
def test_sglang_program_runs_to_the_end(results, program, backend):
    error, tb, seconds = results[(program, backend)]
    if program.startswith("real:") and isinstance(error, AssertionError):
        return  # SGLang's own answer asserts need a bigger model than the embedded one
    assert error is None, f"{program} on {backend} failed after {seconds:.1f} s:\n{tb}"
