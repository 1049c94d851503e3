"""Jump-forward: text a grammar forces (JSON keys and punctuation, the rest of the only choice
left) is appended without sampling it token by token. Greedy outputs keep the same text in
fewer model steps; sampled outputs stay accepted by the grammar; jumps respect max_tokens, stop
tokens and memory pressure, and skip requests that want logprobs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from braid import SamplingParams
from braid.runtime.constrained import grammar_backend_names
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.constrained.jump_forward import jump_tokens
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.json_schemas import CORPUS
from tests.runtime.tiny_tokenizers import build_tiny_constrained_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-jump"))


@pytest.fixture(scope="module", params=grammar_backend_names())
def tiny_compiler(request, tiny):
    return GrammarCompiler(load_tokenizer(tiny[0]), request.param)


def _forced(compiler: GrammarCompiler, kind: str, spec, after: str = "") -> tuple[bytes, str]:
    """(the forced bytes, as outlines-core's automaton finds them, or None for the other
    backends; the text of the forced tokens)."""
    m = compiler.compile(kind, spec).matcher()
    for t in compiler.vocab.encode(after):
        m.advance(t)
    forced = m.grammar.forced
    tokens = m.forced_tokens()
    text = b"".join(compiler.vocab.token_bytes[t] for t in tokens).decode()
    return (forced.forced_bytes(m.state) if forced is not None else None), text


def _is(compiler: GrammarCompiler, got: tuple, raw: bytes, text: str) -> bool:
    return got == ((raw if compiler.backend == "outlines" else None), text)


def test_forced_text_runs_to_the_next_choice(tiny_compiler):
    c, regex = tiny_compiler, r'\{"name": "[a-z]+", "ok": (true|false)\}'
    assert _is(c, _forced(c, "regex", regex), b'{"name": "', '{"name": "')
    assert _is(c, _forced(c, "regex", regex, '{"name": "a'), b"", "")
    assert _is(c, _forced(c, "regex", regex, '{"name": "ab"'), b', "ok": ', ', "ok": ')
    assert _is(c, _forced(c, "choice", ["apple pie", "apricot"]), b"ap", "ap")
    assert _is(c, _forced(c, "choice", ["apple pie", "apricot"], "apr"), b"icot", "icot")


def test_nothing_is_forced_where_the_output_may_end(tiny_compiler):
    assert _is(tiny_compiler, _forced(tiny_compiler, "regex", "ab(cd)?", "ab"), b"", "")


def test_forced_text_stops_at_a_whole_character(tiny_compiler):
    # Both choices start with the byte 0xC3: forced, but half a character, so no jump.
    c = tiny_compiler
    assert _is(c, _forced(c, "choice", ["é", "è"]), b"\xc3", "")
    assert _is(c, _forced(c, "regex", "héllo|hé!"), b"h\xc3\xa9", "hé")


def test_jump_leaves_the_last_token_to_the_model_and_respects_limits():
    assert jump_tokens((5, 6, 7), room=10) == (5, 6)
    assert jump_tokens((5,), room=10) == ()
    assert jump_tokens((5, 6, 7, 8), room=2) == (5, 6)
    assert jump_tokens((5, 6, 7, 8), room=0) == ()
    assert jump_tokens((5, 6, 7, 8), room=10, stop_token_ids=[6]) == (5,)


# ---- SmolLM2: the same text in fewer steps ---------------------------------------------------
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 20},
        "account_identifier": {"type": "integer"},
        "is_premium_member": {"type": "boolean"},
    },
    "required": ["customer_full_name", "account_identifier", "is_premium_member"],
}
# (schema, an example of the format for the prompt): with the format in front of it the model
# writes the keys as the tokenizer splits them, which jump-forward feeds it.
CASES = {
    "long_keys": (
        LONG_KEYS,
        '{"customer_full_name": "Ann Lee", "account_identifier": 4411, "is_premium_member": false}',
    ),
    "person": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        '{"name": "Ann", "age": 41}',
    ),
    "city": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "population": {"type": "integer"},
            },
            "required": ["city", "country_code", "population"],
        },
        '{"city": "Lyon", "country_code": "FR", "population": 513000}',
    ),
    "tags": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}},
            },
            "required": ["title", "tags"],
        },
        '{"title": "Soup", "tags": ["food", "hot"]}',
    ),
}


def example_prompt(example: str) -> str:
    return f"Example of the JSON format: {example}\nAnother one, different values:\n"


@pytest.fixture(scope="module")
def sched(smollm2_dir, smollm2):
    # outlines-core's masks allow any spelling of forced text (llguidance's allow only the
    # tokenizer's own), so the model can disagree with a jump: what verification is for.
    return local_scheduler(
        smollm2_dir, smollm2.eos_token_ids, kv_tokens=4096, grammar_backend="outlines"
    )


def _greedy(
    sched, tok, prompt: str, schema, jump_forward: bool, max_tokens: int = 80
) -> tuple[str, int, int]:
    """(text, model steps, jumped tokens) of one request alone, from a cold cache; it must
    finish by a stop unless `max_tokens` is not the default."""
    sched.grammars.jump_forward_enabled = jump_forward
    assert sched.flush_cache()
    before = (sched.stats.prefill_steps + sched.stats.decode_steps, sched.stats.jump_forward_tokens)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=schema)
    sched.handle(GenerateReq("r", tok.encode(prompt), sp, 0))
    ids: list[int] = []
    while sched.has_work:
        for out in sched.step():
            ids += out.new_token_ids
            assert out.finish_reason in (None, "stop") or max_tokens != 80
        sched.check_invariants()
    steps = sched.stats.prefill_steps + sched.stats.decode_steps - before[0]
    return (
        tok.decode(ids, skip_special_tokens=True),
        steps,
        sched.stats.jump_forward_tokens - before[1],
    )


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_text_is_the_same_in_fewer_steps(sched, smollm2, case):
    schema, example = CASES[case]
    tok = smollm2.tokenizer
    text, steps, jumped = _greedy(sched, tok, example_prompt(example), schema, False)
    jf_text, jf_steps, jf_jumped = _greedy(sched, tok, example_prompt(example), schema, True)
    jsonschema.validate(json.loads(text), schema)
    assert jf_text == text
    assert jumped == 0 and jf_jumped > 0
    assert jf_steps < steps
    if case == "long_keys":
        assert steps >= 1.5 * jf_steps, (steps, jf_steps)


BARE_CASES = {name: CASES[name][0] for name in ("long_keys", "person", "city")}
BARE_CASES["nested"] = CORPUS["nested"]


def test_greedy_text_is_the_same_with_a_bare_prompt(sched, smollm2):
    """Without an example of the format the model spells some keys in other tokens than the
    forced ones (`c`, `ust` for `cust`): the jumped tokens are rejected there, and the text is
    still the text without jump-forward (it was not before jumps were verified)."""
    tok = smollm2.tokenizer
    before = sched.stats.jump_forward_rejected
    for name, schema in BARE_CASES.items():
        prompt = f"Write one JSON object for a {name.replace('_', ' ')} record.\n"
        text, steps, _ = _greedy(sched, tok, prompt, schema, False, max_tokens=60)
        jf_text, jf_steps, jumped = _greedy(sched, tok, prompt, schema, True, max_tokens=60)
        assert jf_text == text, name
        assert jumped > 0, name
        if name == "long_keys":
            assert jf_steps < steps, (steps, jf_steps)
    assert sched.stats.jump_forward_rejected > before


def test_text_through_the_processes_is_the_scheduler_text(sched, smollm2):
    schema, example = CASES["long_keys"]
    tok = smollm2.tokenizer
    want, _, _ = _greedy(sched, tok, example_prompt(example), schema, False)
    before = smollm2.stats()["jump_forward_tokens"]
    sp = SamplingParams(temperature=0.0, max_tokens=80, json_schema=schema)
    out = smollm2.generate([example_prompt(example)], sp, use_tqdm=False)[0].outputs[0]
    assert smollm2.stats()["jump_forward_tokens"] > before
    assert out.text == want == tok.decode(out.token_ids, skip_special_tokens=True)


# ---- tiny random model: limits --------------------------------------------------------------
KEYED = r'\{"country_code": "[A-Z]{2}", "population": [0-9]{1,6}\}'


@pytest.fixture(scope="module")
def tiny_sched(tiny):
    path, eos = tiny
    return local_scheduler(path, frozenset({eos}), kv_tokens=2048)


def _run(sched, reqs: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict, dict]:
    for rid, sp in reqs.items():
        sched.handle(GenerateReq(rid, [3, 4, 5], sp, sp.seed or 0))
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    outs_by_rid: dict[str, list] = {}
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            outs_by_rid.setdefault(out.rid, []).append(out)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
        sched.check_invariants()
    return ids, finish, outs_by_rid


def _accepted(sched, spec: str, ids: list[int]) -> bool:
    m = sched.grammar_compiler.compile("regex", spec).matcher()
    try:
        for t in ids:
            m.advance(t)
    except ValueError:
        return False
    return True


def test_a_jump_never_passes_max_tokens(tiny_sched):
    reqs = {
        f"m{n}": SamplingParams(temperature=1.0, seed=n, max_tokens=n, regex=KEYED)
        for n in range(1, 9)
    }
    before = tiny_sched.stats.jump_forward_tokens
    ids, finish, _ = _run(tiny_sched, reqs)
    for n in range(1, 9):
        assert len(ids[f"m{n}"]) == n and finish[f"m{n}"] == "length"
        assert _accepted(tiny_sched, KEYED, ids[f"m{n}"])
    assert tiny_sched.stats.jump_forward_tokens > before


def test_requests_that_want_logprobs_get_no_jumps(tiny_sched):
    before = tiny_sched.stats.jump_forward_tokens
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=12, regex=KEYED, logprobs=2)
    ids, finish, outs = _run(tiny_sched, {"lp": sp})
    assert tiny_sched.stats.jump_forward_tokens == before
    assert all(len(o.logprobs) == len(o.new_token_ids) == 1 for o in outs["lp"][:-1])
    assert _accepted(tiny_sched, KEYED, ids["lp"])


LONG = r'\{"country_code": "[A-Z]{2}", "city": "[a-z ]{8,30}", "name": "[a-z]{3,20}"\}'


def test_jumps_under_memory_pressure_keep_kv_accounting(tiny):
    path, eos = tiny
    sched = local_scheduler(path, frozenset({eos}), kv_tokens=64)
    reqs = {
        f"p{n}": SamplingParams(temperature=1.0, seed=n, max_tokens=48, regex=LONG)
        for n in range(8)
    }
    ids, finish, _ = _run(sched, reqs)
    assert set(finish) == set(reqs) and sched.stats.retractions > 0
    assert sched.stats.jump_forward_tokens > 0
    for rid in reqs:
        assert _accepted(sched, LONG, ids[rid][:-1] if finish[rid] == "stop" else ids[rid])
    usage = sched.usage()
    assert usage["kv_free_tokens"] + usage["kv_cached_tokens"] == usage["kv_capacity_tokens"]


def test_greedy_jumps_are_verified_under_memory_pressure(tiny):
    """A random model rarely agrees with the forced tokens: greedy outputs with jumps
    (rejected, retracted, resumed) are the outputs without them, and KV accounting holds.
    (On outlines-core, whose masks allow every spelling of forced text: llguidance's allow
    only the tokenizer's own, so its jumps are never rejected.)"""
    path, eos = tiny
    sp = SamplingParams(temperature=0.0, max_tokens=48, regex=LONG)
    runs = []
    for jump in (False, True):
        sched = local_scheduler(path, frozenset({eos}), kv_tokens=64, grammar_backend="outlines")
        sched.grammars.jump_forward_enabled = jump
        for n in range(8):
            sched.handle(GenerateReq(f"g{n}", [3, 4, 5 + n], sp, 0))
        runs.append((run_to_end(sched), sched.stats))
    (want, _), (got, stats) = runs
    assert got == want and len(got) == 8
    assert stats.jump_forward_rejected > 0 and stats.retractions > 0
