"""`gen(..., ebnf=...)` on every backend that can carry it: the Engine in-process, a
RuntimeEndpoint and the OpenAI backend on a real `braid serve` give the same grammar-bound text;
the OpenAI backend refuses, clearly and before sending anything, a server that would drop the
field; a malformed grammar fails where the program builds it."""

from __future__ import annotations

import re

import httpx
import pytest

import braid as sgl
from tests.runtime.grammars import ARITHMETIC, ARITHMETIC_RE, MATH_PROMPT


@sgl.function
def arithmetic(s):
    s += MATH_PROMPT
    s += sgl.gen("line", max_tokens=20, temperature=0, ebnf=ARITHMETIC)


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def test_ebnf_gen_on_engine_endpoint_and_openai_backends(backend, served):
    endpoint = sgl.RuntimeEndpoint(served.url)
    openai_backend = sgl.OpenAI(_model(served.url), base_url=served.url + "/v1")
    lines = [arithmetic.run(backend=b)["line"] for b in (backend, endpoint, openai_backend)]
    assert all(re.fullmatch(ARITHMETIC_RE, line) for line in lines), lines
    assert len(set(lines)) == 1, lines  # greedy: the same text everywhere


def test_openai_backend_refuses_ebnf_for_a_server_that_would_drop_it(served):
    # A server that does not answer SGLang's /get_model_info (here: a path with none) would
    # ignore `ebnf` and answer with free text.
    elsewhere = sgl.OpenAI(_model(served.url), base_url=served.url + "/elsewhere/v1")
    with pytest.raises(sgl.ProgramError, match="needs a server that takes SGLang's `ebnf`"):
        arithmetic.run(backend=elsewhere)


def test_malformed_grammars_fail_where_the_program_builds_them():
    with pytest.raises(ValueError, match="ebnf: must be a non-empty grammar string"):
        sgl.gen("x", ebnf=" ")
    with pytest.raises(ValueError, match=r"give only one of \['regex', 'ebnf'\]"):
        sgl.gen("x", regex="a", ebnf=ARITHMETIC)
