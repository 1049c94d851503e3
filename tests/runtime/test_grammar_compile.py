"""Grammars compile off the scheduler's critical path: a constrained request waits (unadmitted)
while its grammar compiles and other requests keep running; a compile that fails or overruns
its time limit fails that request alone, with a clear message, and the runtime keeps serving
with no KV slot lost; an overrunning compile's worker process is killed, so no CPU keeps
burning, and workers die with their parent. Runs on a tiny random Llama with a real byte-level
BPE tokenizer, where `\\w{0,500}` (every Unicode word character, 500 times) takes seconds to
compile with outlines-core, the backend these tests use (it compiles in workers); llguidance
compiles on the pool's threads (tests/runtime/test_grammar_backends.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from braid import SamplingParams
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler, PendingGrammars, _Worker
from braid.runtime.constrained.grammar import GrammarCompiler, thread_cap
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

SLOW = r"\w{0,500}"  # seconds to compile on the tiny vocabulary
SLOWER = r"\w{0,1000}"  # several seconds: far longer than a short request on the tiny model
# Its automaton has 2**18 states: several seconds and hundreds of MB on the tiny vocabulary,
# and far longer on a real one (issue 13 saw (a|b)*a(a|b){14} run ~50 s on SmolLM2's).
PATHOLOGICAL = "(a|b)*a(a|b){17}"
PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-grammar"))


@pytest.fixture
def pools():
    """Grammar compile pools a test starts; their workers are shut down after it, so no compile
    it leaves running burns CPU under the next test."""
    started: list[AsyncGrammarCompiler] = []
    yield started
    for pool in started:
        pool.shutdown()


@pytest.fixture
def make_scheduler(tiny, pools):
    def make(**config):
        path, eos = tiny
        sched = local_scheduler(
            path, frozenset({eos}), kv_tokens=2048, grammar_backend="outlines", **config
        )
        pools.append(sched.grammars.waiting.compiler)
        # Load the vocabulary first, so that time limits measure compiles alone.
        sched.grammars.waiting.compiler.submit("regex", "warm").result()
        return sched

    return make


def _drain(sched) -> tuple[dict[str, list[int]], dict[str, str], dict[str, str]]:
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    errors: dict[str, str] = {}
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
            if out.error:
                errors[out.rid] = out.error
        sched.check_invariants()
    return ids, finish, errors


FREE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def free_alone(tiny):
    sched = local_scheduler(
        tiny[0], frozenset({tiny[1]}), kv_tokens=2048, grammar_backend="outlines"
    )
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    return run_to_end(sched)["free"]


def test_overrunning_compile_fails_with_a_clear_error_and_serving_continues(
    tiny, make_scheduler, free_alone
):
    sched = make_scheduler(grammar_compile_timeout_s=0.3)
    sched.handle(GenerateReq("slow", PROMPT, SamplingParams(regex=SLOW, max_tokens=4), 0))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    ids, finish, errors = _drain(sched)
    assert finish["slow"] == "abort" and ids.get("slow", []) == []
    assert "regex: grammar compilation timed out after 0.3 s" in errors["slow"]
    assert "--grammar-compile-timeout" in errors["slow"]
    assert finish["free"] == "length" and ids["free"] == free_alone
    # The runtime keeps serving constrained requests (a fresh worker took over).
    yes_no = SamplingParams(temperature=1.0, seed=3, max_tokens=8, regex="(yes|no)")
    sched.handle(GenerateReq("after", PROMPT, yes_no, 3))
    ids, finish, errors = _drain(sched)
    assert finish["after"] == "stop" and not errors
    assert re.fullmatch("(yes|no)", load_tokenizer(tiny[0]).decode(ids["after"][:-1]))
    usage = sched.usage()
    assert usage["kv_free_tokens"] + usage["kv_cached_tokens"] == usage["kv_capacity_tokens"]


def test_compile_error_fails_just_that_request(make_scheduler, free_alone):
    sched = make_scheduler()
    # Python's re accepts a backreference; outlines-core cannot build an automaton for it.
    sched.handle(GenerateReq("bad", PROMPT, SamplingParams(regex=r"(a)\1", max_tokens=4), 0))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    ok = SamplingParams(temperature=1.0, seed=1, max_tokens=8, choice=["red", "green"])
    sched.handle(GenerateReq("ok", PROMPT, ok, 1))
    ids, finish, errors = _drain(sched)
    assert finish["bad"] == "abort" and "regex: cannot be compiled" in errors["bad"]
    assert finish["free"] == "length" and ids["free"] == free_alone
    assert finish["ok"] == "stop" and "ok" not in errors


def test_free_request_runs_while_a_grammar_compiles(make_scheduler, free_alone):
    sched = make_scheduler()
    slow = SamplingParams(temperature=1.0, seed=2, max_tokens=6, regex=SLOWER)
    sched.handle(GenerateReq("slow", PROMPT, slow, 2))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    free_ids: list[int] = []
    steps = steps_while_compiling = 0
    while True:
        compiling = [r.rid for r in sched.grammars] == ["slow"]
        outs = {o.rid: o for o in sched.step()}
        steps += 1
        free = outs["free"]  # the free request gains a token at every step
        free_ids += free.new_token_ids
        steps_while_compiling += compiling
        if free.finish_reason:
            break
    # One prefill and 11 decodes, as when alone, all while the other grammar compiled.
    assert free_ids == free_alone and steps == len(free_alone) == steps_while_compiling
    assert [r.rid for r in sched.grammars] == ["slow"]
    ids, finish, errors = _drain(sched)
    assert finish["slow"] in ("stop", "length") and not errors and 1 <= len(ids["slow"]) <= 6


def test_abort_while_waiting_for_a_grammar(make_scheduler):
    sched = make_scheduler()
    sched.handle(GenerateReq("slow", PROMPT, SamplingParams(regex=SLOW, max_tokens=4), 0))
    outs = sched.handle(AbortReq("slow"))
    assert [(o.rid, o.finish_reason) for o in outs] == [("slow", "abort")]
    assert not sched.has_work
    sched.check_invariants()


def _outs(sched) -> dict[str, dict]:
    """Step until idle: each request's tokens, finish reason, error and refusal."""
    got: dict[str, dict] = {}
    while sched.has_work:
        for out in sched.step():
            r = got.setdefault(out.rid, {"ids": [], "error": None, "refused": None})
            r["ids"] += out.new_token_ids
            r["finish"] = out.finish_reason or r.get("finish")
            r["error"] = out.error or r["error"]
            r["refused"] = out.refused or r["refused"]
        sched.check_invariants()
    return got


NOTHING = {  # compile, but admit no output
    "ref": ("json_schema", {"$ref": "#"}),
    "enum": ("json_schema", {"enum": []}),
    "regex": ("regex", "[^\\x00-\\U0010FFFF]"),
    "ebnf": ("ebnf", 'root ::= root "a"'),
}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_constraint_that_admits_no_output_is_refused_before_it_runs(
    tiny, pools, free_alone, backend
):
    sched = local_scheduler(tiny[0], frozenset({tiny[1]}), kv_tokens=2048, grammar_backend=backend)
    pools.append(sched.grammars.waiting.compiler)
    for again in (False, True):  # the second time from the grammar cache, refused the same
        hits = sched.grammar_compiler.hits if again else 0
        for i, (rid, (kind, spec)) in enumerate(NOTHING.items()):
            params = SamplingParams(max_tokens=4, **{kind: spec})
            sched.handle(GenerateReq(rid, PROMPT, params, i))
        sched.handle(GenerateReq("free", PROMPT, FREE, 0))
        got = _outs(sched)
        for rid, (kind, _) in NOTHING.items():
            r = got[rid]
            assert r["finish"] == "abort" and r["ids"] == [], (rid, r)
            assert r["refused"] is not None and r["refused"].param == kind, (rid, r)
            assert r["error"].startswith(f"{kind}: the constraint matches no output"), r
        assert got["free"]["ids"] == free_alone and got["free"]["error"] is None
        if again:  # the enum is refused while compiling (not cached): the others are hits
            assert sched.grammar_compiler.hits >= hits + 3
    usage = sched.usage()
    assert usage["kv_free_tokens"] + usage["kv_cached_tokens"] == usage["kv_capacity_tokens"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_failing_mid_generation_fails_its_request_with_one_short_line(
    tiny, pools, free_alone, caplog, temperature
):
    # 1000 properties: llguidance's parser passes its per-step limit after the `{`, and its
    # error then dumps its state and the grammar (tens of kB).
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    sched = local_scheduler(
        tiny[0], frozenset({tiny[1]}), kv_tokens=2048, grammar_backend="llguidance"
    )
    pools.append(sched.grammars.waiting.compiler)
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=8, json_schema=wide)
    sched.handle(GenerateReq("wide", PROMPT, params, 5))
    sched.handle(GenerateReq("free", PROMPT, FREE, 0))
    with caplog.at_level("WARNING", logger="braid"):
        got = _outs(sched)
    r = got["wide"]
    assert r["finish"] == "abort" and r["refused"] is None, r
    assert r["error"].startswith("grammar: token ") and "max is" in r["error"], r["error"]
    assert len(r["error"]) < 400 and "\n" not in r["error"], r["error"]
    lines = [rec.getMessage() for rec in caplog.records if "wide" in rec.getMessage()]
    assert len(lines) == 1 and "json_schema grammar failed mid-generation" in lines[0], lines
    assert got["free"]["ids"] == free_alone
    usage = sched.usage()
    assert usage["kv_free_tokens"] + usage["kv_cached_tokens"] == usage["kv_capacity_tokens"]


# ---- the pool itself -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tokenizer(tiny):
    return load_tokenizer(tiny[0])


@pytest.fixture
def make_pool(tiny_tokenizer, pools):
    def make(workers: int = 2, built: list | None = None) -> AsyncGrammarCompiler:
        def make_compiler() -> GrammarCompiler:
            if built is not None:
                built.append(time.monotonic())
            return GrammarCompiler(tiny_tokenizer, "outlines")

        pool = AsyncGrammarCompiler(make_compiler, workers=workers)
        pools.append(pool)
        return pool

    return make


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[pid] = t.user + t.system
    return out


def _busy_cpu_seconds(window_s: float = 1.0) -> float:
    """CPU time this process and its descendants use over `window_s` (while this thread
    sleeps), counting the processes alive throughout."""
    me = psutil.Process()
    pids = [me.pid, *(p.pid for p in me.children(recursive=True))]
    before = _cpu_seconds(pids)
    time.sleep(window_s)
    after = _cpu_seconds(pids)
    return sum(after[p] - before[p] for p in after if p in before)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _collect(pending, until, timeout_s: float = 10.0) -> tuple[list, list]:
    """Poll `pending`, gathering what is ready and what failed, until `until(ready, failed)`
    or `timeout_s` (a time limit is enforced when polled, so no fixed sleep can be sure)."""
    ready, failed = [], []
    deadline = time.monotonic() + timeout_s
    while not until(ready, failed) and time.monotonic() < deadline:
        pending.wait(0.05)
        more_ready, more_failed = pending.poll()
        ready, failed = ready + more_ready, failed + more_failed
    return ready, failed


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_identical_specs_share_one_compile_and_a_cached_one_is_ready_at_once(make_pool):
    pool = make_pool()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = pool.submit("json_schema", schema)
    same = pool.submit("json_schema", dict(reversed(list(schema.items()))))
    assert same is first or same.result() is first.result()
    grammar = first.result(timeout=30)
    again = pool.submit("json_schema", schema)
    assert again.done() and again.result() is grammar
    assert pool.compiler.misses == 1


def test_compile_error_fails_its_future_naming_the_field(make_pool):
    pool = make_pool()
    with pytest.raises(ValueError, match="regex: cannot be compiled"):
        pool.submit("regex", r"(?=a)a").result(timeout=30)
    with pytest.raises(ValueError, match="choice: must be a non-empty list"):
        pool.submit("choice", []).result(timeout=30)
    assert pool.submit("regex", "a+").result(timeout=30) is not None


def test_workers_start_with_the_first_compile_and_stay_warm(make_pool):
    built: list[float] = []
    pool = make_pool(built=built)
    time.sleep(0.2)
    assert pool.worker_pids == [] and built == [] and pool.compiler is None
    pool.submit("regex", "warm").result(timeout=30)
    assert _wait_for(lambda: len(pool.worker_pids) == 2, 10)
    warm = pool.worker_pids
    for i in range(4):
        pool.submit("regex", f"(yes|no){i}").result(timeout=30)
    assert pool.worker_pids == warm and len(built) == 1


def test_an_overrunning_compile_is_killed_and_the_next_one_compiles_promptly(make_pool):
    pool = make_pool(workers=1)
    pool.submit("regex", "warm").result(timeout=30)
    [worker] = pool.worker_pids
    pending: PendingGrammars[str] = PendingGrammars(pool, timeout_s=0.5)
    pending.add("slow", "regex", PATHOLOGICAL)
    shared = pool.submit("regex", PATHOLOGICAL)  # the same compile, shared
    ready, failed = _collect(pending, lambda ready, failed: failed)
    assert ready == [] and failed[0][0] == "slow" and "timed out after 0.5 s" in failed[0][1]
    with pytest.raises(ValueError, match="regex: grammar compilation timed out"):
        shared.result(timeout=0)  # whoever shares the compile fails with it
    # The worker is gone, and nothing here keeps compiling the abandoned grammar.
    assert _wait_for(lambda: _gone(worker), 5)
    time.sleep(0.5)  # let the replacement worker finish starting
    assert _busy_cpu_seconds() < 0.3
    t0 = time.monotonic()
    pending.add("quick", "regex", "(yes|no)")
    while not ready and time.monotonic() - t0 < 5:
        pending.wait(0.05)
        ready, failed = pending.poll()
    assert [item for item, _ in ready] == ["quick"] and not failed
    assert worker not in pool.worker_pids


def test_the_time_limit_counts_from_when_a_worker_starts_the_compile_not_while_queued(make_pool):
    pool = make_pool(workers=1)
    pool.submit("regex", "warm").result(timeout=30)
    pending: PendingGrammars[str] = PendingGrammars(pool, timeout_s=0.5)
    pending.add("slow", "regex", PATHOLOGICAL)
    pending.add("quick", "regex", "(yes|no) queued")  # behind it: one worker
    # Quick waits in the queue until slow is killed, 0.5 s after slow started (longer than
    # its own limit), and still compiles.
    ready, failed = _collect(pending, lambda ready, failed: ready)
    assert [item for item, _ in failed] == ["slow"]
    assert [item for item, _ in ready] == ["quick"]


def test_a_worker_that_dies_fails_its_compile_and_is_replaced(make_pool):
    pool = make_pool(workers=1)
    pool.submit("regex", "warm").result(timeout=30)
    [worker] = pool.worker_pids
    fut = pool.submit("regex", PATHOLOGICAL)
    time.sleep(0.3)
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(ValueError, match="regex: grammar compilation failed: .*SIGKILL"):
        fut.result(timeout=10)
    assert pool.submit("regex", "(yes|no)").result(timeout=10) is not None
    assert len(pool.worker_pids) == 1 and worker not in pool.worker_pids


_PARENT = """
import sys, time
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.tokenizer.tokenizer import load_tokenizer

tokenizer = load_tokenizer(sys.argv[1])
pool = AsyncGrammarCompiler(lambda: GrammarCompiler(tokenizer, "outlines"), workers=2)
pool.submit("regex", "warm").result()
pool.submit("regex", sys.argv[2])
while len(pool.worker_pids) < 2:
    time.sleep(0.05)
time.sleep(0.3)
print(*pool.worker_pids, flush=True)
time.sleep(600)
"""


def test_workers_die_with_a_killed_parent(tiny):
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tiny[0]), PATHOLOGICAL],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2 and not any(_gone(pid) for pid in workers)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_for(lambda: all(_gone(pid) for pid in workers), 5)


def test_the_time_limit_is_a_validated_config_field_and_a_serve_flag():
    from braid.runtime.config import EngineConfig
    from braid.runtime.server.cli import build_parser

    for bad in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
            EngineConfig(grammar_compile_timeout_s=bad)
    args = build_parser().parse_args(
        ["serve", "--grammar-compile-timeout", "5", "--disable-jump-forward"]
    )
    assert (args.grammar_compile_timeout_s, args.disable_jump_forward) == (5.0, True)
    args = build_parser().parse_args(["serve"])
    assert (args.grammar_compile_timeout_s, args.disable_jump_forward) == (30.0, None)
    args = build_parser().parse_args(["serve", "--no-disable-jump-forward"])
    assert args.disable_jump_forward is False


@pytest.mark.parametrize("setting", [None, True, False])
def test_jump_forward_defaults_to_on_except_on_cuda(setting):
    """Unset, jump-forward is on on the CPU and off on CUDA (measured there: it gained nothing
    at batch 1 and cost a batch of 64 JSON requests 2-4x); set, it is what it says."""
    from braid.runtime.config import EngineConfig

    cpu = EngineConfig(device="cpu", disable_jump_forward=setting)
    cuda = EngineConfig(device="cuda", disable_jump_forward=setting)
    assert cpu.use_jump_forward is (setting is not True)
    assert cuda.use_jump_forward is (setting is False)
    with pytest.raises(ValueError, match="disable_jump_forward must be None, true or false"):
        EngineConfig(disable_jump_forward="yes")


@pytest.mark.parametrize("setting", [None, "outlines", "llguidance", "xgrammar"])
def test_grammar_backend_defaults_to_xgrammar_on_cuda_and_llguidance_elsewhere(setting):
    """Unset, the backend is xgrammar on CUDA (on the H200 machine its mask fill met the <= 3%
    target where llguidance's did not) and llguidance on the CPU; set, it is what it says."""
    from braid.runtime.config import EngineConfig

    cpu = EngineConfig(device="cpu", grammar_backend=setting)
    cuda = EngineConfig(device="cuda", grammar_backend=setting)
    assert cpu.effective_grammar_backend == (setting or "llguidance")
    assert cuda.effective_grammar_backend == (setting or "xgrammar")
    with pytest.raises(ValueError, match="grammar_backend"):
        EngineConfig(grammar_backend="lark")


def test_start_builds_the_compiler_and_a_worker_before_any_request(make_pool):
    """`start()` (what a GPU engine calls at start) builds the vocabulary and starts an
    outlines worker in the background, so the first request compiles at once."""
    built: list[float] = []
    pool = make_pool(built=built)
    assert pool.compiler is None
    pool.start()
    deadline = time.monotonic() + 30
    while (pool.compiler is None or not pool.worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.compiler is not None and pool.worker_pids
    assert len(built) == 1  # built once, by the drivers, not by a request
    assert pool.submit("regex", "[ab]{2}").result(timeout=30) is not None
    assert len(built) == 1


def _started_before_its_compiler(tokenizer, pools) -> tuple[AsyncGrammarCompiler, threading.Event]:
    """A pool told its backend (outlines), started, whose compiler is built only once the
    returned event is set."""
    release = threading.Event()

    def make_compiler() -> GrammarCompiler:
        release.wait(30)
        return GrammarCompiler(tokenizer, "outlines")

    pool = AsyncGrammarCompiler(make_compiler, workers=1, backend="outlines")
    pools.append(pool)
    pool.start()
    return pool, release


def test_a_pool_told_its_backend_starts_workers_before_the_compiler_is_built(tiny_tokenizer, pools):
    """Given the backend (`backend=`, as a GPU scheduler does at the start of its load), the
    workers start before the compiler is built and load their library meanwhile: they are up
    while the compiler is still being made, and then compile as usual."""
    pool, release = _started_before_its_compiler(tiny_tokenizer, pools)
    try:
        deadline = time.monotonic() + 30
        while not pool.worker_pids and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.worker_pids and pool.compiler is None
        (pid,) = pool.worker_pids
        cmdline = psutil.Process(pid).cmdline()
        assert cmdline[-1] == "outlines" and "compile_worker" in " ".join(cmdline)
    finally:
        release.set()
    grammar = pool.submit("regex", "ab+c").result(timeout=60)
    assert grammar.backend == "outlines" and pool.worker_pids == [pid]


def test_a_pool_shut_down_while_a_worker_waits_for_its_payload_ends_that_worker(
    tiny_tokenizer, pools
):
    """A worker started before the compiler was built (a GPU scheduler's, as its load begins)
    is ended once the payload is made if the pool was shut down meanwhile (a failed load):
    no task will ever reach it, so it must not outlive the pool."""
    pool, release = _started_before_its_compiler(tiny_tokenizer, pools)
    try:
        assert _wait_for(lambda: bool(pool.worker_pids), 30)
        (pid,) = pool.worker_pids
        pool.shutdown(0)
    finally:
        release.set()
    assert _wait_for(lambda: _gone(pid) and not pool.worker_pids, 10)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("regex", "ab+c")


def test_workers_import_nothing_from_the_servers_working_directory(
    make_pool, tmp_path, monkeypatch
):
    """A `json.py` where the server was started is not imported by the compile workers (it
    would run in each, and break every constrained request), and braid is still found."""
    marker = tmp_path / "imported"
    (tmp_path / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    pool = make_pool(workers=1)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert pool.submit("json_schema", schema).result(timeout=30) is not None
    assert not marker.exists()


def test_a_worker_that_dies_before_its_payload_says_how_it_ended():
    """A worker whose process ended before its payload was sent (here: a backend name its
    registry does not know) is reaped, so the error says how it ended, not "is running"."""
    worker = _Worker("no-such-backend")
    try:
        assert _wait_for(lambda: psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE, 30)
        with pytest.raises(OSError, match="compile worker exited with code 1 at start-up"):
            worker.send_payload(b"x" * (1 << 20))  # past a pipe's buffer: the write must fail
    finally:
        worker.close()


def test_a_bad_grammar_thread_cap_is_ignored_with_a_warning(monkeypatch):
    """BRAID_GRAMMAR_THREADS that is not a whole number is ignored (one warning), rather than
    failing every batch call that reads it."""
    from braid.runtime.constrained import grammar as grammar_module

    warned: list[str] = []
    # The module's logger itself: braid's log set-up (by earlier tests) may stop propagation.
    monkeypatch.setattr(grammar_module.logger, "warning", lambda msg, *a: warned.append(msg % a))
    grammar_module._bad_thread_cap.cache_clear()
    monkeypatch.setenv("BRAID_GRAMMAR_THREADS", "four")
    assert thread_cap() is None and thread_cap() is None
    assert len(warned) == 1 and "BRAID_GRAMMAR_THREADS='four'" in warned[0]
    monkeypatch.setenv("BRAID_GRAMMAR_THREADS", "3")
    assert thread_cap() == 3
