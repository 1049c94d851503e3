"""A corpus of JSON schemas of the kinds users send, all decoded in one batch on SmolLM2:
every output that finishes is valid JSON that validates against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from braid import SamplingParams
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler

CORPUS = {
    "flat": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    "array_bounds": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
    "enum": {"type": "string", "enum": ["low", "medium", "high"]},
    "int_bounds": {"type": "integer", "minimum": 1, "maximum": 9},
    "number": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    "boolean": {"type": "boolean"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "date": {"type": "string", "format": "date"},
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
    "ref_defs": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["start", "end"],
    },
    "optional": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["title"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 6}},
            "required": ["k"],
        },
        "maxItems": 2,
    },
    "const": {"type": "object", "properties": {"v": {"const": 1}}, "required": ["v"]},
    "string_length": {"type": "string", "minLength": 2, "maxLength": 5},
}


@pytest.fixture(scope="module")
def sched(smollm2_dir, smollm2):
    return local_scheduler(smollm2_dir, smollm2.eos_token_ids, kv_tokens=8192)


def test_every_finished_output_validates(sched, smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode("Answer with JSON only.\n")
    for name, schema in CORPUS.items():
        sp = SamplingParams(temperature=0.7, seed=3, max_tokens=120, json_schema=schema)
        sched.handle(GenerateReq(name, prompt, sp, 3))
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
        sched.check_invariants()
    assert len(CORPUS) >= 15 and set(finish) == set(CORPUS)
    finished = [n for n, f in finish.items() if f == "stop"]
    assert len(finished) >= 12, finish
    for name in finished:
        text = tok.decode(ids[name], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), CORPUS[name])
