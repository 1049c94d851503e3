"""Perplexity of the embedded SmolLM2-135M (real weights) on a fixed public-domain text
(tests/data/text/declaration_of_independence.txt), float32 against each quantization method
that applies to it, through braid.LLM's prompt log-probabilities:

    python benchmarks/perplexity.py            # the whole text, every method
    python benchmarks/perplexity.py --tiny-cpu # the first 64 tokens, float32 and gguf
    python benchmarks/perplexity.py --device cuda  # every method in bfloat16 on the GPU

(tests/runtime/test_perplexity.py runs the first form and bounds each method's change.)

Methods: `float32` (the GGUF file dequantized: the model's float weights), `gguf` (the Q4_1
blocks kept quantized: on this CPU, torch's int4 kernel with bfloat16 activations), `int8`
(`w8a16` from the float32 weights), `int4` (`awq`'s round-to-nearest, group 64, from the
float32 weights), `fp8_kv` (the float32 model with `kv_cache_dtype="fp8_e4m3"`: every key and
value attended to is rounded through e4m3, scales 1.0). The float32 weights are themselves the
Q4_1 file's, so `gguf` is the same model as `float32` (its delta is the kernels' rounding),
while `int8` and `int4` quantize it once more. Perplexity = exp(mean negative log-likelihood
of tokens 2..n given those before), the text as one sequence. Writes
benchmarks/results/perplexity_<device>.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from braid.runtime.models.source import resolve_model  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "tests/data/text/declaration_of_independence.txt"
# method -> (float directory?, engine settings)
METHODS = {
    "float32": (True, {}),
    "gguf": (False, {}),
    "int8": (True, {"quantization": "w8a16"}),
    "int4": (True, {"quantization": "awq"}),
    "fp8_kv": (True, {"kv_cache_dtype": "fp8_e4m3"}),
}


def text_ids(tokenizer, max_tokens: int | None = None) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    return ids[:max_tokens] if max_tokens else ids


def perplexity(llm: braid.LLM, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each given the ids before it."""
    sp = braid.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    nll = [-out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
    return math.exp(sum(nll) / len(nll))


def method_engine(method: str, **overrides) -> braid.LLM:
    floats, settings = METHODS[method]
    path = resolve_model(None, dequantize_gguf=floats)
    return braid.LLM(path, kv_tokens=4096, show_progress=False, **settings, **overrides)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-cpu", action="store_true", help="64 tokens, float32 and gguf")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-tokens", type=int, default=None, help="first N tokens of the text")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: every method in bfloat16 (`float32` names the float weights there)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    overrides = {"device": "cuda", "dtype": "bfloat16"} if args.device == "cuda" else {}
    methods = [m for m in args.methods.split(",") if m]
    if args.tiny_cpu:
        methods, args.max_tokens = ["float32", "gguf"], 64
    rows = {}
    ids: list[int] = []
    for method in methods:
        with method_engine(method, **overrides) as llm:
            ids = text_ids(llm.tokenizer, args.max_tokens)
            rows[method] = {"perplexity": perplexity(llm, ids)}
    base = rows.get("float32", {}).get("perplexity")
    print(f"{'method':<10}{'perplexity':>12}{'vs float32':>12}")
    for method, row in rows.items():
        if base is not None:
            row["delta_vs_float32_pct"] = 100 * (row["perplexity"] / base - 1)
        delta = row.get("delta_vs_float32_pct")
        shown = f"{delta:+.2f}%" if delta is not None else "-"
        print(f"{method:<10}{row['perplexity']:>12.4f}{shown:>12}")
    write_result(
        "perplexity",
        args.device,
        args.out,
        {"text": TEXT.name, "tokens": len(ids), "methods": rows},
        script="benchmarks/perplexity.py",
    )


if __name__ == "__main__":
    main()
