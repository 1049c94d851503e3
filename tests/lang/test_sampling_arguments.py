"""Sampling arguments a program cannot have honoured are refused where they are given, naming
them: a gen with `choices` (a select) takes only what select uses; seeds, temperatures and
`n` are held to the runtime's `SamplingParams` rule by `gen`, `select`, `run`, `run_batch`
and `sampling_defaults`, before anything runs."""

from __future__ import annotations

import math

import pytest

import braid as sgl
from braid.lang.ir import Gen, Select
from braid.runtime.errors import ParamError

CHOICES = [" yes", " no"]


@sgl.function
def one_gen(s):
    s += "Hi"
    s += sgl.gen("x", max_tokens=2)


@pytest.fixture
def no_backend(monkeypatch):
    """No default backend: a call that got past its argument checks fails on "no backend"."""
    monkeypatch.setattr(sgl.global_config, "_default_backend", None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 3},
        {"max_tokens": 1},
        {"max_new_tokens": 1},
        {"min_tokens": 1},
        {"stop": "y"},
        {"stop_regex": "y"},
        {"top_p": 0.1},
        {"top_k": 5},
        {"frequency_penalty": 0.5},
        {"ignore_eos": True},
        {"seed": 4},
        {"top_logprobs_num": 2},
        {"logprob_start_len": 0},
        {"return_text_in_logprobs": True},
        {"return_logprob": False},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_gen_with_choices_refuses_each_argument_select_does_not_use(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=rf"gen\('c'\): with choices.*cannot honour \['{name}'\]"):
        sgl.gen("c", choices=CHOICES, **kwargs)


def test_gen_with_choices_names_every_argument_it_cannot_honour():
    with pytest.raises(ValueError) as e:
        sgl.gen(
            "c",
            choices=CHOICES,
            n=3,
            max_tokens=1,
            stop="y",
            top_p=0.1,
            seed=4,
            return_logprob=True,
        )
    assert "['max_tokens', 'n', 'seed', 'stop', 'top_p']" in str(e.value)


def test_gen_with_choices_keeps_what_select_honours():
    node = sgl.gen(
        "c",
        choices=CHOICES,
        temperature=0.5,
        return_logprob=True,
        choices_method=sgl.greedy_token_selection,
    )
    assert isinstance(node, Select)
    assert node.choices == tuple(CHOICES) and node.temperature == 0.5
    assert node.method is sgl.greedy_token_selection
    assert sgl.gen("c", choices=CHOICES).temperature == 0.0


def test_gen_with_choices_and_return_logprob_reports_the_choices_logprobs(backend):
    @sgl.function
    def ask(s):
        s += "Is the sky blue? Answer:"
        s += sgl.gen("c", choices=CHOICES, return_logprob=True)

    state = ask.run(backend=backend)
    assert state["c"] in CHOICES
    meta = state.get_meta_info("c")
    assert len(meta["input_token_logprobs"]) == len(CHOICES)
    assert all(lp <= 0 for toks in meta["input_token_logprobs"] for lp, _, _ in toks)


BAD_SEEDS = ["abc", "7", 1.5, True, 2**64, -(2**63) - 1]


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_a_seed_that_is_no_64_bit_integer_is_refused_when_given(seed, no_backend):
    with pytest.raises(ParamError, match=r"gen\('x'\): seed") as e:
        sgl.gen("x", seed=seed)
    assert e.value.param == "seed"
    with pytest.raises(ParamError, match=r"one_gen\.run: seed") as e:
        one_gen.run(seed=seed)
    assert e.value.param == "seed"
    with pytest.raises(ParamError, match=r"one_gen\.run_batch: seed"):
        one_gen.run_batch([{}], seed=seed)
    with pytest.raises(ParamError, match=r"one_gen\.run_batch: seed"):
        one_gen.run_batch([], seed=seed)
    with pytest.raises(ParamError, match="sampling_defaults: seed"):
        with sgl.sampling_defaults(seed=seed):
            pytest.fail("entered a sampling_defaults block with a bad seed")


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -(2**63)])
def test_any_64_bit_integer_seed_is_taken(seed):
    assert sgl.gen("x", seed=seed).sampling.seed == seed
    with sgl.sampling_defaults(seed=seed) as args:
        assert args.seed == seed


BAD_TEMPERATURES = [math.nan, math.inf, -math.inf, -0.5, True, "0.5"]


@pytest.mark.parametrize("temperature", BAD_TEMPERATURES, ids=repr)
def test_a_temperature_that_is_no_finite_number_at_least_0_is_refused_when_given(
    temperature, no_backend
):
    with pytest.raises(ParamError, match=r"select\('c'\): temperature") as e:
        sgl.select("c", choices=["a", "b"], temperature=temperature)
    assert e.value.param == "temperature"
    with pytest.raises(ParamError, match=r"gen\('c'\): temperature"):
        sgl.gen("c", choices=["a", "b"], temperature=temperature)
    with pytest.raises(ParamError, match=r"gen\('x'\): temperature"):
        sgl.gen("x", temperature=temperature)
    with pytest.raises(ParamError, match=r"one_gen\.run: temperature"):
        one_gen.run(temperature=temperature)
    with pytest.raises(ParamError, match="sampling_defaults: temperature"):
        with sgl.sampling_defaults(temperature=temperature):
            pytest.fail("entered a sampling_defaults block with a bad temperature")


def test_select_takes_any_finite_temperature_at_least_0():
    assert sgl.select("c", choices=["a", "b"], temperature=0).temperature == 0.0
    assert sgl.select("c", choices=["a", "b"], temperature=1.5).temperature == 1.5
    assert isinstance(sgl.gen("x", temperature=0.7), Gen)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_a_run_refuses_a_bad_n_before_it_runs(n, no_backend):
    with pytest.raises(ParamError, match=r"one_gen\.run: n must be an integer >= 1") as e:
        one_gen.run(n=n)
    assert e.value.param == "n"


def test_an_unknown_argument_while_tracing_is_left_for_the_run():
    @sgl.function
    def seeded(s, own_seed=None, t=0.0):
        s += "Constant prefix. "
        s += sgl.gen("a", max_tokens=3, seed=own_seed, temperature=t)

    from braid.lang.tracer import trace

    graph = trace(seeded, {}, placeholders={"own_seed", "t"})
    assert [n.kind for n in graph.nodes] == ["text", "gen"]
    assert [n.value for n in graph.constant_prefix()] == ["Constant prefix. "]
