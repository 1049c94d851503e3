"""`LLM.beam_search` (vLLM's offline beam search) against transformers: its beam search where
no beam ends (the same beams, in the same order, with the same scores), and, with an EOS the
beams reach, a beam search over transformers' logits written out here as the module's
docstring says (complete beams kept, ranked with the length penalty)."""

from __future__ import annotations

import json
import math
import shutil

import httpx
import openai
import pytest
import torch

import braid
from braid import BeamSearchParams
from tests.conftest import assert_kv_all_free_or_cached, build_tiny_model
from tests.runtime.tiny_tokenizers import build_byte_level_bpe
from tests.server.conftest import start_server, wait_idle

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("beam") / "llama")
    build_byte_level_bpe(path)
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eos_dir(model_dir, hf, tmp_path_factory):
    """The same model with an EOS: the token the first prompt's best second beam would take
    next (so beams end on it early)."""
    with torch.inference_mode():
        first = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].log_softmax(-1)
        second = int(first.topk(2).indices[1])
        nxt = hf(torch.tensor([PROMPTS[0] + [second]])).logits[0, -1].argmax()
    path = tmp_path_factory.mktemp("beam-eos") / "llama"
    shutil.copytree(model_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = int(nxt)
    (path / "config.json").write_text(json.dumps(cfg))
    gen = path / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = int(nxt)
        gen.write_text(json.dumps(g))
    return path, int(nxt)


@pytest.fixture(scope="module")
def llm(model_dir):
    with braid.LLM(model_dir, kv_tokens=2048, show_progress=False) as engine:
        yield engine


def reference(model, prompt, width, steps, eos: frozenset[int], length_penalty):
    """Beam search over transformers' log-probabilities, as `braid.runtime.beam_search`
    describes it: (tokens, cumulative logprob, finish reason) best first."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.inference_mode():
                lp = model(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            top = lp.topk(2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t in eos else grown).append((tokens + [t], cum + v))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]

    def score(b):
        length = len(b[0]) - (b in done)  # an ended beam's EOS does not count
        return b[1] / length**length_penalty

    ranked = sorted(done + live, key=score, reverse=True)[:width]
    return [(t, c, "stop" if (t, c) in done else "length") for t, c in ranked]


def test_beams_equal_transformers_beam_search_where_no_beam_ends(llm, hf):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outs = llm.beam_search(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            want = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                num_beams=3,
                num_return_sequences=3,
                do_sample=False,
                max_new_tokens=6,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        assert [s.tokens for s in out.sequences] == want.sequences.tolist()
        for s, score in zip(out.sequences, want.sequences_scores.tolist()):
            # transformers' score: the sum over the 6 new tokens / 6 ** length_penalty.
            assert s.cum_logprob == pytest.approx(score * 6, abs=1e-4)
            assert s.finish_reason == "length" and len(s.logprobs) == 6
            assert s.text == llm.tokenizer.decode(s.tokens)
            assert all(len(position) == 6 for position in s.logprobs)  # 2 x beam_width
    assert_kv_all_free_or_cached(llm)


def test_beams_that_reach_eos_are_kept_and_ranked_with_the_length_penalty(eos_dir, hf):
    path, eos = eos_dir
    with braid.LLM(path, kv_tokens=2048, show_progress=False) as engine:
        eos_ids = engine.eos_token_ids  # the config's and the tokenizer's
        assert eos in eos_ids
        for penalty in (1.0, 0.0, 2.0):
            params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=penalty)
            (out,) = engine.beam_search([PROMPTS[0]], params, use_tqdm=False)
            want = reference(hf, PROMPTS[0], 3, 5, eos_ids, penalty)
            got = [(s.tokens, s.finish_reason) for s in out.sequences]
            assert got == [(t, why) for t, _, why in want]
            for s, (_, cum, _) in zip(out.sequences, want):
                assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            if penalty == 1.0:
                assert any(s.finish_reason == "stop" for s in out.sequences)
        # An ended beam's text leaves its EOS out unless asked to keep it.
        params = BeamSearchParams(beam_width=3, max_tokens=5)
        ended = next(
            s
            for s in engine.beam_search([PROMPTS[0]], params, use_tqdm=False)[0].sequences
            if s.finish_reason == "stop"
        )
        assert ended.tokens[-1] in eos_ids and ended.stop_reason is None  # as generate's EOS
        assert ended.text == engine.tokenizer.decode(ended.tokens[:-1])
        params.include_stop_str_in_output = True
        kept = engine.beam_search([PROMPTS[0]], params, use_tqdm=False)[0].sequences
        assert engine.tokenizer.decode(ended.tokens) in [s.text for s in kept]
        # ignore_eos: every beam runs to max_tokens.
        params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
        (out,) = engine.beam_search([PROMPTS[0]], params, use_tqdm=False)
        assert [len(s.tokens) for s in out.sequences] == [len(PROMPTS[0]) + 5] * 3
        assert_kv_all_free_or_cached(engine)


def test_each_step_reuses_the_beams_cached_prefix(llm):
    llm.flush_cache()
    before = llm.stats()["prefill_tokens_computed"]
    prompt = list(range(20, 120))
    llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8), use_tqdm=False)
    computed = llm.stats()["prefill_tokens_computed"] - before
    # The prompt once, then about one token per beam and step (not the whole beam again).
    assert computed <= len(prompt) + 4 * 8 + 8, computed


def test_a_beam_the_context_cannot_grow_ends_there(llm):
    prompt = [(7 * i) % 500 + 3 for i in range(llm.context_length - 2)]
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6), use_tqdm=False)
    assert [len(s.tokens) for s in out.sequences] == [llm.context_length] * 2
    assert all(s.finish_reason == "length" for s in out.sequences)
    with pytest.raises(ValueError, match="prompt 1: .*context length"):
        llm.beam_search([PROMPTS[0], prompt + [5, 5]], BeamSearchParams(beam_width=2, max_tokens=2))


def test_concurrency_limit_searches_the_prompts_a_few_at_a_time_to_the_same_beams(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    together = llm.beam_search(PROMPTS, params)
    one_by_one = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_by_one] == [
        [s.tokens for s in o.sequences] for o in together
    ]
    with pytest.raises(ValueError, match="^concurrency_limit: must be an integer >= 1"):
        llm.beam_search(PROMPTS, params, concurrency_limit=0)
    with pytest.raises(ValueError, match="^lora_request: braid serves no LoRA adapters"):
        llm.beam_search(PROMPTS, params, lora_request=object())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (BeamSearchParams(beam_width=0, max_tokens=4), "^beam_width: must be an integer in"),
        (BeamSearchParams(beam_width=11, max_tokens=4), "^beam_width: must be an integer in"),
        (BeamSearchParams(beam_width=2, max_tokens=0), "^max_tokens: must be an integer >= 1"),
        (BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1), "^temperature:"),
        (BeamSearchParams(beam_width=2, max_tokens=4, length_penalty="x"), "^length_penalty:"),
        (
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("inf")),
            "^length_penalty: must be a finite number",
        ),
        (braid.SamplingParams(max_tokens=4), "params must be a BeamSearchParams"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.beam_search([PROMPTS[0]], params)


@pytest.mark.parametrize(
    ("penalty", "scores"),
    [
        (1.0, [-2.0 / 3, -1.0 / 3]),
        (1000.0, [-0.0, -0.0]),  # 3.0 ** 1000 overflows: the score's limit
        (-1000.0, [-math.inf, -math.inf]),  # 3.0 ** -1000 rounds to 0: the limit again
        (1e308, [-0.0, -0.0]),
    ],
)
def test_a_beams_score_is_its_limit_where_the_length_power_leaves_the_float_range(penalty, scores):
    from braid.runtime.beam_search import BeamSearchSequence, beam_score

    beams = [
        BeamSearchSequence([1, 2, 3], cum_logprob=-2.0),
        BeamSearchSequence([1, 2, 3], cum_logprob=-1.0),
    ]
    assert [beam_score(b, frozenset(), penalty) for b in beams] == scores
    assert beam_score(BeamSearchSequence([1], cum_logprob=0.0), frozenset(), -1000.0) == 0.0


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(ValueError, match="token id 600"):
        llm.beam_search([[1, 600]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: .*takes text only"):
        llm.beam_search([{"prompt": "x", "multi_modal_data": {"image": b"x"}}], params)
    assert len(llm.beam_search([PROMPTS[1]], params, use_tqdm=False)[0].sequences) == 2
    assert_kv_all_free_or_cached(llm)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("beam-serve"), "--model", str(model_dir))
    yield s
    s.stop()


def test_the_servers_use_beam_search_gives_the_offline_beams(server, llm):
    """vLLM's `use_beam_search` on /v1/completions: `n` beams per prompt as its choices, best
    first, each the offline search's beam (its new tokens' text)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    res = client.completions.create(
        model="m",
        prompt=PROMPTS,
        max_tokens=5,
        n=3,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    offline = llm.beam_search(
        PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5), use_tqdm=False
    )
    want = [
        (llm.tokenizer.decode(s.tokens[len(p) :], skip_special_tokens=True), s.finish_reason)
        for p, out in zip(PROMPTS, offline)
        for s in out.sequences
    ]
    assert [(c.text, c.finish_reason) for c in res.choices] == want
    assert [c.index for c in res.choices] == list(range(6))
    assert res.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert res.usage.completion_tokens == 6 * 5
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_a_client_that_leaves_a_beam_search_stops_it(server):
    """The client gives up mid-search: the server stops submitting steps, aborts the one in
    flight, keeps every KV token accounted for, and serves the next request."""
    body = {"prompt": PROMPTS[0], "max_tokens": 480, "n": 4, "use_beam_search": True}
    body["ignore_eos"] = True
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]
    body["max_tokens"] = 2
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"stop": ["x"]}, "stop"),
        ({"logit_bias": {"5": 3}}, "logit_bias"),
        ({"stop_token_ids": [3]}, "stop_token_ids"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"regex": "[a-z]+"}, "use_beam_search"),
        ({"n": 11}, "n"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_what_beam_search_cannot_honour_is_a_400_naming_it(server, extra, param):
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "n": 2, "use_beam_search": True, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
