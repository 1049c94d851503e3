"""Data parallelism: two `braid serve` workers behind SGLang's router, its cache-aware policy
against round-robin on prefix-sharing workloads, in one run.

    python benchmarks/data_parallel.py            # CPU, embedded SmolLM2, 2 workers

Workloads (text prompts over /v1/completions, greedy, through the router):
- few_shot: 4 few-shot prefixes (5 examples each, as in `prefix_sharing.py`'s MMLU), 12
  questions under each, sent 8 at a time in shuffled order: a router that sends each prefix's
  questions to one worker computes each prefix once;
- multi_turn: 8 conversations of 4 turns, each turn's prompt the conversation so far.

For each policy: wall time, prompt tokens and prefill tokens computed over both workers, and
the cache hit rate (both workers' `/get_server_info` counters, before and after).
Writes benchmarks/results/data_parallel_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.prefix_sharing import mmlu_item, sentence  # noqa: E402
from braid.runtime.server.launcher import start_server  # noqa: E402


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=600,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def few_shot(url: str, seed: int, pool: ThreadPoolExecutor) -> int:
    rng = random.Random(seed)
    prefixes = ["".join(mmlu_item(rng, True) for _ in range(5)) for _ in range(4)]
    jobs = [p + mmlu_item(rng, False) for p in prefixes for _ in range(12)]
    rng.shuffle(jobs)
    list(pool.map(lambda prompt: _complete(url, prompt, 2), jobs))
    return len(jobs)


def multi_turn(url: str, seed: int, pool: ThreadPoolExecutor) -> int:
    rng = random.Random(seed)
    convs = [f"System: You are helpful. {sentence(rng, 20)}\n" for _ in range(8)]
    for _ in range(4):
        convs = [c + f"User: {sentence(rng, 18)}\nAssistant:" for c in convs]
        answers = list(pool.map(lambda c: _complete(url, c, 12), convs))
        convs = [c + a + "\n" for c, a in zip(convs, answers)]
    return 32


def _counters(workers: list[str]) -> dict[str, float]:
    total = {"prompt_tokens": 0.0, "cached_prompt_tokens": 0.0, "prefill_tokens_computed": 0.0}
    for w in workers:
        stats = httpx.get(w + "/get_server_info", timeout=30).json()["stats"]
        for k in total:
            total[k] += stats[k]
    return total


def run_policy(policy: str, kv_tokens: int) -> dict:
    import re

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(
            tmp, "--dp-size", "2", "--router-policy", policy, kv_tokens=kv_tokens, timeout=300
        )
        try:
            workers = list(re.search(r"2 workers: (\S+) (\S+);", server.log()).groups())
            rows = {}
            with ThreadPoolExecutor(8) as pool:
                for name, fn in (("few_shot", few_shot), ("multi_turn", multi_turn)):
                    before = _counters(workers)
                    t0 = time.perf_counter()
                    n = fn(server.url, 0, pool)
                    wall = time.perf_counter() - t0
                    after = _counters(workers)
                    d = {k: after[k] - before[k] for k in after}
                    rows[name] = {
                        "requests": n,
                        "wall_s": wall,
                        "prompt_tokens": int(d["prompt_tokens"]),
                        "prefill_tokens_computed": int(d["prefill_tokens_computed"]),
                        "hit_rate": d["cached_prompt_tokens"] / max(d["prompt_tokens"], 1),
                    }
                    print(json.dumps({"policy": policy, "workload": name, **rows[name]}))
            return rows
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {p: run_policy(p, args.kv_tokens) for p in args.policies.split(",")}
    policies = list(res)
    if len(policies) == 2:
        a, b = policies
        for w in res[a]:
            res[a][w]["speedup_vs_" + b] = res[b][w]["wall_s"] / res[a][w]["wall_s"]
    write_result("data_parallel", "cpu", args.out, {"policies": res})
    for p, rows in res.items():
        for w, r in rows.items():
            print(f"{p:>12} {w:>10}: {r['wall_s']:.1f} s, hit rate {r['hit_rate']:.2f}")


if __name__ == "__main__":
    main()
