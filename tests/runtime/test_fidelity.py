"""Greedy float32 tokens equal transformers' `generate`, token for token, for every supported
architecture, for each request alone and inside one batch of mixed prompt lengths."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import braid
from tests.conftest import ARCHS, hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 40, 9, 31][:n]
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_models_match_transformers_alone_and_batched(tiny_model_dirs, arch, page_size):
    path = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = _prompts(5, 512, seed=zlib.crc32(arch.encode()))
    new_tokens = 12
    expected = [hf_greedy(hf, p, new_tokens, eos=False) for p in prompts]
    sp = braid.SamplingParams(max_tokens=new_tokens, **GREEDY)
    with braid.LLM(path, kv_tokens=1024, page_size=page_size, show_progress=False) as llm:
        alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.check_invariants()
    assert alone == expected
    assert batched == expected


def test_sliding_window_is_applied(tiny_model_dirs):
    """Mistral's window (24 in the tiny config) matters once the sequence is longer."""
    path = tiny_model_dirs["mistral"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = _prompts(5, 512, seed=7)[2] + _prompts(5, 512, seed=8)[2]  # 80 tokens
    expected = hf_greedy(hf, prompt, 10, eos=False)
    with braid.LLM(path, kv_tokens=1024, show_progress=False) as llm:
        got = llm.generate([prompt], braid.SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected


SMOL_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
]


def test_smollm2_matches_transformers_alone_and_batched(smollm2, hf_smollm2):
    tok = smollm2.tokenizer
    ids = [tok.encode(p) for p in SMOL_PROMPTS]
    chat = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 2+2?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    ids.append(chat)
    expected = [hf_greedy(hf_smollm2, p, 20) for p in ids]
    sp = braid.SamplingParams(temperature=0.0, max_tokens=20)
    alone = [smollm2.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in ids]
    batched = [o.outputs[0].token_ids for o in smollm2.generate(ids, sp, use_tqdm=False)]
    assert alone == expected
    assert batched == expected
    # The chat prompt ends on EOS well before 20 tokens: the stop must be where HF stops.
    assert expected[-1][-1] in smollm2.eos_token_ids
    smollm2.check_invariants()
