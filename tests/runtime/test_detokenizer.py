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


# "1, 2, 3, 4, 5," continues as " 6, 7, 8, 9"; SmolLM2 gives each character its own token.
COUNT_PROMPT = "1, 2, 3, 4, 5,"
COUNT_ON = " 6, 7, 8, 9"


def _stream(d: IncrementalDetokenizer, ids: list[int], chunk: int) -> str:
    """Feed `ids` `chunk` at a time and return what is streamed, as the detokenizer process
    sends it: up to `stream_safe_len` while running, the whole text once stopped or finished."""
    sent, pieces = 0, []
    for i in range(0, len(ids), chunk):
        d.add_tokens(ids[i : i + chunk])
        if d.stopped:
            break
        end = d.stream_safe_len()
        pieces.append(d.text[sent:end])
        sent = max(sent, end)
    else:
        d.finish()
    pieces.append(d.text[sent:])
    return "".join(pieces)


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize(
    "min_tokens, stop, want, stop_reason, tokens",
    [
        # "," is token 3; min_tokens 4 exempts tokens 1-4 (" 6, "), so the "," of token 6 stops.
        (4, (",",), " 6, 7", ",", 6),
        # A shorter stop string wholly in the exempt text is not found through a longer one's
        # look-back.
        (4, (",", " 6, 7, 8, 9, 10"), " 6, 7", ",", 6),
        # " 6" lies in the exempt text and never comes again: the request runs to its end.
        (5, (" 6",), " 6, 7, 8, 9", None, 11),
    ],
)
def test_stop_strings_in_min_tokens_text_are_not_matched(
    tok, min_tokens, stop, want, stop_reason, tokens, chunk
):
    ids = tok.encode(COUNT_ON, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(COUNT_PROMPT), stop=stop, min_tokens=min_tokens)
    streamed = _stream(d, ids, chunk)
    assert d.text == want and d.stop_reason == stop_reason
    assert streamed == d.text  # nothing streamed is taken back
    if chunk == 1:
        assert d.num_output_tokens == tokens


@pytest.mark.parametrize("chunk", [1, 100])
@pytest.mark.parametrize(
    "stop, want",
    [
        # Ends at token 3, the last exempt one: not matched; the next "," (token 6) is.
        ((",",), " 6, 7"),
        # Begins in the exempt text (token 3) and is completed by token 5: matched and cut where
        # it begins, though the held-back "," and " " came from exempt tokens.
        ((", 7",), " 6"),
    ],
)
def test_stop_string_at_the_min_tokens_boundary(tok, stop, want, chunk):
    ids = tok.encode(COUNT_ON, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(COUNT_PROMPT), stop=stop, min_tokens=3)
    streamed = _stream(d, ids, chunk)
    assert d.text == want and d.stop_reason == stop[0]
    assert streamed == d.text


@pytest.mark.parametrize(
    "pattern, want",
    [
        # "6," ends in the exempt text (" 6,"); "7," is the first match ending after it.
        (r"\d,", " 6, 7,"),
        # ",\s7" begins in the exempt text and ends after it.
        (r",\s7", " 6, 7"),
        # ", 7" overlaps "6,", a match that ends in the exempt text and does not hide it.
        (r"6,|, 7", " 6, 7"),
    ],
)
def test_stop_regex_matches_only_past_min_tokens_text(tok, pattern, want):
    ids = tok.encode(COUNT_ON, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(COUNT_PROMPT), stop_regex=(pattern,), min_tokens=3)
    streamed = _stream(d, ids, 1)
    assert d.text == want and d.stop_reason == pattern
    assert streamed == d.text
