"""Speculative decoding: drafts verified in one decode forward, the longest run the target
agrees with kept. The output must be exactly what decoding without speculation gives, token for
token, greedy or sampled (braid's draws are counter-based, so a sampled row keeps a draft only
when the target's own draw there picks it), with logprobs, penalties, stop tokens, grammars,
retraction and aborts; the KV of rejected drafts is freed at once and never cached."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from braid import SamplingParams
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.speculative.base import Proposer
from braid.runtime.speculative.ngram import lookup
from tests.conftest import hf_greedy, local_scheduler
from tests.runtime import spec_heads

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- n-gram lookup ------------------------------------------------------------------------------
def test_ngram_lookup_takes_the_longest_suffix_at_its_most_recent_earlier_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3, 6, 1, 2, 3])
    # [1, 2, 3] occurred at 0 and 4; the most recent is followed by 8, 7, 5.
    assert lookup(t, 1, 4, 3) == [8, 7, 5]
    # Only [2, 3] allowed: its most recent earlier occurrence (at 10) is followed by 6, 1.
    assert lookup(t, 1, 2, 2) == [6, 1]
    # Past the end of the text, the run after the match repeats.
    assert lookup(t, 1, 4, 11) == [8, 7, 5, 2, 3, 6, 1, 2, 3, 8, 7]


def test_ngram_lookup_drafts_a_whole_loop():
    loop = np.array([4, 5, 6] + [7] * 6)
    assert lookup(loop, 1, 4, 4) == [7, 7, 7, 7]  # not just the two 7s after the latest match
    assert lookup(np.array([1, 8, 9, 1, 8, 9, 1, 8]), 1, 2, 5) == [9, 1, 8, 9, 1]


def test_ngram_lookup_never_matches_the_suffix_itself():
    assert lookup(np.array([4, 5, 6, 7]), 1, 3, 4) == []
    assert lookup(np.array([5, 5]), 1, 3, 4) == [5, 5, 5, 5]  # a loop: 5 follows 5
    assert lookup(np.array([1, 2, 1, 2]), 2, 2, 1) == [1]
    assert lookup(np.array([1, 2, 3]), 3, 3, 1) == []  # too short to hold an earlier match


# ---- a proposer that knows the future ----------------------------------------------------------
class Oracle(Proposer):
    """Proposes the tokens a plain run gave each request (by rid), passed through `corrupt`
    (position, token) -> token when given."""

    name = "ORACLE"

    def __init__(self, futures: dict[str, list[int]], corrupt: Callable | None = None) -> None:
        self.futures = futures
        self.corrupt = corrupt
        self.released: list[str] = []

    @classmethod
    def from_config(cls, config, target):  # built by the tests themselves
        raise NotImplementedError

    def propose(self, reqs: Sequence, limits: Sequence[int]) -> list[list[int]]:
        out = []
        for r, k in zip(reqs, limits):
            done = len(r.output_ids)
            drafts = list(self.futures.get(r.rid, [])[done : done + k])
            if self.corrupt is not None:
                drafts = [self.corrupt(done + i, t) for i, t in enumerate(drafts)]
            out.append(drafts)
        return out

    def release(self, req) -> None:
        self.released.append(req.rid)


def _spec_scheduler(path, proposer: Proposer | None, **config):
    """A local scheduler, speculative with `proposer` when given (the n-gram proposer swapped
    for it)."""
    if proposer is None:
        return local_scheduler(path, **config)
    sched = local_scheduler(path, speculative_algorithm="NGRAM", **config)
    sched.proposer = sched.decode.drafter.proposer = proposer
    sched.kv.on_release = proposer.release
    return sched


def _run(sched, reqs: list[GenerateReq], abort: Callable | None = None) -> dict[str, dict]:
    """Every request's tokens, logprobs and finish reason; invariants checked each step."""
    got: dict[str, dict] = {}
    for r in reqs:
        sched.handle(r)
    step = 0
    while sched.has_work:
        outs = sched.step()
        if abort is not None:
            outs += [o for rid in abort(step) for o in sched.handle(AbortReq(rid))]
        for out in outs:
            g = got.setdefault(out.rid, {"ids": [], "lp": [], "finish": None, "spec": None})
            g["ids"] += out.new_token_ids
            g["lp"] += [(lp.token_id, round(lp.logprob, 5)) for lp in out.logprobs or []]
            g["finish"] = out.finish_reason
            g["spec"] = out.spec
        sched.check_invariants()
        step += 1
    a = sched.kv.allocator
    assert a.free_pages + sched.kv.cache.total_pages == a.capacity_pages
    assert sched.kv.table.free_slots == sched.kv.table.size
    return got


def _mixed(n: int, vocab: int, stop_token: int | None = None) -> list[GenerateReq]:
    """Greedy, sampled (top-p, top-k), penalised, min-tokens and logprob requests."""
    kinds = [
        dict(max_tokens=24, **GREEDY),
        dict(max_tokens=20, temperature=0.9, top_p=0.9, ignore_eos=True),
        dict(max_tokens=18, temperature=1.1, top_k=20, ignore_eos=True),
        dict(max_tokens=16, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
        dict(max_tokens=15, min_tokens=9, temperature=0.7),
        dict(max_tokens=14, logprobs=3, temperature=0.8, ignore_eos=True),
    ]
    reqs = []
    for i in range(n):
        kw = dict(kinds[i % len(kinds)])
        if stop_token is not None:
            kw["stop_token_ids"] = [stop_token]
        prompt = [(7 * i + j) % (vocab - 1) + 1 for j in range(3 + i % 5)]
        reqs.append(GenerateReq(f"r{i}", prompt, SamplingParams(seed=i, **kw), 1000 + i))
    return reqs


CFG = dict(kv_tokens=2048, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="module")
def plain(tiny):
    reqs = _mixed(12, 512)
    return reqs, _run(_spec_scheduler(tiny, None, **CFG), reqs)


def test_right_drafts_are_all_kept_and_change_nothing(tiny, plain):
    reqs, want = plain
    oracle = Oracle({rid: g["ids"] for rid, g in want.items()})
    sched = _spec_scheduler(tiny, oracle, **CFG)
    got = _run(sched, reqs)
    for rid, w in want.items():
        assert (got[rid]["ids"], got[rid]["lp"], got[rid]["finish"]) == (
            w["ids"],
            w["lp"],
            w["finish"],
        ), rid
    s = sched.stats
    # Every draft is the token the target samples: all kept, 4 + 1 tokens a step.
    assert s.spec_draft_tokens > 100 and s.spec_accepted_tokens == s.spec_draft_tokens
    assert s.spec_accept_length > 3.5
    assert sorted(oracle.released) == sorted(want), "each request's state released once"
    spec = got["r0"]["spec"]
    assert spec.accepted_drafts == spec.proposed_drafts > 0 and spec.verify_steps < 24


def test_wrong_drafts_are_rejected_and_change_nothing(tiny, plain):
    """Drafts often wrong (about one in three, first drafts too): the same tokens, logprobs
    and finish reasons as decoding without speculation, greedy and sampled alike."""
    reqs, want = plain

    def corrupt(pos: int, tok: int) -> int:
        return (tok * 31 + 7) % 512 if (pos * 7 + tok) % 3 == 0 else tok

    sched = _spec_scheduler(tiny, Oracle({r: g["ids"] for r, g in want.items()}, corrupt), **CFG)
    got = _run(sched, reqs)
    for rid, w in want.items():
        assert (got[rid]["ids"], got[rid]["lp"], got[rid]["finish"]) == (
            w["ids"],
            w["lp"],
            w["finish"],
        ), rid
    s = sched.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens


def test_a_stop_token_inside_a_kept_run_ends_the_request_there(tiny):
    reqs = _mixed(6, 512)
    free = _run(_spec_scheduler(tiny, None, **CFG), reqs)
    # A token from the middle of the first greedy output becomes a stop token.
    stop = free["r0"]["ids"][6]
    reqs = _mixed(6, 512, stop_token=stop)
    want = _run(_spec_scheduler(tiny, None, **CFG), reqs)
    oracle = Oracle({rid: g["ids"] for rid, g in free.items()})  # drafts run past the stop
    got = _run(_spec_scheduler(tiny, oracle, **CFG), reqs)
    assert got == {rid: g | {"spec": got[rid]["spec"]} for rid, g in want.items()}
    assert want["r0"]["finish"] == "stop" and want["r0"]["ids"][-1] == stop
    assert len(want["r0"]["ids"]) < len(free["r0"]["ids"])


def test_memory_pressure_and_aborts_mid_speculation_leak_no_kv(tiny):
    """200 requests through a pool that holds a few at a time (retractions), some aborted
    while their drafts are in flight: the invariants hold every step, nothing leaks, and the
    requests nothing aborted get the tokens they get without speculation."""
    reqs = _mixed(200, 512)
    small = dict(CFG, kv_tokens=160, page_size=4)
    want = _run(_spec_scheduler(tiny, None, **small), reqs)
    rng = random.Random(7)
    aborted = {f"r{i}" for i in rng.sample(range(200), 40)}
    order = sorted(aborted)

    def abort(step: int) -> list[str]:
        return [order.pop()] if order and step % 3 == 1 else []

    oracle = Oracle(
        {rid: g["ids"] for rid, g in want.items()},
        lambda pos, tok: tok if pos % 4 else (tok + 1) % 512,
    )
    sched = _spec_scheduler(tiny, oracle, **small)
    got = _run(sched, reqs, abort)
    assert sched.stats.retractions > 0 and sched.stats.spec_accepted_tokens > 0
    kept = [rid for rid in want if got[rid]["finish"] != "abort"]
    assert len(kept) >= 150
    for rid in kept:
        assert got[rid]["ids"] == want[rid]["ids"], rid


def test_smollm2_greedy_with_ngram_drafts_equals_transformers(smollm2_dir, smollm2, hf_smollm2):
    """Real weights, a copy-heavy prompt: n-gram drafts are often right, and greedy output is
    transformers' token for token."""
    tok = smollm2.tokenizer
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Copy this code exactly:\n" + code}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok.encode(chat, add_special_tokens=False)
    want = hf_greedy(hf_smollm2, ids, 40)
    eos = frozenset({tok.eos_token_id})
    sched = local_scheduler(smollm2_dir, eos, speculative_algorithm="NGRAM", **CFG)
    got = _run(sched, [GenerateReq("r", ids, SamplingParams(max_tokens=40, temperature=0.0), 0)])
    assert got["r"]["ids"] == want
    s = sched.stats
    assert s.spec_accepted_tokens >= 10, s.as_dict()
    assert s.decode_steps < len(want) - 10


def test_the_embedded_model_kept_quantized_gives_the_same_tokens_with_ngram_drafts():
    """The default model (its GGUF blocks kept, the LM head on the file's Q8_0 blocks for steps
    of up to 8 requests): a verify step of 4 requests holds more than 8 rows, and its head took
    the float path where decoding took the quantized one, so greedy under a schema, seeded
    samples and logprobs changed with speculation on."""
    from braid.runtime.models.source import resolve_model
    from braid.runtime.tokenizer.tokenizer import load_tokenizer

    path = resolve_model(None)
    tok = load_tokenizer(path)
    texts = [
        "Count: 1. 2. 3. 4. 5. 6. 7. 8. 9.",
        "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):",
        "the quick brown fox jumps over the lazy dog, the quick brown fox",
        "a, b, c, d, e, f, g, h, i, j, k,",
    ]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    kinds = [
        dict(temperature=0.0, json_schema=schema),
        dict(temperature=1.0, top_k=20, seed=7),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.8, seed=3, logprobs=1),
    ]
    reqs = [
        GenerateReq(f"r{i}", tok.encode(t), SamplingParams(max_tokens=24, ignore_eos=True, **kw), i)
        for i, (t, kw) in enumerate(zip(texts, kinds))
    ]
    cfg = dict(kv_tokens=2048)
    want = _run(local_scheduler(path, **cfg), reqs)
    sched = local_scheduler(path, speculative_algorithm="NGRAM", **cfg)
    got = _run(sched, reqs)
    s = sched.stats  # steps of 4 requests and their drafts: up to 4 x 5 rows
    assert s.spec_draft_tokens >= 40 and s.spec_accepted_tokens >= 1, s.as_dict()
    for r in reqs:
        assert got[r.rid]["ids"] == want[r.rid]["ids"], r.rid
        assert got[r.rid]["lp"] == want[r.rid]["lp"], r.rid


# ---- grammars: drafts pass through the mask ------------------------------------------------
KEYED = r'\{"name": "[a-z]{3,8}", "n": [0-9]{1,3}, "ok": (true|false)\}'


@pytest.fixture(scope="module")
def tiny_constrained(tmp_path_factory):
    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-spec-grammar"))


@pytest.mark.parametrize("jump", [True, False])
def test_drafts_of_constrained_requests_go_through_the_grammar(tiny_constrained, jump):
    """Right drafts, and drafts the grammar refuses: the same tokens as without speculation,
    with jump-forward on and off; right drafts are kept."""
    path, eos = tiny_constrained
    reqs = [
        GenerateReq(
            f"g{i}",
            [3, 4, 5 + i],
            SamplingParams(max_tokens=40, temperature=[0.0, 0.9][i % 2], seed=i, regex=KEYED),
            i,
        )
        for i in range(6)
    ]
    cfg = dict(CFG, disable_jump_forward=not jump)

    def run(proposer):
        sched = _spec_scheduler(path, proposer, eos_token_ids=frozenset({eos}), **cfg)
        return _run(sched, reqs), sched.stats

    want, _ = run(None)
    futures = {rid: g["ids"] for rid, g in want.items()}
    good, good_stats = run(Oracle(futures))
    bad, bad_stats = run(Oracle(futures, lambda pos, tok: 300 if pos % 2 else tok))
    # Trees: the right branch beside wrong siblings (tokens the grammar mostly refuses).
    tree, tree_stats = run(TreeOracle(futures))
    for rid, w in want.items():
        assert good[rid]["ids"] == w["ids"] == bad[rid]["ids"] == tree[rid]["ids"], rid
        assert good[rid]["finish"] == w["finish"] == bad[rid]["finish"], rid
    assert good_stats.spec_accepted_tokens > 20
    assert bad_stats.spec_accepted_tokens < good_stats.spec_accepted_tokens
    assert tree_stats.spec_accepted_tokens == good_stats.spec_accepted_tokens


# ---- the distribution --------------------------------------------------------------------------
def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of Pearson's chi-square test of `counts` against `probs`."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("drafts", ["good", "bad"])
def test_sampled_tokens_follow_the_target_distribution(tiny, drafts):
    """Many seeded requests sample tokens (top-k 4, temperature 1) with a draft for the second
    one that is the target's favourite, or a token it never samples: among requests whose first
    token is the commonest, the second follows the target's probabilities (chi-square,
    p > 0.001)."""
    from transformers import AutoModelForCausalLM

    prompt = [11, 12, 13]
    n = 1500
    sp = dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    reqs = [GenerateReq(f"s{i}", prompt, SamplingParams(seed=i, **sp), i) for i in range(n)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.inference_mode():
        first = hf(torch.tensor([prompt])).logits[0, -1]
    t1 = int(first.argmax())
    with torch.inference_mode():
        second = hf(torch.tensor([[*prompt, t1]])).logits[0, -1]
    top = second.topk(4)
    probs = torch.softmax(top.values, -1).numpy()
    draft = int(top.indices[0]) if drafts == "good" else int(second.argmin())

    class Fixed(Oracle):
        def propose(self, reqs, limits):
            return [[draft][:k] for k in limits]

    sched = _spec_scheduler(tiny, Fixed({}), **dict(CFG, max_running_requests=256))
    got = _run(sched, reqs)
    assert sched.stats.spec_draft_tokens >= n
    seconds = [g["ids"][1] for g in got.values() if g["ids"][0] == t1]
    assert len(seconds) > 300
    counts = np.array([seconds.count(int(t)) for t in top.indices])
    assert counts.sum() == len(seconds), "a token outside the top 4 was sampled"
    assert _chi_square_p(counts, probs) > 1e-3, (counts, probs)


# ---- a draft model -----------------------------------------------------------------------------
def _draft_scheduler(target, draft, **config):
    return local_scheduler(
        target, speculative_algorithm="DRAFT", speculative_draft_model_path=str(draft), **config
    )


def _draft_kv_all_free(sched) -> None:
    proposer = sched.proposer
    a = proposer.runner.kv_pool.allocator
    assert not proposer.states
    assert a.free_pages == a.capacity_pages
    assert proposer.runner.req_to_token.free_slots == proposer.runner.req_to_token.size


def test_the_target_as_its_own_draft_keeps_every_draft(tiny, plain):
    """Full acceptance checks the bookkeeping: every draft kept (sampled ones too: the draft
    draws with the request's seed at the target's positions), the same tokens and logprobs,
    and the draft model's KV all given back."""
    reqs, want = plain
    # A step count too (vLLM's num_speculative_tokens): the draft model's own settings must
    # not carry it, or they are refused as speculation settings without an algorithm.
    sched = _draft_scheduler(tiny, tiny, speculative_num_steps=3, **CFG)
    got = _run(sched, reqs)
    for rid, w in want.items():
        assert (got[rid]["ids"], got[rid]["lp"], got[rid]["finish"]) == (
            w["ids"],
            w["lp"],
            w["finish"],
        ), rid
    s = sched.stats
    assert s.spec_draft_tokens > 100 and s.spec_accepted_tokens == s.spec_draft_tokens
    _draft_kv_all_free(sched)


def test_another_draft_model_changes_no_token_under_pressure_and_aborts(tiny, tiny_model_dirs):
    """A draft model that mostly disagrees, a pool too small for all requests, aborts: the
    tokens of decoding without speculation, and no KV left behind in either model."""
    reqs = _mixed(60, 512)
    small = dict(CFG, kv_tokens=120, page_size=4)
    want = _run(_spec_scheduler(tiny, None, **small), reqs)
    order = [f"r{i}" for i in range(0, 60, 7)]

    def abort(step: int) -> list[str]:
        return [order.pop()] if order and step % 4 == 2 else []

    sched = _draft_scheduler(tiny, tiny_model_dirs["llama"], **small)
    got = _run(sched, reqs, abort)
    assert sched.stats.retractions > 0
    assert 0 < sched.stats.spec_accepted_tokens < sched.stats.spec_draft_tokens
    for rid, w in want.items():
        if got[rid]["finish"] != "abort":
            assert got[rid]["ids"] == w["ids"], rid
    _draft_kv_all_free(sched)


def test_a_draft_model_with_a_larger_vocabulary_is_refused(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_config

    cfg = _tiny_config("llama")
    cfg.vocab_size = 600
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="speculative_draft_model_path: .*vocabulary"):
        _draft_scheduler(tiny, tmp_path, **CFG)


# ---- heads on the target's hidden states: Medusa, EAGLE, EAGLE-3 -----------------------------
TREE = dict(speculative_eagle_topk=3, speculative_num_draft_tokens=10)
HEADS_CASES = {
    "medusa": ("MEDUSA", lambda p: spec_heads.write_medusa(p), {}),
    "medusa-pt": ("MEDUSA", lambda p: spec_heads.write_medusa(p, layers=2, pt=True), {}),
    "medusa-tree": ("MEDUSA", lambda p: spec_heads.write_medusa(p), TREE),
    "eagle": ("EAGLE", lambda p: spec_heads.write_eagle(p), {}),
    "eagle-bin-embed": ("EAGLE", lambda p: spec_heads.write_eagle(p, pt=True, embed=True), {}),
    "eagle2-tree": ("EAGLE", lambda p: spec_heads.write_eagle(p), TREE),
    "eagle3": ("EAGLE3", lambda p: spec_heads.write_eagle3(p), {}),
    "eagle3-tree": ("EAGLE3", lambda p: spec_heads.write_eagle3(p), dict(TREE, page_size=4)),
}


@pytest.mark.parametrize("case", list(HEADS_CASES))
def test_random_draft_heads_propose_and_change_no_token(tiny, plain, tmp_path, case):
    """Random-weight heads in each published layout load strictly, propose drafts every step
    (rarely right) and leave every token, logprob and finish reason as without speculation,
    with the KV accounted for; a prefix-cache hit (the same prompts again) changes nothing."""
    algo, write, extra = HEADS_CASES[case]
    reqs, want = plain
    sched = local_scheduler(
        tiny,
        speculative_algorithm=algo,
        speculative_draft_model_path=str(write(tmp_path / case)),
        **(CFG | extra),
    )
    again = [GenerateReq(r.rid + "-again", r.input_ids, r.params, r.seed) for r in reqs]
    got = _run(sched, reqs)
    got |= _run(sched, again)  # after the first ones: their prompts come from the cache
    for rid, w in want.items():
        for r in (rid, rid + "-again"):
            assert (got[r]["ids"], got[r]["lp"], got[r]["finish"]) == (
                w["ids"],
                w["lp"],
                w["finish"],
            ), r
    s = sched.stats
    assert s.spec_draft_tokens > 200 and s.spec_accepted_tokens < s.spec_draft_tokens
    assert s.cached_prompt_tokens > 0
    if extra:  # trees: more nodes a step than a chain of 4 could hold
        assert s.spec_draft_tokens > 6 * s.spec_request_steps, s.as_dict()
    assert not getattr(sched.proposer, "hidden", {}) and not getattr(sched.proposer, "pending", {})


def test_heads_that_do_not_fit_the_target_are_refused(tiny, tmp_path):
    path = spec_heads.write_eagle3(tmp_path / "bad", layers=(0, 1, 5))
    with pytest.raises(ValueError, match="speculative_draft_model_path: EAGLE-3 reads 3 layers"):
        local_scheduler(
            tiny, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(path), **CFG
        )
    path = spec_heads.write_eagle3(tmp_path / "e3")
    with pytest.raises(ValueError, match="use speculative_algorithm EAGLE3"):
        local_scheduler(
            tiny, speculative_algorithm="EAGLE", speculative_draft_model_path=str(path), **CFG
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="speculative_draft_model_path: .*config.json"):
        local_scheduler(
            tiny,
            speculative_algorithm="MEDUSA",
            speculative_draft_model_path=str(tmp_path / "empty"),
            **CFG,
        )


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_eagle_feeds_each_position_its_target_feature_and_the_next_token(
    tiny_model_dirs, tmp_path, algo
):
    """The draft's catch-up gets, at position t, the target's feature at t (EAGLE: the final
    normed hidden state; EAGLE-3: layers 0, 1 and 1's outputs) with the token at t + 1, for
    every position the target computed, as transformers computes them."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["llama"]
    head = (spec_heads.write_eagle if algo == "EAGLE" else spec_heads.write_eagle3)(tmp_path / "h")
    sched = local_scheduler(
        path, speculative_algorithm=algo, speculative_draft_model_path=str(head), **CFG
    )
    proposer, draft = sched.proposer, sched.proposer.draft
    seen: list[tuple[list[int], list[int], torch.Tensor]] = []
    first = {"call": False}
    real_forward, real_propose = draft.forward, proposer.propose

    def recording(batch, attn, embeds, features):
        if first["call"]:  # the catch-up; the calls after it draft from the draft's features
            seen.append((batch.positions.tolist(), batch.input_ids.tolist(), features.clone()))
            first["call"] = False
        return real_forward(batch, attn, embeds, features)

    def proposing(reqs, limits):
        first["call"] = True
        return real_propose(reqs, limits)

    draft.forward, proposer.propose = recording, proposing
    prompt = [5, 17, 99, 4, 250, 31]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = _run(sched, [GenerateReq("r", prompt, sp, 0)])
    seq = prompt + got["r"]["ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    outs = []  # each layer's output (transformers' last hidden state is the normed one)
    for layer in hf.model.layers:
        layer.register_forward_hook(
            lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o)
        )
    with torch.inference_mode():
        states = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    if algo == "EAGLE":
        want = states[-1][0]
    else:
        want = torch.cat([outs[0][0], outs[1][0], outs[1][0]], -1)
    covered = set()
    for positions, ids, feats in seen:
        for pos, tok, f in zip(positions, ids, feats):
            assert tok == seq[pos + 1], pos
            torch.testing.assert_close(f, want[pos], rtol=1e-4, atol=1e-4)
            covered.add(pos)
    # Every position was fed, up to those of the last step (no drafting after it).
    assert covered == set(range(max(covered) + 1)) and max(covered) >= len(seq) - 8, covered


# ---- CUDA: verify steps replay the decode graphs --------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algo", ["ORACLE", "TREE_ORACLE", "EAGLE", "EAGLE_TREE"])
def test_verify_steps_replay_cuda_graphs_and_give_the_plain_tokens(tiny, tmp_path, algo):
    """On CUDA (triton attention, float32) verify steps run as decode batches through the
    captured graphs (EAGLE's with the hidden states captured too) and keep exactly the tokens
    of decoding without speculation."""
    cuda = dict(
        kv_tokens=4096,
        device="cuda",
        dtype="float32",
        max_running_requests=16,
        cuda_graph_max_bs=64,
    )
    reqs = _mixed(8, 512)
    want = _run(local_scheduler(tiny, **cuda), reqs)
    futures = {r: g["ids"] for r, g in want.items()}
    if algo == "ORACLE":
        sched = _spec_scheduler(tiny, Oracle(futures), **cuda)
    elif algo == "TREE_ORACLE":  # Medusa trees: the graphs read tree tails
        sched = local_scheduler(
            tiny,
            speculative_algorithm="MEDUSA",
            speculative_draft_model_path=str(spec_heads.write_medusa(tmp_path / "m")),
            **cuda,
            **TREE,
        )
        oracle = TreeOracle(futures)
        sched.proposer = sched.decode.drafter.proposer = oracle
        sched.kv.on_release = oracle.release
    else:
        head = spec_heads.write_eagle(tmp_path / "eagle")
        tree = TREE if algo == "EAGLE_TREE" else {}
        sched = local_scheduler(
            tiny,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(head),
            **cuda,
            **tree,
        )
    got = _run(sched, reqs)
    for rid, w in want.items():
        assert (got[rid]["ids"], got[rid]["finish"]) == (w["ids"], w["finish"]), rid
    replays = sched.runner.graph_runner.replays
    assert sum(n for bs, n in replays.items() if bs > 8) > 0, "verify rows ran in graphs"
    assert sched.stats.spec_draft_tokens > 0


# ---- draft trees ---------------------------------------------------------------------------
class TreeOracle(Oracle):
    """Proposes a tree: the right continuation as one branch and, at every depth, a wrong
    sibling before the right node whose own child is the right next token (a branch that
    must not be followed)."""

    tree_nodes = 32

    def propose(self, reqs, limits):
        from braid.runtime.speculative.tree import DraftTree

        out = []
        for r, k in zip(reqs, limits):
            done = len(r.output_ids)
            right = list(self.futures.get(r.rid, [])[done : done + k])
            tokens, parents, parent = [], [], -1
            for j, t in enumerate(right):
                wrong = (t + 1 + j) % 512
                tokens += [wrong]
                parents += [parent]
                if j + 1 < len(right):
                    tokens += [right[j + 1]]  # under the wrong sibling
                    parents += [len(tokens) - 2]
                tokens += [t]
                parents += [parent]
                parent = len(tokens) - 1
            out.append(DraftTree(tuple(tokens), tuple(parents)))
        return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_draft_tree_keeps_the_right_branch_and_changes_nothing(tiny, plain, page_size):
    """Trees whose right branch is a sibling of wrong ones: the right branch is kept in full
    (its KV moved from the tree's pages to its positions), the wrong ones are not, and every
    token, logprob and finish reason is as without speculation, with the KV accounted for."""
    reqs, want = plain
    cfg = dict(CFG, page_size=page_size)
    oracle = TreeOracle({rid: g["ids"] for rid, g in want.items()})
    sched = _spec_scheduler(tiny, oracle, **cfg)
    sched.decode.drafter.steps = 4
    got = _run(sched, reqs)
    for rid, w in want.items():
        assert (got[rid]["ids"], got[rid]["lp"], got[rid]["finish"]) == (
            w["ids"],
            w["lp"],
            w["finish"],
        ), rid
    s = sched.stats
    # Each step verifies 4 right nodes and 7 wrong ones, and keeps the 4 right ones.
    assert s.spec_accept_length > 3.5
    assert 2 * s.spec_accepted_tokens < s.spec_draft_tokens < 3 * s.spec_accepted_tokens
    # Later requests with the same prompts hit the cache that holds the moved KV.
    again = [GenerateReq(r.rid + "-again", r.input_ids, r.params, r.seed) for r in reqs]
    sched.proposer.futures.update({r.rid + "-again": want[r.rid]["ids"] for r in reqs})
    got = _run(sched, again)
    for rid, w in want.items():
        assert got[rid + "-again"]["ids"] == w["ids"], rid
