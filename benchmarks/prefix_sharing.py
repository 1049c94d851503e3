"""Prefix sharing: the radix cache vs `disable_radix_cache=True` on workloads shaped like the
SGLang paper's, in one run.

    python benchmarks/prefix_sharing.py                 # CPU, embedded SmolLM2, float32
    python benchmarks/prefix_sharing.py --model DIR --load-format dummy --scale 8   # GPU

Workloads (synthetic text, greedy, fixed output lengths):
- mmlu_5shot: one shared 5-shot prefix, many questions, a 2-token answer each, all submitted
  together;
- hellaswag_20shot: one shared 20-shot prefix, each question with 4 candidate endings (one
  request per ending, 1 token each: the scoring pass), all submitted together;
- multi_turn_chat: conversations whose every turn extends the last (prompt = the whole
  conversation so far, answer appended), conversations in parallel, turns in sequence.

For each: wall time and prefill tokens computed with the cache and without, the cache hit rate,
and the best achievable hit rate (every token of a prompt that an earlier request already
computed, with an unbounded cache, is a hit; the last prompt token is always computed).
Writes benchmarks/results/prefix_sharing_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from braid.runtime.models.source import resolve_model  # noqa: E402

WORDS = (
    "river mountain energy theory market history cell language number planet music law "
    "protein engine climate village algebra poem bridge signal forest contract metal ocean "
    "neuron empire harvest circuit grammar orbit"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def mmlu_item(rng: random.Random, answer: bool) -> str:
    q = f"Question: {sentence(rng, 14)} Which statement is correct?\n"
    opts = "".join(f"{c}. {sentence(rng, 8)}\n" for c in "ABCD")
    return q + opts + "Answer:" + (f" {rng.choice('ABCD')}\n\n" if answer else "")


def hellaswag_context(rng: random.Random) -> str:
    return f"Context: {sentence(rng, 16)} Then,"


def ending(rng: random.Random) -> str:
    return " " + sentence(rng, 6)


class Trie:
    """Sequences seen so far; `common(seq)` is the longest prefix of `seq` already seen."""

    def __init__(self) -> None:
        self.root: dict = {}

    def common(self, seq: list[int]) -> int:
        node, n = self.root, 0
        for t in seq:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def add(self, seq: list[int]) -> None:
        node = self.root
        for t in seq:
            node = node.setdefault(t, {})


def best_hits(requests: list[tuple[list[int], list[int]]]) -> int:
    """Best achievable cached prompt tokens for (prompt, output) pairs in arrival order."""
    trie, hits = Trie(), 0
    for prompt, output in requests:
        hits += min(trie.common(prompt), len(prompt) - 1)
        trie.add(prompt + output[:-1])
    return hits


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> list:
    sp = braid.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def workload_mmlu(llm, tok, rng_seed: int, n_questions: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(rng_seed)
    prefix = "The following are multiple choice questions.\n\n" + "".join(
        mmlu_item(rng, True) for _ in range(5)
    )
    prompts = [tok.encode(prefix + mmlu_item(rng, False)) for _ in range(n_questions)]
    outs = run_batch(llm, prompts, 2)
    return [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def workload_hellaswag(llm, tok, rng_seed: int, n_questions: int):
    rng = random.Random(rng_seed)
    shots = "".join(hellaswag_context(rng) + ending(rng) + "\n\n" for _ in range(20))
    prompts = []
    for _ in range(n_questions):
        ctx = shots + hellaswag_context(rng)
        prompts += [tok.encode(ctx + ending(rng)) for _ in range(4)]
    outs = run_batch(llm, prompts, 1)
    return [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def workload_chat(llm, tok, rng_seed: int, n_convs: int, turns: int = 4):
    rng = random.Random(rng_seed)
    convs: list[list[dict]] = [
        [{"role": "system", "content": "You are a helpful assistant. " + sentence(rng, 20)}]
        for _ in range(n_convs)
    ]
    pairs = []
    for _ in range(turns):
        for c in convs:
            c.append({"role": "user", "content": sentence(rng, 18)})
        prompts = [
            tok.encode(
                tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for c in convs
        ]
        outs = run_batch(llm, prompts, 16)
        for c, p, o in zip(convs, prompts, outs):
            c.append({"role": "assistant", "content": o.outputs[0].text})
            pairs.append((p, o.outputs[0].token_ids))
    return pairs


def measure(llm, fn) -> dict:
    llm.flush_cache()
    before = llm.stats()
    t0 = time.perf_counter()
    pairs = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = llm.stats()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    return {
        "wall_s": wall,
        "requests": len(pairs),
        "prompt_tokens": int(prompt),
        "prefill_tokens_computed": int(
            after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        ),
        "hit_rate": cached / prompt if prompt else 0.0,
        "best_hit_rate": best_hits(pairs) / prompt if prompt else 0.0,
        "outputs": [o for _, o in pairs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--scale", type=int, default=1, help="multiply the number of requests")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = resolve_model(args.model)
    tok_llm = braid.LLM(
        model_dir, dtype=args.dtype, load_format=args.load_format, show_progress=False
    )
    engines = {"cache": tok_llm}
    engines["no_cache"] = braid.LLM(
        model_dir,
        dtype=args.dtype,
        load_format=args.load_format,
        disable_radix_cache=True,
        show_progress=False,
    )
    tok = tok_llm.tokenizer
    s = args.scale
    workloads = {
        "mmlu_5shot": lambda llm: workload_mmlu(llm, tok, 1, 32 * s),
        "hellaswag_20shot": lambda llm: workload_hellaswag(llm, tok, 2, 6 * s),
        "multi_turn_chat": lambda llm: workload_chat(llm, tok, 3, 8 * s),
    }
    for llm in engines.values():  # warm-up
        run_batch(llm, [tok.encode("warm up")], 2)

    rows = []
    for name, fn in workloads.items():
        res = {k: measure(llm, lambda llm=llm, fn=fn: fn(llm)) for k, llm in engines.items()}
        same = res["cache"].pop("outputs") == res["no_cache"].pop("outputs")
        row = {
            "workload": name,
            "cache": res["cache"],
            "no_cache": res["no_cache"],
            "speedup": res["no_cache"]["wall_s"] / res["cache"]["wall_s"],
            "prefill_reduction": res["no_cache"]["prefill_tokens_computed"]
            / max(1, res["cache"]["prefill_tokens_computed"]),
            "same_outputs": same,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\nmodel {model_dir.name} ({tok_llm.ready.dtype}, {device})")
    print(
        f"{'workload':>17} | {'reqs':>4} | {'no cache s':>10} | {'cache s':>7} | {'speedup':>7} | "
        f"{'prefill tok (no cache -> cache)':>31} | {'hit rate':>8} | {'best':>6} | same"
    )
    for r in rows:
        c, n = r["cache"], r["no_cache"]
        print(
            f"{r['workload']:>17} | {c['requests']:>4} | {n['wall_s']:10.2f} | "
            f"{c['wall_s']:7.2f} | {r['speedup']:7.2f} | {n['prefill_tokens_computed']:>14} -> "
            f"{c['prefill_tokens_computed']:<14} | {c['hit_rate']:8.3f} | "
            f"{c['best_hit_rate']:6.3f} | {r['same_outputs']}"
        )
    for llm in engines.values():
        llm.shutdown()
    write_result(
        "prefix_sharing",
        device,
        args.out,
        {"model": model_dir.name, "dtype": tok_llm.ready.dtype, "rows": rows},
    )


if __name__ == "__main__":
    main()
