"""Incremental detokenization: the streamed text equals a full decode, never carries a broken
character, and stop strings cut it where they start, even across token boundaries."""

from __future__ import annotations

import random

import pytest

from braid.runtime.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 🎉🚀 and accents: café, naïve, Zürich.",
    "中文测试：你好，世界。日本語もテストします。",
    "  leading spaces\n\nnew lines\ttabs and 12345 numbers",
    "Mixed ✓ symbols ≤ ≥ ∑ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tok, text):
    prompt = tok.encode("Prompt:")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add_tokens([t]) for t in ids]
    assert "".join(pieces) == d.text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_tokens_in_random_chunks_give_the_same_text(tok):
    rng = random.Random(0)
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [])
    i = 0
    while i < len(ids):
        k = rng.randint(1, 4)
        d.add_tokens(ids[i : i + k])
        i += k
    assert d.text == tok.decode(ids)


def test_stop_string_across_token_boundaries(tok):
    text = "The answer is forty-two, my friend."
    ids = tok.encode(text, add_special_tokens=False)
    for stop, include, want in [
        ("forty-two", False, "The answer is "),
        ("forty-two", True, "The answer is forty-two"),
        ("y-t", False, "The answer is fort"),
        (", my", False, "The answer is forty-two"),
    ]:
        d = IncrementalDetokenizer(tok, [], stop=(stop,), include_stop_str_in_output=include)
        for t in ids:
            d.add_tokens([t])
            if d.stopped:
                break
        assert d.text == want and d.stop_reason == stop
        assert d.add_tokens([ids[-1]]) == ""  # nothing after the stop


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=("delta", "beta"))
    d.add_tokens(ids)
    assert d.text == "alpha " and d.stop_reason == "beta"


def test_stream_holds_back_a_possible_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, [], stop=("STOP",))
    d.add_tokens(tok.encode("hello ST", add_special_tokens=False))
    assert d.text == "hello ST"
    assert d.text[: d.stream_safe_len()] == "hello "


def test_min_tokens_delays_stop_strings(tok):
    ids = tok.encode("a b a b a b", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=("b",), min_tokens=4)
    for t in ids:
        d.add_tokens([t])
        if d.stopped:
            break
    # "b" appears at token 2 but may only end generation from the 4th token on.
    assert d.stopped and d.num_output_tokens >= 4


def test_fast_decoder_decodes_as_the_transformers_tokenizer(tok, smollm2_dir):
    from braid.runtime.tokenizer.tokenizer import FastDecoder

    fast = FastDecoder(smollm2_dir)
    rng = random.Random(1)
    samples = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    samples += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 20))] for _ in range(200)]
    samples.append(tok.encode("<|im_start|>user\nHi, it's me!<|im_end|>", add_special_tokens=False))
    for ids in samples:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )


def test_stop_regex_ends_where_the_match_ends(tok):
    ids = tok.encode("Item 12: apples, item 13: pears.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop_regex=(r"\d+:",))
    pieces = []
    for t in ids:
        pieces.append(d.add_tokens([t]))
        if d.stopped:
            break
    assert d.text == "Item 12:" and d.stop_reason == r"\d+:"
    assert "".join(pieces) == d.text  # nothing streamed is taken back


def test_stop_regex_never_cuts_what_was_already_checked(tok):
    # "a(?=b)" matches only once the "b" arrives; its match ends before the text already
    # checked (and perhaps streamed), so the cut falls at the checked end instead.
    d = IncrementalDetokenizer(tok, [], stop_regex=(r"a(?=b)",))
    d.add_tokens(tok.encode("xa", add_special_tokens=False))
    assert not d.stopped
    d.add_tokens(tok.encode("b", add_special_tokens=False))
    assert d.stopped and d.text == "xa"


def test_a_character_cut_off_by_the_end_of_the_request_is_flushed_at_finish(tok):
    ids = tok.encode("Party time 🎉", add_special_tokens=False)
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.add_tokens([t]) for t in ids[:cut])
    assert "\ufffd" not in streamed  # held back while the request runs
    tail = d.finish()
    assert tail.endswith("\ufffd") and d.text == streamed + tail == tok.decode(ids[:cut])
    assert d.finish() == ""


def test_finish_adds_nothing_after_a_stop_string(tok):
    ids = tok.encode("Stop here 🎉", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=("here",))
    for t in ids[:-1]:
        d.add_tokens([t])
    assert d.stopped and d.finish() == "" and d.text == "Stop "
