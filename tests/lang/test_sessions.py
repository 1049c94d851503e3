"""Program sessions: while a program runs, its state's KV stays pinned between its gens, so
other traffic cannot evict it; it is released when the program ends or fails."""

from __future__ import annotations

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
