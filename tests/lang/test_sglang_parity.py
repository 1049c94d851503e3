"""SGLang's frontend surface beyond its test programs: item assignment on states and fork
groups, `global_config`, typed values that end where the model ends them, gen's keywords
(positional max_tokens, n, stop_regex, max_tokens=0, top logprobs, prompt logprobs), select's
meta and the choices-method protocol, streamed meta per chunk, separate_reasoning,
Program.cache, the tracer view, and the module alias."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

import braid as sgl
from braid.lang import sglang_alias
from braid.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from braid.runtime.reasoning import split_reasoning
from tests.conftest import assert_kv_all_free_or_cached


@sgl.function
def decode_int(s):
    s += "The number of hours in a day is " + sgl.gen_int("hours") + "\n"
    s += "The number of days in a year is " + sgl.gen_int("days") + "\n"


def test_typed_ints_end_where_the_model_ends_them(backend):
    # SGLang's test_decode_int program, greedy: SmolLM2 would go on writing digits if a
    # number could only end at EOS or a bare space token.
    state = decode_int.run(backend=backend, temperature=0)
    assert state["hours"] == "24" and state["days"] == "365", state.text()
    assert state.get_value("hours") == 24 and state.get_value("days") == 365
    assert state.text().endswith("is 24\nThe number of days in a year is 365\n")


def test_item_assignment_on_states_and_fork_groups(backend):
    @sgl.function
    def prog(s):
        s += "Count: one, two,"
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f" branch {i}:"
            forks[i] += sgl.gen("x", 3, stop="\n", temperature=0)  # max_tokens positional
        forks.join()
        with pytest.raises(ValueError, match="cannot be replaced"):
            forks[0] = forks[1]
        s["x"] = [v.strip() for v in s["x"]]
        s += " done"

    state = prog.run(backend=backend)
    assert isinstance(state["x"], list) and len(state["x"]) == 2
    assert state["x"] == [v.strip() for v in state["x"]]
    state["extra"] = 5
    assert state["extra"] == 5 and "extra" in state


def test_fork_group_takes_one_item_per_member(backend):
    @sgl.function
    def prog(s):
        s += "Colors:"
        forks = s.fork(3)
        forks += [" red", " green", " blue"]
        forks.join(mode="concate_and_append")

    assert prog.run(backend=backend).text() == "Colors: red green blue"


def test_default_backend_lives_in_global_config(backend):
    sgl.set_default_backend(backend)
    assert sgl.global_config.default_backend is backend
    assert sgl.get_default_backend() is backend
    seen = {}

    @sgl.function
    def reads(s):
        seen[threading.get_ident()] = sgl.global_config.default_backend
        s += "Hi"

    with sgl.using_backend(backend) as b:
        assert b is backend
        reads.run_batch([{}, {}], num_threads=2)  # worker threads see the block's backend
        assert set(map(id, seen.values())) == {id(backend)}
    assert sgl.global_config.default_backend is backend
    with pytest.raises(ValueError, match="expected braid.Engine"):
        with sgl.using_backend(object()):
            pass


def test_dir_lists_the_lazy_names():
    names = dir(sgl)
    for name in ("function", "gen", "select", "global_config", "Runtime", "separate_reasoning"):
        assert name in names
    import braid.lang

    assert "ChoicesSamplingMethod" in dir(braid.lang) and "using_backend" in dir(braid.lang)


def test_gen_keywords(smollm2, backend):
    tok = smollm2.tokenizer

    @sgl.function
    def prog(s):
        s += "The capital of France is"
        s += sgl.gen("nothing", max_tokens=0)
        # Seeded: the greedy gens after it read its text (unseeded, a rare draw once left
        # "stopped" no punctuation within its 20 tokens).
        s += sgl.gen("three", max_tokens=4, n=3, temperature=1.0, seed=3)
        s += sgl.gen("lp", max_tokens=3, temperature=0, return_logprob=True, top_logprobs_num=3)
        s += sgl.gen("stopped", max_new_tokens=20, temperature=0, stop_regex=r"[.,!]")
        s += sgl.gen(
            "scored", max_tokens=1, temperature=0, return_logprob=True, logprob_start_len=2
        )

    state = prog.run(backend=backend)
    assert state["nothing"] == "" and state.get_meta_info("nothing")["completion_tokens"] == 0
    assert state.get_meta_info("nothing")["finish_reason"]["type"] == "length"
    assert isinstance(state["three"], list) and len(state["three"]) == 3
    meta = state.get_meta_info("lp")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    assert [len(t) for t in meta["output_top_logprobs"]] == [3, 3, 3]
    for (lp, tid, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp)  # greedy: chosen is top
    stopped = state["stopped"]
    assert stopped[-1] in ".,!" and not any(c in ".,!" for c in stopped[:-1]), stopped
    scored = state.get_meta_info("scored")
    text_before = state.text()[: len(state.text()) - len(state["scored"])]
    ids = tok.encode(text_before)
    assert [t[1] for t in scored["input_token_logprobs"]] == ids[2:]
    assert all(t[0] <= 0 for t in scored["input_token_logprobs"])


def test_bad_gen_keywords_are_value_errors():
    with pytest.raises(ValueError, match="unknown sampling argument"):
        sgl.gen("x", max_tokenz=3)
    with pytest.raises(ValueError, match="n must be an integer"):
        sgl.gen("x", n=0)
    with pytest.raises(ValueError, match="choices_method needs choices"):
        sgl.gen("x", choices_method=sgl.token_length_normalized)
    with pytest.raises(ValueError, match="dtype must be"):
        sgl.gen("x", dtype="complex")
    with pytest.raises(ValueError, match="video"):
        sgl.video("clip.mp4", 8)
    with pytest.raises(ValueError, match="no Anthropic backend"):
        sgl.Anthropic("claude")


class LastChoice(ChoicesSamplingMethod):
    """A user-written method in SGLang's protocol: always the last choice."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        self.calls.append(
            dict(
                choices=choices,
                normalized=normalized_prompt_logprobs,
                inputs=input_token_logprobs,
                outputs=output_token_logprobs,
            )
        )
        return ChoicesDecision(choices[-1], {"why": "last"})


def test_a_user_choices_method_plugs_in(backend):
    method = LastChoice()

    @sgl.function
    def pick(s):
        s += "The sky is"
        s += sgl.select("c", [" blue", " green", " made of cheese"], choices_method=method)
        s += sgl.gen("more", choices=[" yes", " no"], choices_method=method)

    state = pick.run(backend=backend)
    assert state["c"] == " made of cheese" and state["more"] == " no"
    assert state.get_meta_info("c")["why"] == "last"
    call = method.calls[0]
    assert call["choices"] == [" blue", " green", " made of cheese"]
    assert call["outputs"] == [[], [], []]
    for toks, norm in zip(call["inputs"], call["normalized"]):
        assert toks and all(len(t) == 3 and t[0] <= 0 and isinstance(t[1], int) for t in toks)
        assert norm == pytest.approx(sum(t[0] for t in toks) / len(toks))
    with pytest.raises(ValueError, match="temperature > 0 needs"):
        sgl.select("c", ["a", "b"], temperature=0.5, choices_method=method)


def test_builtin_select_meta_has_sglangs_keys(backend):
    @sgl.function
    def pick(s, method):
        s += "The capital of France is"
        s += sgl.select("c", [" Paris", " London"], choices_method=method)

    for method, key in (
        (sgl.token_length_normalized, None),
        (sgl.greedy_token_selection, "greedy_logprob_matrix"),
        (sgl.unconditional_likelihood_normalized, "normalized_unconditional_prompt_logprobs"),
    ):
        meta = pick.run(method=method, backend=backend).get_meta_info("c")
        for k in ("normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs"):
            assert len(meta[k]) == 2, (method, k)
        if key is not None:
            assert key in meta, method
        if method is sgl.unconditional_likelihood_normalized:
            unc = meta["unconditional_token_logprobs"]
            assert [len(u) for u in unc] == [len(t) for t in meta["input_token_logprobs"]]
            # Scored without the prompt: different numbers than with it.
            assert [t[0] for t in unc[0]] != [t[0] for t in meta["input_token_logprobs"][0]]


def test_streamed_meta_carries_each_chunks_logprobs(backend):
    @sgl.function
    def prog(s):
        s += "Write a sentence about cats:"
        s += sgl.gen("a", max_tokens=12, temperature=0, return_logprob=True)

    async def collect():
        st = prog.run(stream=True, backend=backend)
        return st, [x async for x in st.text_async_iter(var_name="a", return_meta_data=True)]

    st, items = asyncio.run(collect())
    final = st.get_meta_info("a")["output_token_logprobs"]
    chunks = [m["output_token_logprobs"] for _, m in items]
    assert sum(chunks, []) == final
    lengths = [m["output_token_logprobs_length"] for _, m in items]
    assert lengths == [sum(len(c) for c in chunks[: i + 1]) for i in range(len(chunks))]
    assert "".join(p for p, _ in items) == st["a"]
    assert "".join(st.text_iter(var_name="a")) == st["a"]  # a finished state replays


def test_split_reasoning_formats():
    assert split_reasoning("<think>a b</think> answer", "qwen3") == ("a b", "answer")
    assert split_reasoning("no thinking here", "qwen3") == ("", "no thinking here")
    assert split_reasoning("straight in</think>Paris", "deepseek-r1") == ("straight in", "Paris")
    assert split_reasoning("<think>cut off", None) == ("cut off", "")
    with pytest.raises(ValueError, match="unknown model_type"):
        split_reasoning("x", "gpt")


def test_separate_reasoning_splits_the_variable_and_the_text(backend):
    @sgl.function
    def prog(s):
        s += sgl.user("Think, then answer.")
        s += sgl.assistant(
            sgl.separate_reasoning(
                sgl.gen("a", regex=r"<think>[a-z ]{3,12}</think> [A-Z][a-z]{2,6}", temperature=0),
                model_type="qwen3",
            )
        )

    state = prog.run(backend=backend)
    reasoning = state["a_reasoning_content"]
    assert reasoning and "<think>" not in state["a"] and "</think>" not in state.text()
    assert state.messages()[-1]["content"] == state["a"]
    assert state.text().count(state["a"]) >= 1
    with pytest.raises(ValueError, match="needs a name"):
        sgl.separate_reasoning(sgl.gen())


def test_program_cache_precomputes_the_constant_prefix(smollm2, backend):
    @sgl.function
    def prog(s, question):
        s += "You are a careful assistant who answers in one word. " * 6
        s += question
        s += sgl.gen("a", max_tokens=2, temperature=0)

    smollm2.flush_cache()
    prefix = prog.cache(backend)
    assert prefix.startswith("You are a careful assistant")
    old = sgl.global_config.enable_precache_with_tracing
    sgl.global_config.enable_precache_with_tracing = False  # what cache() did, not run()
    try:
        meta = prog.run(question="Sky?", backend=backend).get_meta_info("a")
    finally:
        sgl.global_config.enable_precache_with_tracing = old
    assert meta["cached_tokens"] >= len(smollm2.tokenizer.encode(prefix)) - 1


def test_trace_offers_sglangs_tracer_view():
    @sgl.function
    def prog(s, q):
        s += "Q: " + q
        forks = s.fork(2)
        forks += sgl.gen("a", max_tokens=2)
        forks.join()
        s += sgl.gen("b", max_tokens=2)

    g = prog.trace()
    dump = g.last_node.print_graph_dfs()
    lines = dump.strip().splitlines()
    assert lines[-1].startswith(f"%{g.last_node.id} = %") and "gen('b'" in lines[-1]
    assert any("join(" in line for line in lines) and any("fork" in line for line in lines)
    assert [type(n).__name__ for n in g.flatten_nodes()][:2] == ["Text", "Arg"]


def test_state_error_repr_and_run_batch_forms(backend):
    @sgl.function
    def prog(s, word):
        s += "Say " + word
        s += sgl.gen("x", max_tokens=1, temperature=0)

    state = prog.run(word="hi", backend=backend)
    assert state.error() is None
    assert repr(state) == f"ProgramState({state.text()})"
    by_position = prog.run_batch([["a"], ["b"]], backend=backend)
    items = [{"word": "a"}, {"word": "b"}]
    generated = list(prog.run_batch(items, generator_style=True, backend=backend))
    assert [s["x"] for s in by_position] == [s["x"] for s in generated]
    with pytest.raises(ValueError, match="positional arguments"):
        prog.run_batch([["a", "b", "c"]], backend=backend)

    @sgl.function
    def fails(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2, temperature=-1)

    bad = fails.run_batch([{}], backend=backend)[0]
    assert isinstance(bad.error(), sgl.ProgramError)


def test_program_parameter_named_like_a_sampling_argument(backend):
    @sgl.function
    def prog(s, n):
        s += "Repeat " + str(n)
        s += sgl.gen("x", max_tokens=1, temperature=0)

    assert prog.run(n=3, backend=backend).text().startswith("Repeat 3")


def test_sglang_alias_maps_modules_to_braid():
    sglang_alias.install()
    try:
        import sglang
        import sglang.lang.ir
        from sglang.global_config import global_config
        from sglang.srt.hf_transformers_utils import get_tokenizer
        from sglang.utils import download_and_cache_file

        import braid.lang.ir

        assert sglang.gen is sgl.gen and sglang.lang.ir is braid.lang.ir
        assert global_config is sgl.global_config is sglang.global_config
        assert braid.lang.global_config is sgl.global_config  # the submodule did not shadow it
        assert callable(get_tokenizer) and callable(download_and_cache_file)
        with pytest.raises(ModuleNotFoundError, match="no module 'sglang.srt.managers'"):
            import sglang.srt.managers  # noqa: F401
    finally:
        sglang_alias.uninstall()
    assert "sglang" not in sys.modules


def test_server_helpers_and_runtime_free_kv(smollm2, backend):
    sgl.set_default_backend(backend)
    info = sgl.get_server_info()
    assert info["stats"]["kv_capacity_tokens"] > 0
    assert sgl.flush_cache() is True
    assert_kv_all_free_or_cached(smollm2)


def test_select_with_a_temperature_samples_by_the_methods_scores():
    import random

    def toks(*lps):
        return [[lp, i, "t"] for i, lp in enumerate(lps)]

    args = dict(
        choices=["a", "b"],
        normalized_prompt_logprobs=[-0.1, -2.0],
        input_token_logprobs=[toks(-0.1), toks(-2.0)],
        output_token_logprobs=[[], []],
    )
    rng = random.Random(0)
    picks = [sgl.token_length_normalized.sample(1.0, rng, **args).decision for _ in range(2000)]
    share = picks.count("a") / len(picks)
    # softmax([-0.1, -2.0]) gives "a" 0.87 of the time; greedy would give it always.
    assert 0.83 < share < 0.91, share
    assert sgl.token_length_normalized(**args).decision == "a"
