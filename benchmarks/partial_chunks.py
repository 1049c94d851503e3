"""Offline generation with and without partial chunks (issue 21: "a prefill budget that avoids
partial chunks"), in one run, on the same prompts.

    python benchmarks/partial_chunks.py                  # CPU, the embedded model (Q4_1 kept)
    python benchmarks/partial_chunks.py --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --num-prompts 1024 --min-len 256 --max-len 768 --output-len 256

Prompts of random lengths in [--min-len, --max-len] go through `braid.LLM.generate` (greedy,
`ignore_eos`, --output-len tokens each) under `avoid_partial_chunks` off (every prefill step
filled to its budget: a later prompt that does not fit is cut, as SGLang and vLLM do) and on
(it waits for the next step). Each setting is its own engine; the timed runs alternate between
them (A B, then B A, ...), each round on new prompts (the cache would hold the last round's),
the same for both. Reports each run's wall time and the scheduler's steps and chunked
prompts, each round's ratio and their median, and the fraction of sequences whose tokens
are the same under both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import wait_for_graphs, write_result  # noqa: E402
from braid.runtime.models.source import resolve_model  # noqa: E402

SETTINGS = {"budget-filled": False, "whole-prompts": True}
COUNTERS = ("prefill_steps", "decode_steps", "chunked_prompts", "prefill_tokens_computed")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def timed(llm, prompts, sp) -> tuple[float, dict, list[list[int]]]:
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    dt = time.perf_counter() - t0
    after = llm.stats()
    return dt, {k: after[k] - before[k] for k in COUNTERS}, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=700)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default: braid's")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds: one timed run of each setting on new prompts",
    )
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="each engine's KV pool (both are up at once); default: braid's on CPU, 65536 "
        "on CUDA (a share of the GPU would count the first engine's memory against the second)",
    )
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = resolve_model(args.model)
    engines = {}
    for name, avoid in SETTINGS.items():
        cps = args.chunked_prefill_size
        kw = {"chunked_prefill_size": cps} if cps else {}
        kv = args.kv_tokens or (65536 if device == "cuda" else None)
        engines[name] = braid.LLM(
            model_dir,
            dtype=args.dtype,
            load_format=args.load_format,
            avoid_partial_chunks=avoid,
            kv_tokens=kv,
            show_progress=False,
            **kw,
        )
    vocab = engines["whole-prompts"].model_config.vocab_size
    sp = braid.SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = make_prompts(4, 8, 16, vocab, seed=2)
    for llm in engines.values():
        llm.generate(warm, braid.SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        wait_for_graphs(llm)  # no timed step waits behind a CUDA graph's capture
    runs = {name: [] for name in SETTINGS}
    tokens = {}
    order = list(SETTINGS)
    for r in range(args.repeats):
        # New prompts each round (the cache would hold the last round's), the same for both.
        prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, seed=r)
        for name in order if r % 2 == 0 else order[::-1]:
            dt, counts, ids = timed(engines[name], prompts, sp)
            runs[name].append({"seconds": dt, **counts})
            tokens.setdefault(name, []).append(ids)
            print(json.dumps({"setting": name, "seconds": round(dt, 3), **counts}), flush=True)
    for llm in engines.values():
        llm.shutdown()
    # Fraction of sequences with identical greedy tokens: a prompt cut into chunks sums its
    # attention in another order, so a near-tie may flip (float32 too, on random prompts).
    pairs = [
        (a, b)
        for ra, rb in zip(tokens["budget-filled"], tokens["whole-prompts"])
        for a, b in zip(ra, rb)
    ]
    same = sum(a == b for a, b in pairs) / len(pairs)
    ratios = [
        a["seconds"] / b["seconds"] for a, b in zip(runs["budget-filled"], runs["whole-prompts"])
    ]
    lens = f"{args.min_len}-{args.max_len}"
    print(f"\n{model_dir.name} on {device}: {args.num_prompts} prompts of {lens} tokens,")
    print(f"{args.output_len} out each; sequences with the same tokens under both: {same:.3f}")
    print(f"{'round':>5} | {'setting':>13} | {'seconds':>7} | prefill steps | chunked prompts")
    for r in range(args.repeats):
        for name in SETTINGS:
            x = runs[name][r]
            print(
                f"{r:>5} | {name:>13} | {x['seconds']:7.2f} | {x['prefill_steps']:>13.0f} | "
                f"{x['chunked_prompts']:>15.0f}"
            )
    median = statistics.median(ratios)
    print(f"whole prompts vs budget filled, each round: {', '.join(f'{x:.3f}x' for x in ratios)}")
    print(f"median {median:.3f}x")
    write_result(
        "partial_chunks",
        device,
        args.out,
        {
            "model": model_dir.name,
            "num_prompts": args.num_prompts,
            "prompt_lens": [args.min_len, args.max_len],
            "output_len": args.output_len,
            "chunked_prefill_size": args.chunked_prefill_size,
            "same_tokens": same,
            "runs": runs,
            "ratios": ratios,
            "median_speedup_whole_prompts": median,
        },
    )


if __name__ == "__main__":
    main()
