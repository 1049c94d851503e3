"""Program sessions: while a program runs, its state's KV stays pinned between its gens, so
other traffic cannot evict it; it is released when the program ends or fails."""

from __future__ import annotations

import httpx
import pytest

import braid as sgl
from braid import SamplingParams
from tests.conftest import assert_kv_all_free_or_cached

CONTEXT = "The museum opens at nine and closes at five. " * 24


@pytest.fixture(scope="module")
def small_llm(smollm2_dir):
    llm = sgl.LLM(smollm2_dir, kv_tokens=1024, show_progress=False)
    yield llm
    llm.shutdown()


def flood(llm) -> None:
    """Unrelated traffic that fills the whole cache several times over."""
    for i in range(5):
        text = f"Unrelated document {i}: " + f"item {i} costs {i} dollars. " * 40
        llm.generate(text, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


@sgl.function
def two_steps(s, llm):
    s += CONTEXT + "\nQuestion: When does it open?\nAnswer:"
    s += sgl.gen("a1", max_tokens=4, temperature=0)
    s["a1"]  # wait for it, then let other traffic run before the next step
    s.pinned_during = llm.stats()["pinned_tokens"]
    flood(llm)
    s += "\nQuestion: When does it close?\nAnswer:"
    s += sgl.gen("a2", max_tokens=4, temperature=0)


def run(llm, sessions: bool):
    from braid.lang.backends.engine import EngineBackend

    prog = sgl.function(two_steps.func)
    prog.sessions = sessions
    return prog.run(llm=llm, backend=EngineBackend(llm))


def test_session_keeps_the_program_prefix_through_eviction(small_llm):
    pinned = run(small_llm, sessions=True)
    first = pinned.get_meta_info("a1")
    second = pinned.get_meta_info("a2")
    assert pinned.pinned_during >= first["prompt_tokens"]
    # Everything the first step computed (prompt + its answer) came back from the cache.
    assert second["cached_tokens"] >= first["prompt_tokens"] + first["completion_tokens"] - 1
    s = small_llm.stats()
    assert s["pinned_sessions"] == 0 and s["evicted_tokens"] > 0
    assert_kv_all_free_or_cached(small_llm)

    small_llm.flush_cache()
    unpinned = run(small_llm, sessions=False)
    assert unpinned.pinned_during == 0
    assert unpinned.get_meta_info("a2")["cached_tokens"] < first["prompt_tokens"] // 2
    assert unpinned["a2"] == pinned["a2"]  # same tokens either way
    assert_kv_all_free_or_cached(small_llm)


def test_session_is_released_when_the_program_fails(small_llm):
    @sgl.function
    def fails(s):
        s += CONTEXT
        s += sgl.gen("a", max_tokens=2, temperature=0)
        s["a"]
        raise RuntimeError("the program's own bug")

    from braid.lang.backends.engine import EngineBackend

    with pytest.raises(RuntimeError, match="own bug"):
        fails.run(backend=EngineBackend(small_llm))
    assert small_llm.stats()["pinned_sessions"] == 0
    assert_kv_all_free_or_cached(small_llm)


def test_endpoint_session_is_released_over_http_when_the_program_fails(served):
    """The same through RuntimeEndpoint: the failed program's session is closed on the server
    (its pin released), and the server's program list forgets it."""

    def stats() -> dict:
        return httpx.get(f"{served.url}/get_server_info").json()

    before = stats()["stats"]["pinned_sessions"]
    meanwhile = []

    @sgl.function
    def fails(s):
        s += CONTEXT
        s += sgl.gen("a", max_tokens=2, temperature=0)
        s["a"]
        meanwhile.append(stats()["stats"]["pinned_sessions"])
        raise RuntimeError("the program's own bug")

    with pytest.raises(RuntimeError, match="own bug"):
        fails.run(backend=sgl.RuntimeEndpoint(served.url))
    info = stats()
    # The session held its pin while the program ran (the last call: the first is the trace).
    assert meanwhile[-1] == before + 1
    assert info["stats"]["pinned_sessions"] == before
    assert info["stats"]["running_requests"] == 0


# ---- what the runtime learns of a program's calls ------------------------------------------
@sgl.function
def staged(s, programs):
    """Calls at positions 0 (gen), 1 (select), 2 (a fork's two branches), 3 (gen after the
    join); `programs()` reads the runtime's program list after the first and the last. Its
    text stays short enough (a quarter of small_llm's KV) for every state to be pinned."""
    s += CONTEXT[: len(CONTEXT) // 3] + "\nQuestion: When does it open?\nAnswer:"
    s += sgl.gen("a1", max_tokens=3, temperature=0)
    s["a1"]
    s.after_first = programs()
    s += "\nIs that right?"
    s += sgl.select("ok", choices=[" yes", " no"])
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nIdea {i}:"
        f += sgl.gen("idea", max_tokens=2, temperature=0)
    forks.join()
    s += "\nSo:"
    s += sgl.gen("a2", max_tokens=2, temperature=0)
    s["a2"]
    s.before_end = programs()


def check_staged(state, programs_after: list[dict]) -> None:
    """The positions reached the scheduler: its program list showed the call count, the last
    position and the pinned KV while the program ran, and dropped the program at its end."""
    (first,) = state.after_first
    assert first["id"].startswith("prog-")
    assert (first["calls"], first["calls_served"], first["last_position"]) == (1, 1, 0)
    assert first["in_flight"] == 0 and first["pinned_sessions"] == 1
    assert first["pinned_tokens"] >= state.get_meta_info("a1")["prompt_tokens"] - 16
    assert first["service"] > 0
    (last,) = [p for p in state.before_end if p["id"] == first["id"]]
    # gen, select, two branch gens, gen: five calls, the last at position 3.
    assert (last["calls"], last["calls_served"], last["last_position"]) == (5, 5, 3)
    assert last["pinned_tokens"] > first["pinned_tokens"]
    assert last["service"] > first["service"]
    assert first["id"] not in {p["id"] for p in programs_after}


def test_engine_program_calls_carry_their_positions_to_the_scheduler(small_llm):
    from braid.lang.backends.engine import EngineBackend

    backend = EngineBackend(small_llm)
    state = staged.run(programs=small_llm.programs, backend=backend)
    check_staged(state, small_llm.programs())
    assert backend.get_server_info()["programs"] == []
    assert small_llm.stats()["pinned_programs"] == 0
    assert_kv_all_free_or_cached(small_llm)


def test_endpoint_program_calls_carry_their_positions_over_http(served):
    def programs() -> list[dict]:
        return httpx.get(f"{served.url}/get_server_info").json()["programs"]

    state = staged.run(programs=programs, backend=sgl.RuntimeEndpoint(served.url))
    check_staged(state, programs())


def three_calls_without_sessions(stats):
    """A program of three dependent gens with sessions off, which keeps `stats()` after each."""

    @sgl.function
    def three_calls(s):
        s += CONTEXT[:200]
        for k in range(3):
            s += f"\nStep {k}:"
            s += sgl.gen(f"a{k}", max_tokens=2, temperature=0)
            s[f"a{k}"]
            s.seen = getattr(s, "seen", []) + [stats()]

    three_calls.sessions = False
    return three_calls


def assert_one_program_ended(before: dict, state, after: dict) -> None:
    """Across the run's calls the scheduler knew one more program, with nothing pinned, and
    the run's end ended it."""
    for seen in state.seen:
        assert seen["programs_known"] == before["programs_known"] + 1
        assert seen["pinned_sessions"] == 0
    assert after["programs_ended"] == before["programs_ended"] + 1
    assert after["programs_known"] == before["programs_known"]


def test_a_program_without_sessions_is_still_one_program_to_the_scheduler(small_llm):
    """With sessions off nothing is pinned, but every call carries the run's program id, so
    the scheduler counts one program (for the program policies), which the run's end ends."""
    from braid.lang.backends.engine import EngineBackend

    before = small_llm.stats()
    program = three_calls_without_sessions(small_llm.stats)
    state = program.run(backend=EngineBackend(small_llm))
    assert_one_program_ended(before, state, small_llm.stats())
    assert_kv_all_free_or_cached(small_llm)
    # What the runtime takes: a position with a session or a program id; an id that is a
    # non-empty string.
    from braid.runtime.errors import ParamError

    with pytest.raises(ParamError, match="program_position needs a session_id or a program_id"):
        small_llm.tm.submit("p", [5, 6], SamplingParams(max_tokens=1), program_position=0)
    with pytest.raises(ParamError, match="program_id must be a non-empty string"):
        small_llm.tm.submit("p", [5, 6], SamplingParams(max_tokens=1), program_id="")


def test_endpoint_program_without_sessions_is_one_program_ended_at_its_end(served):
    """Over HTTP with sessions off, every call carries the run's program_id: the server's
    scheduler knows one program across the run's calls, with nothing pinned, and the run's end
    (/end_program) ends it."""

    def stats() -> dict:
        return httpx.get(f"{served.url}/get_server_info").json()["stats"]

    before = stats()
    state = three_calls_without_sessions(stats).run(backend=sgl.RuntimeEndpoint(served.url))
    assert_one_program_ended(before, state, stats())
