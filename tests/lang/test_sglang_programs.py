"""SGLang's own frontend test programs run unchanged, with `sglang` aliased to braid, on the
embedded model through each of braid's three backends: the Engine in-process, a
RuntimeEndpoint on a real `braid serve`, and the OpenAI backend (the real `openai` client) on
that same server.

The programs are `tests/lang/sglang_programs.py`, a transcription of SGLang's
`python/sglang/test/test_programs.py`; if SGLang's file itself is present
(`tests/data/sglang/test_programs.py`, not committed, or `$BRAID_SGLANG_TEST_PROGRAMS`), its
programs run too, and there only a failed assert (an answer a 135M model misses) is allowed.

A backend's 16 programs run at once, each under `using_backend`, so the runtime batches them
(about 1.5 minutes a backend instead of 2.5 run one by one); each test then reports one run.
HellaSwag's dataset cannot be downloaded here: a small file of the same format is put where
`download_and_cache_file` looks first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import braid as sgl
from braid.lang import sglang_alias
from tests.conftest import assert_kv_all_free_or_cached
from tests.lang import sglang_programs
from tests.server.conftest import start_server, wait_idle

BACKENDS = ["engine", "endpoint", "openai"]
NAMES = [p.__name__ for p in sglang_programs.PROGRAMS]
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("sglang-programs"))
    yield s
    s.stop()


def _run_one(program, backend) -> tuple[BaseException | None, str, float]:
    t0 = time.perf_counter()
    try:
        with sgl.using_backend(backend):
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
def results(smollm2, served, tmp_path_factory):
    from braid.lang.backends.engine import EngineBackend

    data = tmp_path_factory.mktemp("downloads")
    with open(data / "hellaswag_val.jsonl", "w") as f:
        for line in hellaswag_lines():
            f.write(json.dumps(line) + "\n")
    old = os.environ.get("BRAID_DOWNLOAD_DIR")
    os.environ["BRAID_DOWNLOAD_DIR"] = str(data)
    sglang_alias.install()
    model_path = str(smollm2.model_path)
    backends = {
        "engine": EngineBackend(smollm2),
        "endpoint": sgl.RuntimeEndpoint(served.url),
        # The model named by its path: the programs load its tokenizer from what the backend
        # says it serves (get_model_name).
        "openai": sgl.OpenAI(model_path, base_url=served.url + "/v1"),
    }
    jobs = [(fn.__name__, fn, b) for fn in sglang_programs.PROGRAMS for b in BACKENDS]
    real = [(f"real:{fn.__name__}", fn, b) for fn in _real_programs() for b in BACKENDS]
    out = {}
    try:
        # One backend at a time, its programs all at once: with every run at once the two
        # runtimes' prefills (the OpenAI backend's echo scoring above all) fight for two cores.
        for backend in BACKENDS:
            runs = [(name, fn) for name, fn, b in jobs + real if b == backend]
            with ThreadPoolExecutor(len(runs)) as pool:
                futures = {
                    (name, backend): pool.submit(_run_one, fn, backends[backend])
                    for name, fn in runs
                }
                out.update({key: f.result() for key, f in futures.items()})
    finally:
        sglang_alias.uninstall()
        if old is None:
            os.environ.pop("BRAID_DOWNLOAD_DIR", None)
        else:
            os.environ["BRAID_DOWNLOAD_DIR"] = old
    wait_idle(served.url)
    assert_kv_all_free_or_cached(smollm2)
    return out


# SGLang's own file adds its programs to the runs when it is present.
RUNS = NAMES + ([f"real:{n}" for n in NAMES] if REAL_FILE.is_file() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("program", RUNS)
def test_sglang_program_runs_to_the_end(results, program, backend):
    error, tb, seconds = results[(program, backend)]
    if program.startswith("real:") and isinstance(error, AssertionError):
        return  # SGLang's own answer asserts need a bigger model than the embedded one
    assert error is None, f"{program} on {backend} failed after {seconds:.1f} s:\n{tb}"
