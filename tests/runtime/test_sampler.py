"""The batched sampler on hand-made logits: each filter keeps exactly the tokens it should."""

from __future__ import annotations

import pytest
import torch

from braid import SamplingParams
from braid.runtime.executor.sampler import Sampler, SamplingInput, hash_uniform

V = 16


def _inp(seed=1, prompt=(1,), output=(), stop=(), **kw) -> SamplingInput:
    return SamplingInput(SamplingParams(**kw), seed, list(prompt), list(output), list(stop))


def _draws(logits_row, n=300, **kw):
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([logits_row] * n, dtype=torch.float32)
    reqs = [_inp(seed=s, **kw) for s in range(n)]
    return set(sampler.sample(logits, reqs).next_ids.tolist())


ROW = [float(x) for x in torch.linspace(3.0, -3.0, V)]  # token 0 most likely, 15 least


def test_top_k_keeps_the_k_most_likely():
    assert _draws(ROW, temperature=1.0, top_k=3) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor(ROW).softmax(-1)
    cum = probs.cumsum(-1)
    keep = int((cum < 0.8).sum()) + 1  # tokens needed to reach 0.8
    drawn = _draws(ROW, n=600, temperature=1.0, top_p=0.8)
    assert drawn <= set(range(keep)) and len(drawn) == keep


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor(ROW).softmax(-1)
    allowed = {i for i in range(V) if probs[i] >= 0.3 * probs[0]}
    assert _draws(ROW, temperature=1.0, min_p=0.3) == allowed


def test_temperature_zero_is_argmax_whatever_the_seed():
    assert _draws(ROW, temperature=0.0) == {0}


def test_penalties_follow_their_formulas():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([ROW], dtype=torch.float32)
    out_ids = [0, 0, 5]
    req = _inp(prompt=[7], output=out_ids, frequency_penalty=0.5, presence_penalty=0.25)
    got = logits.clone()
    sampler._apply_penalties(got, [req])
    want = logits.clone()
    want[0, 0] -= 2 * 0.5 + 0.25
    want[0, 5] -= 1 * 0.5 + 0.25
    assert torch.allclose(got, want)

    req = _inp(prompt=[7], output=[0, 15], repetition_penalty=2.0)
    got = logits.clone()
    sampler._apply_penalties(got, [req])
    want = logits.clone()
    want[0, 0] /= 2.0  # positive logit: divided
    want[0, 15] *= 2.0  # negative logit: multiplied
    want[0, 7] = want[0, 7] / 2.0 if want[0, 7] > 0 else want[0, 7] * 2.0  # prompt counts too
    assert torch.allclose(got, want)

    # Both kinds together: repetition first, then frequency (vLLM's order).
    row = torch.tensor([[0.5] * V])
    req = _inp(prompt=[9], output=[3], repetition_penalty=2.0, frequency_penalty=1.0)
    sampler._apply_penalties(row, [req])
    assert row[0, 3].item() == pytest.approx(0.5 / 2.0 - 1.0)


def test_min_tokens_masks_stop_tokens_until_reached():
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([ROW, ROW], dtype=torch.float32)
    reqs = [
        _inp(output=[3], stop=[0], temperature=0.0, min_tokens=2),  # 1 < 2: token 0 banned
        _inp(output=[3, 4], stop=[0], temperature=0.0, min_tokens=2),  # reached: allowed
    ]
    assert sampler.sample(logits, reqs).next_ids.tolist() == [1, 0]


def test_noise_depends_only_on_seed_step_and_token():
    seeds = torch.tensor([5, 9, 5])
    steps = torch.tensor([0, 0, 3])
    u = hash_uniform(seeds, steps, 1000)
    assert torch.equal(u[0], hash_uniform(torch.tensor([5]), torch.tensor([0]), 1000)[0])
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert 0 < u.min() and u.max() < 1
    # Roughly uniform: mean near 1/2.
    assert (
        abs(hash_uniform(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096).mean() - 0.5)
        < 0.01
    )


def test_allowed_token_ids_keep_only_those_tokens():
    assert _draws(ROW, temperature=1.0, allowed_token_ids=[3, 9, 14]) == {3, 9, 14}
    assert _draws(ROW, temperature=0.0, allowed_token_ids=[14, 9]) == {9}  # the likelier one


def test_a_bad_word_bans_its_last_token_only_after_its_first_ones():
    def bad(output, words):
        params = SamplingParams(temperature=0.0, bad_words_token_ids=words)
        req = SamplingInput(params, 1, [1], list(output), [])
        logits = torch.tensor([ROW], dtype=torch.float32)
        return Sampler(V, torch.device("cpu")).sample(logits, [req]).next_ids.item()

    assert bad([], [[0]]) == 1  # a one-token word: banned everywhere
    assert bad([], [[4, 0]]) == 0  # no 4 before: 0 stays allowed
    assert bad([7, 4], [[4, 0]]) == 1  # the output ends with 4: 0 is banned
    assert bad([4, 7], [[4, 0]]) == 0
    assert bad([2, 3], [[2, 3, 0], [3, 1], [9, 0]]) == 2  # both matching words ban their last
    # Speculative drafts count as output (`SamplingInput.after`).
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 0]])
    draft = SamplingInput(params, 1, [1], [], []).after([5])
    logits = torch.tensor([ROW], dtype=torch.float32)
    assert Sampler(V, torch.device("cpu")).sample(logits, [draft]).next_ids.item() == 1


def test_ids_past_the_logits_width_are_left_out():
    """A draft model's smaller vocabulary: allowed ids, biases, banned words and stop ids past
    its logits are dropped there (the target's verify applies them), never an index error."""
    sampler = Sampler(V, torch.device("cpu"))
    logits = torch.tensor([ROW, ROW], dtype=torch.float32)
    reqs = [
        _inp(temperature=0.0, allowed_token_ids=[2, V + 3], logit_bias={V + 1: 5.0}),
        SamplingInput(
            SamplingParams(temperature=0.0, min_tokens=2, bad_words_token_ids=[[V + 2], [0]]),
            1,
            [1],
            [],
            [1, V + 5],
        ),
    ]
    assert sampler.sample(logits, reqs).next_ids.tolist() == [2, 2]


def test_bad_words_take_the_spaced_form_only_where_it_is_another_word():
    from braid.runtime.tokenizer.tokenizer import bad_words_token_ids

    vocab = {"bad": [5], " bad": [7], "big deal": [3, 4], " big deal": [8, 4], " spaced": [1, 9]}
    vocab["spaced"] = [9]
    encode = vocab.__getitem__
    assert bad_words_token_ids(["bad", " big deal"], encode) == [[5], [7], [3, 4], [8, 4]]
    # A tokenizer that spells the space as a token: no second form (it would be a two-token
    # word, read from the output at every step, for nothing).
    assert bad_words_token_ids(["spaced"], encode) == [[9]]
    with pytest.raises(ValueError, match="makes no tokens"):
        bad_words_token_ids(["x"], {"x": [], " x": []}.__getitem__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_samplers_edits_never_wait_for_the_device():
    """A step run ahead samples behind the forward just queued: every edit (allowed ids, bad
    words, logit bias, min_tokens, a grammar-free draw) must queue without the host waiting
    for the device. torch's sync debug mode raises on any op that would wait."""
    dev = torch.device("cuda")
    vocab = 4096
    sampler = Sampler(vocab, dev)
    logits = torch.randn(4, vocab, device=dev)
    reqs = [
        SamplingInput(
            SamplingParams(temperature=0.0, allowed_token_ids=[7, 9, 4000]), 1, [1], [], []
        ),
        SamplingInput(
            SamplingParams(temperature=0.0, bad_words_token_ids=[[3], [5, 6]]), 1, [1], [5], []
        ),
        SamplingInput(SamplingParams(temperature=0.8, logit_bias={11: 3.0}), 2, [1], [], []),
        SamplingInput(SamplingParams(temperature=0.0, min_tokens=3), 1, [1], [], [2, 8]),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = sampler.sample(logits, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = result.next_ids.tolist()
    assert ids[0] in (7, 9, 4000) and ids[1] not in (3, 6)
