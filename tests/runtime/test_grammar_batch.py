"""A step's constrained rows in batch: masks filled (and xgrammar's grammars advanced) many at a
time by the grammar library's own native threads (llguidance's `LLExecutor`, xgrammar's
`BatchGrammarMatcher`), which must give exactly what one matcher at a time gives, and the
masks of a step run ahead filled in the grammar manager's mask thread beside the scheduler's.
These machines have too few CPUs for the threads to pay, so the tests lower the threshold
(`PARALLEL_MIN_CPUS`) to run the threaded path here."""

from __future__ import annotations

import pytest
import torch

from braid import SamplingParams
from braid.runtime.constrained import grammar as grammar_module
from braid.runtime.constrained.bitmask import BitmaskBuffer, bitmask_words
from braid.runtime.constrained.grammar import PARALLEL_MIN_ROWS, GrammarCompiler
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# Texts that leave a matcher in different states: start, in a key, in a string, in a number.
PREFIXES = ["", '{"na', '{"name": "Al', '{"name": "Al", "age": 4', '{"name": "', "{"]
THREADED = ("llguidance", "xgrammar")


@pytest.fixture
def threaded(monkeypatch):
    """Batch operations go through the libraries' thread pools on this machine too."""
    from braid.runtime.constrained import llguidance_backend, xgrammar_backend

    monkeypatch.setattr(grammar_module, "PARALLEL_MIN_CPUS", 1)
    llguidance_backend._executor.cache_clear()
    xgrammar_backend._batch.cache_clear()
    assert llguidance_backend._executor() is not None and xgrammar_backend._batch() is not None
    yield
    llguidance_backend._executor.cache_clear()
    xgrammar_backend._batch.cache_clear()


def _matchers(compiler, tok, n: int):
    grammar = compiler.compile("json_schema", SCHEMA)
    matchers = [grammar.matcher() for _ in range(n)]
    for i, m in enumerate(matchers):
        for t in tok.encode(PREFIXES[i % len(PREFIXES)], add_special_tokens=False):
            m.advance(t)
    return matchers


@pytest.mark.parametrize("backend", THREADED)
def test_threaded_fill_writes_the_masks_one_matcher_at_a_time_writes(smollm2, backend, threaded):
    compiler = GrammarCompiler(smollm2.tokenizer, backend, fallback=False)
    n = PARALLEL_MIN_ROWS + 5
    matchers = _matchers(compiler, smollm2.tokenizer, n)
    words = bitmask_words(compiler.vocab.size)
    want = torch.full((n, words), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(want[i])
    rows = list(range(n))[::-1]  # each matcher to another row of the logits
    extra = [(3, 7)]  # mask row 3 also allows token 7 (a first token that may open thinking)
    mask, idx = BitmaskBuffer(words, torch.device("cpu")).fill(matchers, rows, extra)
    assert idx.tolist() == rows
    want[3].view(torch.uint8)[0] |= 1 << 7
    assert torch.equal(mask, want)
    assert len({tuple(r.tolist()) for r in want}) == len(PREFIXES), "states differ"


@pytest.mark.parametrize("backend", THREADED)
def test_threaded_advance_moves_each_grammar_and_names_a_refused_token(smollm2, backend, threaded):
    tok = smollm2.tokenizer
    compiler = GrammarCompiler(tok, backend, fallback=False)
    n = PARALLEL_MIN_ROWS + 4
    batch, alone = _matchers(compiler, tok, n), _matchers(compiler, tok, n)
    # Each matcher gets a token its grammar allows, except row 5, which gets one it does not.
    tokens = [m.allowed_tokens()[len(m.allowed_tokens()) // 2] for m in alone]
    bad = next(t for t in range(compiler.vocab.size) if t not in set(alone[5].allowed_tokens()))
    tokens[5] = bad
    errors = type(batch[0]).advance_many(batch, tokens)
    assert len(errors) == n
    assert errors[5] is not None and f"token {bad} is not allowed" in errors[5]
    for i, (m, t) in enumerate(zip(alone, tokens)):
        if i == 5:
            continue
        assert errors[i] is None, (i, errors[i])
        m.advance(t)
        assert sorted(batch[i].allowed_tokens()) == sorted(m.allowed_tokens()), i


KEYED = r'\{"code": "[A-Z]{2}", "n": [0-9]{1,3}, "ok": (true|false)\}'


@pytest.fixture(scope="module")
def tiny_constrained(tmp_path_factory):
    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-grammar-batch"))


def _run(path, eos: int, backend: str) -> dict[str, list[int]]:
    sched = local_scheduler(
        path,
        frozenset({eos}),
        kv_tokens=2048,
        dtype="float32",
        device="cpu",
        grammar_backend=backend,
        overlap_schedule=True,
    )
    for i in range(PARALLEL_MIN_ROWS + 8):
        temperature = 0.0 if i % 2 else 0.9
        sp = SamplingParams(max_tokens=30, temperature=temperature, seed=i, regex=KEYED)
        sched.handle(GenerateReq(f"r{i}", [3, 4, 5 + i % 7], sp, i))
    got = run_to_end(sched)
    assert sched.grammars.masked_rows >= PARALLEL_MIN_ROWS * 10
    return got


@pytest.mark.parametrize("backend", THREADED)
def test_a_batch_of_constrained_requests_gets_the_same_tokens_threaded(
    tiny_constrained, backend, monkeypatch
):
    """24 constrained rows a step, greedy and sampled, with jump-forward and overlap: the same
    tokens with the threaded batch operations as one matcher at a time."""
    from braid.runtime.constrained import llguidance_backend, xgrammar_backend

    plain = _run(*tiny_constrained, backend)
    monkeypatch.setattr(grammar_module, "PARALLEL_MIN_CPUS", 1)
    llguidance_backend._executor.cache_clear()
    xgrammar_backend._batch.cache_clear()
    try:
        threaded = _run(*tiny_constrained, backend)
    finally:
        llguidance_backend._executor.cache_clear()
        xgrammar_backend._batch.cache_clear()
    assert threaded == plain
    assert len(plain) == PARALLEL_MIN_ROWS + 8


MARK = 30  # ">" in the tiny byte-level BPE: never allowed by WORDS
# Long stretches the overlap schedule runs ahead through, then text to jump over.
WORDS = r"[a-z]{3,40} is done\."


def _mixed_requests() -> list[GenerateReq]:
    """Constrained requests, greedy and sampled; every fourth one's grammar waits for the end
    of its thinking (a marker its bias forces first), every fourth after that one's first token
    decides whether it thinks."""
    out = []
    for i in range(PARALLEL_MIN_ROWS + 8):
        sp = SamplingParams(
            max_tokens=30,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            regex=WORDS,
            logit_bias={MARK: 100.0} if i % 4 in (1, 3) else None,
        )
        after = [MARK] if i % 4 in (1, 3) else []
        msg = GenerateReq(f"r{i}", [3, 4, 5 + i % 7], sp, i, grammar_after=after)
        msg.grammar_open = MARK if i % 4 == 3 else None
        out.append(msg)
    return out


@pytest.mark.parametrize("backend", THREADED)
def test_masks_filled_beside_the_step_give_the_same_tokens(tiny_constrained, backend, threaded):
    """With the overlap schedule the mask thread fills a step's rows (`start_fill`) while the
    scheduler applies the step before: the same tokens as without overlap, with jump-forward
    waiting for the fill, and rows whose grammar waits for the end of thinking (filled after
    it) in the same batch."""
    path, eos = tiny_constrained
    got = {}
    for overlap in (False, True):
        sched = local_scheduler(
            path,
            frozenset({eos}),
            kv_tokens=2048,
            dtype="float32",
            device="cpu",
            grammar_backend=backend,
            overlap_schedule=overlap,
        )
        for msg in _mixed_requests():
            sched.handle(msg)
        got[overlap] = run_to_end(sched)
    assert got[True] == got[False]
    assert len(got[True]) == PARALLEL_MIN_ROWS + 8
    assert sum(ids[0] == MARK for ids in got[True].values()) >= PARALLEL_MIN_ROWS // 2
    assert sched.stats.constrained_steps_ahead > 10
    assert sched.grammars.early_rows >= PARALLEL_MIN_ROWS * 10
    assert sched.stats.jump_forward_tokens > 0


def test_masks_are_filled_in_the_step_without_the_mask_thread(tiny_constrained, threaded):
    """`disable_grammar_mask_thread`: the same tokens, every row filled when the step
    samples."""
    path, eos = tiny_constrained
    sched = local_scheduler(
        path,
        frozenset({eos}),
        kv_tokens=2048,
        dtype="float32",
        overlap_schedule=True,
        disable_grammar_mask_thread=True,
    )
    for msg in _mixed_requests():
        sched.handle(msg)
    got = run_to_end(sched)
    assert sched.grammars.early_rows == 0 and sched.stats.constrained_steps_ahead > 10
    sched = local_scheduler(
        path, frozenset({eos}), kv_tokens=2048, dtype="float32", overlap_schedule=True
    )
    for msg in _mixed_requests():
        sched.handle(msg)
    assert run_to_end(sched) == got
    assert sched.grammars.early_rows > 0
