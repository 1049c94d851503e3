"""A constrained request never samples a token its grammar bans, whatever its sampling
parameters: the property behind SGLang's test_decode_json, which failed in about one run in
three with "token ... is not allowed by the grammar here".

The cause was the sampler's exponential noise: a uniform of exactly 1.0 (one token in 16.7M
per draw, so 0.3% of draws over a 49k vocabulary) gave noise 0, and `probs / noise` made that
token win whatever its probability (NaN for a banned token, which argmax takes as the
maximum). These tests sample tens of thousands of constrained tokens over a 49k vocabulary:
directly through the sampler with random masks and random parameters, and through the
scheduler on a tiny random model with SmolLM2's tokenizer, random grammars from the corpus,
random sampling parameters, with jump-forward on and off; every token must be accepted.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from braid import SamplingParams
from braid.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR
from braid.runtime.constrained.bitmask import bitmask_words
from braid.runtime.executor.sampler import Sampler, SamplingInput, bits_to_uniform
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.conftest import TINY, local_scheduler
from tests.runtime.json_schemas import CORPUS

VOCAB = 49152  # SmolLM2's


def random_params(rng: random.Random, vocab: int, sampled: bool = False, **extra) -> SamplingParams:
    """Sampling parameters drawn from everything the sampler applies (`sampled`: never
    greedy)."""
    bias = None
    if rng.random() < 0.3:
        bias = {rng.randrange(vocab): rng.choice([-100.0, -5.0, 5.0, 100.0]) for _ in range(8)}
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5, 3.0] + ([] if sampled else [0.0])),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        top_k=rng.choice([0, 0, 5, 50] + ([] if sampled else [1])),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.5]),
        presence_penalty=rng.choice([0.0, 0.0, 0.7, -0.7]),
        logit_bias=bias,
        seed=rng.randrange(1 << 31),
        **extra,
    )


def test_uniforms_never_reach_zero_or_one():
    extremes = torch.tensor([0, 1, 0xFF, 0xFFFFFFFE, 0xFFFFFFFF], dtype=torch.int64)
    u = bits_to_uniform(extremes)
    assert bool((u > 0).all()) and bool((u < 1).all())
    noise = -torch.log(u)
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


def test_sampler_never_draws_a_banned_token():
    """80 rows x 40 draws over a 49k vocabulary with random masks (from one allowed token to
    most of the vocabulary) and random parameters, every 8th row greedy: before the fix about
    8 of these draws picked a banned token (the chance of none: 3e-4)."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows, words = 80, bitmask_words(VOCAB)
    for step in range(40):
        logits = torch.randn(rows, VOCAB, generator=gen) * rng.choice([1.0, 4.0, 12.0])
        density = torch.tensor([rng.choice([0.0, 1e-4, 0.01, 0.3, 0.9]) for _ in range(rows)])
        allowed = torch.rand(rows, VOCAB, generator=gen) < density[:, None]
        allowed[torch.arange(rows), torch.randint(VOCAB, (rows,), generator=gen)] = True
        bits = torch.zeros(rows, words * 32, dtype=torch.int64)
        bits[:, :VOCAB] = allowed.long()
        packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
        mask = packed.sub(((packed >> 31) & 1) << 32).to(torch.int32)
        reqs = [
            SamplingInput(
                random_params(rng, VOCAB, sampled=r % 8 != 0),
                rng.randrange(1 << 32),
                [rng.randrange(VOCAB) for _ in range(4)],
                [rng.randrange(VOCAB) for _ in range(rng.randrange(6))],
                [],
            )
            for r in range(rows)
        ]
        ids = sampler.sample(logits, reqs, bitmask=mask, bitmask_rows=torch.arange(rows)).next_ids
        ok = allowed[torch.arange(rows), ids]
        bad = (~ok).nonzero().flatten().tolist()
        assert not bad, f"step {step}: rows {bad} drew a banned token"


@pytest.fixture(scope="module")
def tiny_smollm_vocab(tmp_path_factory, smollm2_dir):
    """A tiny random Llama over SmolLM2's vocabulary (49152 tokens) and tokenizer: grammars
    compile as for the real model, and a step costs milliseconds."""
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny-smollm-vocab")
    tok = load_tokenizer(smollm2_dir)
    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": VOCAB, "eos_token_id": tok.eos_token_id})
    torch.manual_seed(7)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path, tok


GRAMMARS = (
    [("regex", r) for r in (REGEX_INT, REGEX_FLOAT, REGEX_STR, r"(True|False)")]
    + [("choice", ["Paris", "London", "New York", "Lyon, France"])]
    + [("json_schema", s) for s in CORPUS.values()]
)


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "no-jump-forward"])
def test_every_constrained_token_is_accepted(tiny_smollm_vocab, jump_forward):
    path, tok = tiny_smollm_vocab
    sched = local_scheduler(
        path, frozenset({tok.eos_token_id}), kv_tokens=16384, disable_jump_forward=not jump_forward
    )
    rng = random.Random(1 if jump_forward else 2)
    prompts = [tok.encode(t) for t in ("Answer: ", '{"a": ', "The value is ", "JSON:\n")]
    specs: dict[str, tuple[str, object]] = {}
    tokens: dict[str, list[int]] = {}
    errors = []
    for rnd in range(10):
        for i in range(24):
            kind, spec = rng.choice(GRAMMARS)
            extra = {kind: spec, "max_tokens": rng.choice([8, 32, 64])}
            if rng.random() < 0.2:
                extra["logprobs"] = rng.choice([0, 3])  # no jump-forward for these
            rid = f"r{rnd}-{i}"
            specs[rid] = (kind, spec)
            sp = random_params(rng, VOCAB, **extra)
            sched.handle(GenerateReq(rid, rng.choice(prompts), sp, rng.randrange(1 << 31)))
        while sched.has_work:
            for out in sched.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.error:
                    errors.append((out.rid, out.error))
            sched.check_invariants()
    assert not errors, errors
    total = 0
    for rid, ids in tokens.items():
        m = sched.grammar_compiler.compile(*specs[rid]).matcher()
        for t in ids:
            if t == tok.eos_token_id:
                assert m.is_final, f"{rid}: EOS before the grammar could end"
                break
            m.advance(t)  # raises if the grammar bans t here
            total += 1
    assert len(tokens) == 10 * 24 and total >= 3000, total
    if jump_forward:
        assert sched.stats.jump_forward_tokens > 0
