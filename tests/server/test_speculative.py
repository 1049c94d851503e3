"""`braid serve --speculative-algorithm NGRAM`: the output is the model's own (transformers'
greedy tokens), and what speculation did is reported where SGLang and OpenAI clients look:
`meta_info` on /generate (SGLang's `spec_*` fields), `usage.completion_tokens_details` on the
OpenAI APIs (accepted / rejected prediction tokens), and /metrics."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from tests.conftest import hf_greedy
from tests.server.conftest import start_server, wait_idle

POEM = (
    "Roses are red, violets are blue, sugar is sweet, and so are you. "
    "Roses are red, violets are blue, sugar is sweet, and so are you."
)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("spec"),
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "4",
        "--dequantize-gguf",  # transformers' float model is the reference
    )
    yield s
    s.stop()


def _chat_ids(smollm2, text: str) -> list[int]:
    tok = smollm2.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Repeat exactly: " + text}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return tok.encode(chat, add_special_tokens=False)


def test_generate_gives_the_models_tokens_and_reports_speculation(spec_server, smollm2, hf_smollm2):
    ids = _chat_ids(smollm2, POEM)
    want = hf_greedy(hf_smollm2, ids, 40)
    r = httpx.post(
        spec_server.url + "/generate",
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 40}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == want
    meta = body["meta_info"]
    assert meta["spec_num_correct_drafts"] > 5
    assert meta["spec_num_proposed_drafts"] >= meta["spec_num_correct_drafts"]
    assert meta["spec_verify_ct"] < len(want)
    assert meta["spec_accept_length"] == pytest.approx(
        (meta["spec_verify_ct"] + meta["spec_num_correct_drafts"]) / meta["spec_verify_ct"]
    )


def test_openai_usage_and_metrics_count_the_drafts(spec_server):
    client = OpenAI(base_url=spec_server.url + "/v1", api_key="x")
    resp = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Repeat exactly: " + POEM}],
        temperature=0.7,
        seed=3,
        n=2,
        max_tokens=40,
    )
    assert len(resp.choices) == 2
    details = resp.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    wait_idle(spec_server.url)
    # /metrics reads the scheduler's latest heartbeat, which may predate the last step's count.
    deadline = time.monotonic() + 10.0
    while True:
        metrics = httpx.get(spec_server.url + "/metrics").text
        lines = metrics.splitlines()
        accepted = [line for line in lines if line.startswith("braid_spec_accepted")]
        counted = float(accepted[0].split()[-1]) if accepted else 0.0
        if counted >= details.accepted_prediction_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert accepted and counted >= details.accepted_prediction_tokens
    assert "braid_spec_accept_length" in metrics
