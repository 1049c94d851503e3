"""A program on a tiny random-weight Llama (with a small byte-level BPE beside it): every gen,
in the main line and in forks, equals transformers' greedy continuation of the program's text
at that point, and select picks the choice transformers scores highest."""

from __future__ import annotations

import pytest
import torch

import braid as sgl
from tests.conftest import assert_kv_all_free_or_cached, hf_greedy
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path, _ = build_tiny_constrained_model(tmp_path_factory.mktemp("lang-tiny"))
    llm = sgl.LLM(path, kv_tokens=2048, show_progress=False, generation_config="braid")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    yield llm, hf
    llm.shutdown()


@sgl.function
def program(s):
    s += "the cat sat on the mat. "
    s += sgl.gen("a", max_tokens=6, temperature=0, ignore_eos=True)
    s += " so"
    s += sgl.select("pick", choices=[" the dog", " a bird", " it"])
    forks = s.fork(2)
    forks += lambda i: f" then {i}"
    forks += sgl.gen("b", max_tokens=5, temperature=0, ignore_eos=True)
    forks.join()


def test_program_on_a_tiny_random_model_matches_transformers(tiny):
    from braid.lang.backends.engine import EngineBackend

    llm, hf = tiny
    tok = llm.tokenizer
    state = program.run(backend=EngineBackend(llm))

    def continuation(text: str, n: int) -> str:
        return tok.decode(hf_greedy(hf, tok.encode(text), n, eos=False))

    first = "the cat sat on the mat. "
    assert state["a"] == continuation(first, 6)
    before_select = first + state["a"] + " so"
    scores = []
    for c in (" the dog", " a bird", " it"):
        p, full = tok.encode(before_select), tok.encode(before_select + c)
        start = next((i for i, (x, y) in enumerate(zip(p, full)) if x != y), len(p))
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
        toks = [lp[i - 1, full[i]].item() for i in range(max(1, start), len(full))]
        scores.append(sum(toks) / len(toks))
    assert state["pick"] == (" the dog", " a bird", " it")[scores.index(max(scores))]
    base = before_select + state["pick"]
    assert state["b"] == [continuation(base + f" then {i}", 5) for i in range(2)]
    assert_kv_all_free_or_cached(llm)
