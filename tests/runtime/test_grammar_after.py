"""A constraint that waits for the end of a reasoning model's thinking
(`GenerateReq.grammar_after`): the output is free until it ends with the marker tokens, then the
grammar applies from there, with jump-forward and with the overlap schedule; a marker that never
comes leaves the output free. On a tiny random model the marker is forced with a logit bias on
one token the grammar never allows."""

from __future__ import annotations

import functools
import re

import pytest

from braid import SamplingParams
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

REGEX = r'\{"code": "[A-Z]{2}", "ok": (true|false)\}'
MARK = 30  # ">" in the tiny byte-level BPE: never allowed by REGEX


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-grammar-after"))


@functools.cache
def _tokenizer(path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _accepted(path, ids: list[int]) -> bool:
    """Whether `ids` spell a whole match of REGEX."""
    return re.fullmatch(REGEX, _tokenizer(path).decode(ids)) is not None


def _requests(bias: float | None, after: list[int], opens: int | None = None) -> list[GenerateReq]:
    out = []
    for i, temperature in enumerate((0.0, 0.0, 0.9)):
        sp = SamplingParams(
            max_tokens=40,
            temperature=temperature,
            seed=i,
            regex=REGEX,
            logit_bias=None if bias is None else {MARK: bias},
        )
        msg = GenerateReq(f"r{i}", [3, 4, 5 + i], sp, i, grammar_after=list(after))
        msg.grammar_open = opens
        out.append(msg)
    return out


def _run(path, eos, reqs, overlap: bool = False):
    sched = local_scheduler(
        path, frozenset({eos}), kv_tokens=1024, overlap_schedule=overlap, dtype="float32"
    )
    for r in reqs:
        sched.handle(r)
    return sched, run_to_end(sched)


def test_the_grammar_applies_after_the_marker(tiny):
    path, eos = tiny
    sched, got = _run(path, eos, _requests(100.0, [MARK]))
    for rid, ids in got.items():
        # The bias makes the marker the first token (free text: allowed); from there on the
        # grammar masks it out, and the rest is exactly the constrained text.
        assert ids[0] == MARK, rid
        body = ids[1:-1] if ids[-1] == eos else ids[1:]
        assert _accepted(path, body), rid
        assert MARK not in body
    assert sched.stats.jump_forward_tokens > 0  # the grammar's forced text, after the marker


def test_without_grammar_after_the_grammar_applies_from_the_start(tiny):
    path, eos = tiny
    sched, got = _run(path, eos, _requests(100.0, []))
    for rid, ids in got.items():
        assert MARK not in ids, rid
        assert _accepted(path, ids[:-1] if ids[-1] == eos else ids), rid


def test_a_marker_that_never_comes_leaves_the_output_free(tiny):
    path, eos = tiny
    sched, got = _run(path, eos, _requests(-100.0, [MARK]))
    assert sched.stats.jump_forward_tokens == 0
    # A random model's free text is not the grammar's: no output is accepted.
    assert not any(_accepted(path, ids) for ids in got.values())
    assert all(MARK not in ids for ids in got.values())


def test_overlap_gives_the_same_tokens(tiny):
    path, eos = tiny
    _, want = _run(path, eos, _requests(100.0, [MARK]))
    sched, got = _run(path, eos, _requests(100.0, [MARK]), overlap=True)
    assert got == want
    assert sched.stats.constrained_steps_ahead > 0


@pytest.mark.parametrize("bias", [100.0, -100.0, None])
def test_the_first_token_decides_whether_the_model_thinks(tiny, bias):
    """With `grammar_open` (Qwen3: the model may or may not open `<think>`), the first token is
    the grammar's or the opening one; only the opening one defers the grammar (here the opening
    token is also the end marker, so the grammar starts right after it)."""
    path, eos = tiny
    _, got = _run(path, eos, _requests(bias, [MARK], opens=MARK))
    for rid, ids in got.items():
        body = ids[:-1] if ids[-1] == eos else ids
        if bias == 100.0:
            assert ids[0] == MARK, rid
        if bias == -100.0:
            assert ids[0] != MARK, rid
        if ids[0] == MARK:
            body = body[1:]
        assert _accepted(path, body), (rid, ids)
