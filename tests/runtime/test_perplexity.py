"""Quality, measured: SmolLM2-135M's perplexity (its real weights, the embedded Q4_1 file) on
a fixed public-domain text (tests/data/text), float32 against each method, by running
`benchmarks/perplexity.py` itself (the whole text, one engine per method) and bounding what it
reports. The GGUF blocks kept quantized are the float32 model's own weights, so its perplexity
must equal float32's up to the CPU kernel's bfloat16 rounding; int8 and int4 quantize those
weights once more (int4 onto a grid of 64 that does not match Q4_1's blocks of 32) and cost
more. The fp8 KV cache keeps float32 weights and rounds every key and value attended to through
e4m3 (scale 1.0). The figures are docs/benchmarks.md's Quantization table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import perplexity  # noqa: E402

# The largest perplexity change from float32 each method may show, in percent (measured:
# gguf +0.08, int8 +2.0, int4 +72, fp8_kv -0.32).
BOUNDS = {"gguf": 0.5, "int8": 3.0, "int4": 78.0, "fp8_kv": 1.0}


pytestmark = pytest.mark.slow  # five engines, each scoring 1140 tokens: about 50 s


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ppl") / "perplexity.json"
    perplexity.main(["--out", str(out)])
    return json.loads(out.read_text())


def test_the_whole_text_is_scored_by_a_fluent_model(result):
    assert result["tokens"] > 1000
    # Plain English prose: a broken load, rotary or attention would be far off.
    assert 5 < result["methods"]["float32"]["perplexity"] < 40


@pytest.mark.parametrize("method", list(BOUNDS))
def test_each_method_stays_within_its_perplexity_bound(result, method):
    delta = result["methods"][method]["delta_vs_float32_pct"]
    assert abs(delta) <= BOUNDS[method], (method, result["methods"])
