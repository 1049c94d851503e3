"""Serving: a load generator against `braid serve`, and the same workload through the offline
`LLM.generate` in the same run, so the cost of the server path (HTTP, SSE, the tokenizer
manager) shows as a ratio.

    python benchmarks/serving.py                          # starts braid serve itself (CPU)
    python benchmarks/serving.py --url http://127.0.0.1:30000 --num-prompts 256 --request-rate 8

Requests are streamed completions of --input-len random tokens and --output-len generated
tokens (`ignore_eos`, greedy). Arrivals are all at once (`--request-rate inf`) or Poisson at
the given rate; at most --concurrency requests are in flight. Reports throughput, time to first
token and inter-token latency (p50/p90/p99), and served / offline throughput. Writes
benchmarks/results/serving_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from braid.runtime.server.launcher import start_server  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], out_len: int):
    body = {
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - t0 if stamps else float("nan")
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, itl, time.perf_counter() - t0


async def load(url: str, prompts, out_len: int, rate: float, concurrency: int, seed: int):
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def run(p):
            async with sem:
                return await one_request(client, url, p, out_len)

        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(run(p)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return results, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each path (best kept)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rng = random.Random(0)
    vocab = 49152
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    tokens = args.num_prompts * args.output_len
    server = None
    url = args.url
    if url is None:
        import tempfile

        extra = ["--model", args.model] if args.model else []
        server = start_server(tempfile.mkdtemp(), *extra, kv_tokens=args.kv_tokens)
        url = server.url
    device = httpx.get(f"{url}/get_server_info").json()["device"].split(":")[0]
    # The load generator shares the 2 cores with the server under test; a real client runs
    # elsewhere, so it yields the CPU to braid's processes here.
    os.nice(10)
    try:
        # Warm up (first requests pay one-time costs), then the measured runs.
        asyncio.run(load(url, prompts[:2], 4, float("inf"), 2, 0))
        runs = []
        for _ in range(args.repeats):
            httpx.post(f"{url}/flush_cache").raise_for_status()  # no run hits an earlier one
            runs.append(
                asyncio.run(
                    load(url, prompts, args.output_len, args.request_rate, args.concurrency, 1)
                )
            )
        results, wall = min(runs, key=lambda r: r[1])
    finally:
        if server is not None:
            server.stop()
    ttfts = [r[0] for r in results]
    itls = [x for r in results for x in r[1]]
    served = {
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "ttft_s": {f"p{p}": pct(ttfts, p) for p in (50, 90, 99)},
        "itl_s": {f"p{p}": pct(itls, p) for p in (50, 90, 99)},
        "mean_e2e_s": statistics.mean(r[2] for r in results),
    }
    offline = None
    if not args.skip_offline:
        with braid.LLM(args.model, kv_tokens=args.kv_tokens, show_progress=False) as llm:
            sp = braid.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts[:2], braid.SamplingParams(max_tokens=4), use_tqdm=False)
            walls = []
            for _ in range(args.repeats):
                llm.flush_cache()  # as for the served runs: no run hits an earlier one
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                walls.append(time.perf_counter() - t0)
            owall = min(walls)
        offline = {"wall_s": owall, "output_tok_s": tokens / owall}
    ratio = served["output_tok_s"] / offline["output_tok_s"] if offline else None

    print(
        f"\n{args.num_prompts} requests, input {args.input_len}, output {args.output_len}, "
        f"rate {args.request_rate}, concurrency {args.concurrency}"
    )
    print(f"served:  {served['output_tok_s']:.1f} tok/s in {wall:.2f} s")
    if offline:
        print(f"offline: {offline['output_tok_s']:.1f} tok/s in {offline['wall_s']:.2f} s")
        print(f"served / offline throughput: {ratio:.3f}")
    for name in ("ttft_s", "itl_s"):
        d = served[name]
        print(
            f"{name:>7}: p50 {d['p50'] * 1000:.1f} ms, p90 {d['p90'] * 1000:.1f} ms, "
            f"p99 {d['p99'] * 1000:.1f} ms"
        )
    write_result(
        "serving",
        device,
        args.out,
        {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": str(args.request_rate),
            "concurrency": args.concurrency,
            "served": served,
            "offline": offline,
            "served_over_offline": ratio,
        },
    )


if __name__ == "__main__":
    main()
