"""Sampling behaviour on the real SmolLM2 model: greedy equivalences, seeds, stops, n, logprobs,
penalties and biases."""

from __future__ import annotations

import math

import pytest
import torch

import braid
from braid import SamplingParams

PROMPT = "Once upon a time, in a small village,"


def _one(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_top_k_1_equals_greedy(smollm2):
    greedy = _one(smollm2, PROMPT, temperature=0.0, max_tokens=16)
    top1 = _one(smollm2, PROMPT, temperature=0.9, top_k=1, max_tokens=16)
    assert top1.token_ids == greedy.token_ids


def test_seeded_request_is_the_same_alone_and_batched(smollm2):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16)
    alone = smollm2.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=24)
    batch = smollm2.generate(
        ["Hi", PROMPT, "The weather today is", "1, 2, 3,"],
        [others, sp, others, SamplingParams(temperature=0.0, max_tokens=5)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = _one(smollm2, PROMPT, temperature=1.0, top_p=0.9, seed=43, max_tokens=16)
    assert other_seed.token_ids != alone


def test_stop_string_cuts_the_text(smollm2):
    full = _one(smollm2, PROMPT, temperature=0.0, max_tokens=30)
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    out = _one(smollm2, PROMPT, temperature=0.0, max_tokens=30, stop=[stop])
    assert out.text == full.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(full.token_ids)
    kept = _one(
        smollm2, PROMPT, temperature=0.0, max_tokens=30, stop=stop, include_stop_str_in_output=True
    )
    assert kept.text == full.text[: cut + len(stop)]


def test_stop_token_ids_end_generation_on_the_token(smollm2):
    full = _one(smollm2, PROMPT, temperature=0.0, max_tokens=20, ignore_eos=True)
    target = full.token_ids[6]
    first = full.token_ids.index(target)
    out = _one(smollm2, PROMPT, temperature=0.0, max_tokens=20, stop_token_ids=[target])
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)
    # The stop token's text is left out, as a stop string's (vLLM's and SGLang's outputs),
    # unless include_stop_str_in_output.
    tok = smollm2.get_tokenizer()
    assert out.text == tok.decode(full.token_ids[:first])
    kept = _one(
        smollm2,
        PROMPT,
        temperature=0.0,
        max_tokens=20,
        stop_token_ids=[target],
        include_stop_str_in_output=True,
    )
    assert kept.text == tok.decode(full.token_ids[: first + 1]) != out.text


def test_eos_and_length_finish_reasons(smollm2):
    chat = smollm2.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=64),
        use_tqdm=False,
    )[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.stop_reason is None
    assert chat.token_ids[-1] in smollm2.eos_token_ids
    assert "<|im_end|>" not in chat.text
    raw = smollm2.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=64, skip_special_tokens=False),
        use_tqdm=False,
    )[0].outputs[0]
    assert raw.token_ids == chat.token_ids and raw.text == chat.text  # the EOS's text left out
    # An EOS also among stop_token_ids is still an EOS (vLLM checks it first): no stop token.
    eos = chat.token_ids[-1]
    listed = smollm2.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[eos]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (listed.token_ids, listed.stop_reason) == (chat.token_ids, None)
    short = _one(smollm2, PROMPT, temperature=0.0, max_tokens=3)
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_min_tokens_suppresses_eos(smollm2):
    msgs = [{"role": "user", "content": "Say hi."}]
    natural = smollm2.chat(msgs, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    k = len(natural[0].outputs[0].token_ids)
    longer = smollm2.chat(
        msgs, SamplingParams(temperature=0.0, max_tokens=k + 10, min_tokens=k + 5), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= k + 5
    eos = smollm2.eos_token_ids
    assert not eos & set(longer.token_ids[: k + 4])


def test_n_returns_n_distinct_samples(smollm2):
    out = smollm2.generate(
        [PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    again = smollm2.generate(
        [PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False
    )[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_logit_bias_forces_a_token(smollm2):
    tid = smollm2.tokenizer.encode(" banana")[0]
    out = _one(smollm2, PROMPT, temperature=0.0, max_tokens=5, logit_bias={tid: 100.0})
    assert out.token_ids == [tid] * 5


def test_logprobs_are_consistent(smollm2):
    out = _one(smollm2, PROMPT, temperature=0.0, max_tokens=8, logprobs=3)
    assert len(out.logprobs) == 8
    total = 0.0
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert pos[tok].rank == 1  # greedy picks the most likely token
        assert len(pos) == 3
        ranks = sorted(lp.rank for lp in pos.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in pos.values())
        total += pos[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)
    assert out.logprobs[0][out.token_ids[0]].decoded_token == smollm2.tokenizer.decode(
        [out.token_ids[0]]
    )


def test_prompt_logprobs_match_transformers(smollm2, hf_smollm2):
    ids = smollm2.tokenizer.encode(PROMPT)
    out = smollm2.generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(ids)):
        got = out.prompt_logprobs[j][ids[j]].logprob
        assert got == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)


def test_repetition_penalty_matches_transformers(smollm2, hf_smollm2):
    ids = smollm2.tokenizer.encode(PROMPT)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = hf_smollm2.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    out = smollm2.generate(
        [ids],
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ref


def test_default_sampling_params_follow_generation_config(tiny_model_dirs, tmp_path):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["llama"], path)
    (path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.25, "top_p": 0.5, "top_k": 7})
    )
    with braid.LLM(path, kv_tokens=256, show_progress=False) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.top_k) == (0.25, 0.5, 7)
    with braid.LLM(path, kv_tokens=256, generation_config="braid", show_progress=False) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.top_k) == (1.0, 1.0, 0)


def test_text_of_a_request_ending_inside_a_character_is_the_decode_of_its_tokens(smollm2):
    """The last token carries the first bytes of an emoji whose rest never comes (max_tokens
    ends the request): the text keeps them as U+FFFD, as `tokenizer.decode` and SGLang do,
    instead of dropping them, so re-tokenizing the text counts every token."""
    tok = smollm2.tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")
    out = _one(smollm2, PROMPT, temperature=0.0, max_tokens=1, logit_bias={ids[0]: 100.0})
    assert out.token_ids == ids[:1]
    assert out.text == tok.decode(ids[:1]) and out.text.endswith("\ufffd")


def test_allowed_token_ids_pick_the_likeliest_allowed_token(smollm2):
    """Greedy within `allowed_token_ids` is the allowed token the model scores highest: the
    2nd and 5th of its unconstrained top 5 give the 2nd, and every token stays allowed."""
    first = _one(smollm2, PROMPT, temperature=0.0, max_tokens=1, logprobs=5).logprobs[0]
    ranked = sorted(first, key=lambda t: first[t].rank)
    allowed = [ranked[4], ranked[1]]
    out = _one(smollm2, PROMPT, temperature=0.0, max_tokens=6, allowed_token_ids=allowed)
    assert out.token_ids[0] == ranked[1]
    assert set(out.token_ids) <= set(allowed)
    drawn = _one(smollm2, PROMPT, temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed)
    assert set(drawn.token_ids) <= set(allowed)


def test_bad_words_are_never_generated(smollm2):
    """A one-word ban moves greedy to the next likeliest token; a two-token word is cut after
    its first token; with and without a leading space alike."""
    tok = smollm2.get_tokenizer()
    free = _one(smollm2, PROMPT, temperature=0.0, max_tokens=12)
    first = _one(smollm2, PROMPT, temperature=0.0, max_tokens=1, logprobs=2).logprobs[0]
    second = next(t for t in first if first[t].rank == 2)
    word = tok.decode(free.token_ids[:1]).strip()
    banned = _one(smollm2, PROMPT, temperature=0.0, max_tokens=12, bad_words=[word])
    assert banned.token_ids[0] == second and word not in banned.text.split()
    # Two tokens said in a row: the second is banned right after the first.
    i = next(i for i in range(1, 10) if tok.decode(free.token_ids[i : i + 1]).startswith(" "))
    pair = free.token_ids[i : i + 2]
    phrase = tok.decode(pair).strip()
    assert tok.encode(" " + phrase, add_special_tokens=False) == pair
    cut = _one(smollm2, PROMPT, temperature=0.0, max_tokens=12, bad_words=[phrase])
    assert cut.token_ids[: i + 1] == free.token_ids[: i + 1] and cut.token_ids[i + 1] != pair[1]


def test_truncate_prompt_tokens_keeps_the_prompts_end(smollm2):
    ids = smollm2.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    cut = smollm2.generate([PROMPT], params.replace(truncate_prompt_tokens=4), use_tqdm=False)[0]
    tail = smollm2.generate([{"prompt_token_ids": ids[-4:]}], params, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:] and len(ids) > 4
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids


def test_a_tiny_positive_temperature_samples_as_vllms_lowest(smollm2):
    """Temperatures below 0.01 sample at 0.01 (vLLM's floor): dividing by 1e-40 overflowed the
    logits, and every token came out as id 0."""
    greedy = _one(smollm2, PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True)
    for t in (1e-30, 1e-40, 1e-45):
        tiny = _one(smollm2, PROMPT, temperature=t, max_tokens=6, ignore_eos=True, seed=3)
        assert tiny.token_ids == greedy.token_ids, t


def test_sampling_params_are_set_as_vllms_are_and_take_its_spellings():
    """vLLM's params are mutable (its examples edit the defaults); setting a field validates
    it; vLLM's structured_outputs / guided_decoding, seed -1 and the fields that change nothing
    here are taken, and what braid cannot honour is a ValueError naming it."""
    sp = SamplingParams()
    sp.max_tokens = 5
    sp.stop = "x"
    assert (sp.max_tokens, sp.stop) == (5, ("x",))
    with pytest.raises(ValueError, match="temperature must be"):
        sp.temperature = -1
    assert sp.temperature == 1.0
    with pytest.raises(AttributeError, match="no field 'bogus'"):
        sp.bogus = 1
    sp.bad_words = ["a"]
    assert sp.bad_words == ("a",) and sp.bad_words_token_ids is None
    assert SamplingParams(seed=-1).seed is None
    schema = {"type": "object"}
    assert SamplingParams(structured_outputs={"json": schema}).json_schema == '{"type": "object"}'
    assert SamplingParams(guided_decoding={"regex": "a+"}).regex == "a+"
    assert SamplingParams(structured_outputs={"grammar": 'root ::= "a"'}).ebnf == 'root ::= "a"'
    assert SamplingParams(structured_outputs={"json_object": True}).json_schema is not None
    SamplingParams(detokenize=True, spaces_between_special_tokens=False, output_kind=2)
    later = SamplingParams()
    later.structured_outputs = {"regex": "a+"}  # set later too, as vLLM's names are
    assert later.regex == "a+"
    with pytest.raises(ValueError, match="detokenize"):
        sp.detokenize = False
    with pytest.raises(ValueError, match="give only one"):
        SamplingParams(regex="a", guided_decoding={"regex": "b"})
    with pytest.raises(TypeError, match="unhashable"):
        hash(sp)
    for kw, field in [
        ({"detokenize": False}, "detokenize"),
        ({"logits_processors": [print]}, "logits_processors"),
        ({"extra_args": {"a": 1}}, "extra_args"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"bogus": 1}, "bogus"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
