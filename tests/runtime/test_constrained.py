"""Constrained decoding with outlines-core on the real SmolLM2 vocabulary: every finished
output matches its regex, choice or JSON schema; unconstrained neighbours are unaffected."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from braid import SamplingParams
from braid.runtime.constrained.vocab import token_bytes
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler, run_to_end

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
    },
]


@pytest.fixture(scope="module")
def sched(smollm2_dir, smollm2):
    return local_scheduler(smollm2_dir, smollm2.eos_token_ids, kv_tokens=4096)


def _run(sched, tok, prompt: str, params: SamplingParams) -> str:
    sched.handle(GenerateReq("c", tok.encode(prompt), params, 1))
    ids = run_to_end(sched)["c"]
    return tok.decode(ids, skip_special_tokens=True)


def test_vocabulary_maps_byte_level_tokens_back_to_bytes(smollm2):
    tok = smollm2.tokenizer
    eos, mapping = token_bytes(tok)
    assert eos == tok.eos_token_id and all(eos not in ids for ids in mapping.values())
    space_paris = tok.encode(" Paris", add_special_tokens=False)
    assert len(space_paris) == 1 and space_paris[0] in mapping[b" Paris"]
    assert b"\n" in mapping


def test_regex_and_choice_outputs_match(sched, smollm2):
    tok = smollm2.tokenizer
    out = _run(
        sched,
        tok,
        "Is the sky blue? Answer:",
        SamplingParams(temperature=0.0, max_tokens=10, regex=r" (yes|no)"),
    )
    assert re.fullmatch(r" (yes|no)", out)
    out = _run(
        sched,
        tok,
        "Pick a fruit:",
        SamplingParams(
            temperature=1.0, seed=4, max_tokens=10, choice=["apple", "banana", "cherry"]
        ),
    )
    assert out in ("apple", "banana", "cherry")
    out = _run(
        sched,
        tok,
        "The year is",
        SamplingParams(temperature=1.0, seed=2, max_tokens=8, regex=r" [12][0-9]{3}"),
    )
    assert re.fullmatch(r" [12][0-9]{3}", out)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "array", "enum", "bool-number"])
def test_json_schema_outputs_validate(sched, smollm2, schema):
    tok = smollm2.tokenizer
    out = _run(
        sched,
        tok,
        "Reply with JSON only.\n",
        SamplingParams(temperature=0.7, seed=5, max_tokens=60, json_schema=schema),
    )
    jsonschema.validate(json.loads(out), schema)


def test_free_requests_are_unaffected_by_constrained_neighbours(sched, smollm2):
    tok = smollm2.tokenizer
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sched.handle(GenerateReq("alone", tok.encode("Once upon a time"), free, 0))
    alone = run_to_end(sched)["alone"]
    sched.handle(GenerateReq("free", tok.encode("Once upon a time"), free, 0))
    sched.handle(
        GenerateReq(
            "json",
            tok.encode("JSON:"),
            SamplingParams(temperature=0.0, max_tokens=30, json_schema=SCHEMAS[0]),
            0,
        )
    )
    got = run_to_end(sched)
    assert got["free"] == alone
    assert sched.grammar_compiler.misses >= 1


def test_bad_specs_are_value_errors_naming_the_field():
    for kw, field in [
        (dict(regex="(unclosed"), "regex"),
        (dict(json_schema="{not json"), "json_schema"),
        (dict(choice=[]), "choice"),
        (dict(regex="a", json_schema={"type": "string"}), "json_schema"),
        (dict(choice=["yes"], min_tokens=4), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_engine_generates_valid_json_through_the_processes(smollm2):
    schema = SCHEMAS[0]
    out = smollm2.generate(
        ["Give me a person as JSON:"],
        SamplingParams(temperature=0.0, max_tokens=60, json_schema=schema),
        use_tqdm=False,
    )[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)
    assert out.finish_reason == "stop"
