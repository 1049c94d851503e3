"""A corpus of JSON schemas of the kinds users send, with regex and choice constraints, all
decoded in one batch on SmolLM2 by each grammar backend: every output that finishes is valid
JSON that validates against its schema (or matches its regex, or is one of its choices), and a
schema the backend cannot enforce (outlines-core and integer bounds) was compiled by one that
can."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from braid import SamplingParams
from braid.runtime.constrained import grammar_backend_names
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler
from tests.runtime.json_schemas import CORPUS

REGEXES = {"regex-year": r" [12][0-9]{3}", "regex-yes-no": r" (yes|no)"}
CHOICES = {"choice-fruit": ["apple", "banana", "cherry pie"]}


@pytest.fixture(scope="module", params=grammar_backend_names())
def sched(request, smollm2_dir, smollm2):
    return local_scheduler(
        smollm2_dir, smollm2.eos_token_ids, kv_tokens=8192, grammar_backend=request.param
    )


def test_every_finished_output_validates(sched, smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode("Answer with JSON only.\n")
    reqs = {name: dict(json_schema=schema) for name, schema in CORPUS.items()}
    reqs |= {name: dict(regex=r) for name, r in REGEXES.items()}
    reqs |= {name: dict(choice=c) for name, c in CHOICES.items()}
    for name, constraint in reqs.items():
        sp = SamplingParams(temperature=0.7, seed=3, max_tokens=40, **constraint)
        sched.handle(GenerateReq(name, prompt, sp, 3))
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
            assert out.error is None, (out.rid, out.error)
        sched.check_invariants()
    assert len(CORPUS) >= 15 and set(finish) == set(reqs)
    finished = [n for n, f in finish.items() if f == "stop"]
    assert len(finished) >= 13, finish
    for name in finished:
        text = tok.decode(ids[name], skip_special_tokens=True)
        if name in CORPUS:
            jsonschema.validate(json.loads(text), CORPUS[name])
        elif name in REGEXES:
            assert re.fullmatch(REGEXES[name], text), (name, text)
        else:
            assert text in CHOICES[name], (name, text)
    # The bounded integer is enforced whichever backend is configured.
    compiler = sched.grammar_compiler
    bounded = compiler.compile("json_schema", CORPUS["int_bounds"])
    assert bounded.backend == ("llguidance" if compiler.backend == "outlines" else compiler.backend)
    if finish["int_bounds"] == "stop":
        assert 1 <= json.loads(tok.decode(ids["int_bounds"], skip_special_tokens=True)) <= 9
