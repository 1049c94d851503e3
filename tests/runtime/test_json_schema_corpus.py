"""A corpus of JSON schemas of the kinds users send, all decoded in one batch on SmolLM2:
every output that finishes is valid JSON that validates against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from braid import SamplingParams
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler
from tests.runtime.json_schemas import CORPUS


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
