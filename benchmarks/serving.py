"""Serving: a load generator against `braid serve`, and the same workload through the offline
`LLM.generate` in the same run, so the cost of the server path (HTTP, SSE, the tokenizer
manager, the detokenizer) shows as a ratio.

    python benchmarks/serving.py                          # SmolLM2 on CPU, 32 streams
    python benchmarks/serving.py --proxy --concurrency 256,1024 --modes offline,whole,stream
    python benchmarks/serving.py --url http://127.0.0.1:30000 --num-prompts 256 --request-rate 8

Requests are completions of --input-len random tokens and --output-len generated tokens
(`ignore_eos`, greedy), streamed (`stream`) or not (`whole`). Arrivals are all at once
(`--request-rate inf`) or Poisson at the given rate (a comma-separated list sweeps the rates,
as SGLang's `bench_serving` reports them: each rate runs every concurrency and served mode); at
most --concurrency requests are in flight, and unless --num-prompts is given each concurrency
sends that many requests. Each concurrency runs every mode in --modes; `offline` is
`LLM.generate` of the same prompts.
--clients N spreads the load over N client processes (their total is reported), to show the
load generator is not the bottleneck. Reports output tok/s, time to first token and
inter-token latency (p50/p90/p99), the CPU seconds each server-side process spent, and
served / offline throughput. Writes benchmarks/results/serving_<device>.json (--out).

--proxy is the CPU stand-in for a fast GPU: a tiny random-weight Llama (2 layers, hidden 64,
vocabulary 512; tests/conftest.py) with a byte-level BPE beside it, whose decode steps are cheap
enough that the front end (HTTP, SSE, the tokenizer manager, the detokenizer) decides the
throughput, as it does on an H200 at 1024 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import wait_for_graphs, write_result  # noqa: E402
from braid.runtime.server.launcher import start_server  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# ---- the load generator (runs in its own process or processes) ------------------------------
async def _one(session, url: str, prompt: list[int], out_len: int, stream: bool):
    import orjson

    body = {
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        if not stream:
            usage = orjson.loads(await r.read())["usage"]
            tokens = usage["completion_tokens"]
            stamps.append(time.perf_counter())
        else:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    chunk = orjson.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        stamps.append(now)
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    ttft = stamps[0] - t0 if stamps else float("nan")
    itl = [b - a for a, b in zip(stamps, stamps[1:])] if stream else []
    return ttft, itl, end - t0, tokens


async def _load(url, prompts, out_len, rate, concurrency, stream, seed):
    import aiohttp

    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def run(p):
            async with sem:
                return await _one(session, url, p, out_len, stream)

        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(run(p)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, t0, time.perf_counter()


def _client(url, prompts, out_len, rate, concurrency, stream, seed, start_at, results) -> None:
    # The load generator shares the 2 cores with the server under test; a real client runs
    # elsewhere, so it yields the CPU to braid's processes here.
    os.nice(10)
    time.sleep(max(0.0, start_at - time.time()))
    results.put(asyncio.run(_load(url, prompts, out_len, rate, concurrency, stream, seed)))


def run_clients(url, prompts, out_len, rate, concurrency, stream, clients, seed=1):
    """Send `prompts` from `clients` processes (each its share of the prompts and of
    `concurrency`), all starting together; returns (per-request results, wall seconds from the
    first start to the last end)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 2.0  # after every client process has started
    procs = []
    for k in range(clients):
        share = prompts[k::clients]
        conc = max(1, concurrency // clients)
        args = (url, share, out_len, rate / clients, conc, stream, seed + k, start_at, q)
        procs.append(ctx.Process(target=_client, args=args))
        procs[-1].start()
    outs = [q.get() for _ in procs]
    for p in procs:
        p.join()
    results = [r for res, _, _ in outs for r in res]
    return results, max(e for _, _, e in outs) - min(s for _, s, _ in outs)


# ---- the server's processes' CPU time -------------------------------------------------------
def _server_procs(pid: int) -> dict[str, object]:
    import psutil

    server = psutil.Process(pid)
    procs = {"server": server}
    for child in server.children(recursive=True):
        cmd = " ".join(child.cmdline())
        name = child.name()
        if "resource_tracker" in cmd or "multiprocessing.forkserver" in cmd:
            continue
        procs[name if name.startswith("braid-") else f"child-{child.pid}"] = child
    return procs


def _cpu_times(procs) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        t = p.cpu_times()
        out[name] = t.user + t.system
    return out


# ---- the proxy model ------------------------------------------------------------------------
def build_proxy(path: Path) -> Path:
    """The tiny random Llama with a byte-level BPE (what the tests build), once per path."""
    if not (path / "config.json").exists():
        from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

        build_tiny_constrained_model(path)
    return path


def served_run(url, prompts, out_len, args, rate, concurrency, stream, procs):
    httpx.post(f"{url}/flush_cache").raise_for_status()  # no run hits an earlier one
    before = _cpu_times(procs)
    results, wall = run_clients(url, prompts, out_len, rate, concurrency, stream, args.clients)
    cpu = {k: v - before[k] for k, v in _cpu_times(procs).items()}
    tokens = sum(r[3] for r in results)
    assert tokens == len(prompts) * out_len, (tokens, len(prompts) * out_len)
    ttfts = [r[0] for r in results]
    itls = [x for r in results for x in r[1]]
    return {
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "ttft_s": {f"p{p}": pct(ttfts, p) for p in (50, 90, 99)},
        "itl_s": {f"p{p}": pct(itls, p) for p in (50, 90, 99)} if stream else None,
        "mean_e2e_s": statistics.mean(r[2] for r in results),
        "cpu_s": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--proxy", action="store_true", help="the tiny CPU proxy model (see above)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--request-rate", default="inf", help="requests/s, Poisson; comma-separated: a sweep"
    )
    ap.add_argument("--concurrency", default="32", help="comma-separated: one run set each")
    ap.add_argument("--modes", default="stream,offline", help="of stream, whole, offline")
    ap.add_argument("--clients", type=int, default=1, help="client processes")
    ap.add_argument("--kv-tokens", type=int, default=None, help="default: what the runs need")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each path (best kept)")
    ap.add_argument("--server-args", default="", help="extra `braid serve` flags")
    ap.add_argument(
        "--config",
        default=None,
        help="a config under benchmarks/configs (e.g. llama-3.1-8b) with --tokenizer's files",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: the embedded model's")
    ap.add_argument("--load-format", default=None, help="e.g. dummy: random weights")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rates = [float(r) for r in args.request_rate.split(",")]
    modes = args.modes.split(",")
    unknown = set(modes) - {"stream", "whole", "offline"}
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")

    model = args.model
    vocab = 49152
    if args.proxy:
        model = str(build_proxy(Path(tempfile.gettempdir()) / "braid-serving-proxy"))
        vocab = 500
    elif args.config:
        from benchmarks.structured_gpu import embedded_tokenizer_dir, model_dir

        tok = args.tokenizer or embedded_tokenizer_dir()
        out = Path(tempfile.mkdtemp()) / args.config
        model = str(model_dir(args.config, tok, out))
        vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    most = max(args.num_prompts or c for c in concurrencies)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(most)]
    kv = args.kv_tokens or max(16384, most * (args.input_len + args.output_len) + 1024)
    engine_args = {"kv_tokens": kv}
    if args.proxy:
        engine_args["max_running_requests"] = max(concurrencies)
    if args.load_format:
        engine_args["load_format"] = args.load_format

    runs: list[dict] = []
    # Offline first, then the server (its ready line, with its start-up phases, is printed).
    if "offline" in modes:
        with braid.LLM(model, **engine_args, show_progress=False) as llm:
            wait_for_graphs(llm)
            sp = braid.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts[:4], braid.SamplingParams(max_tokens=4), use_tqdm=False)
            for c in concurrencies:
                batch = prompts[: args.num_prompts or c]
                walls = []
                for _ in range(args.repeats):
                    llm.flush_cache()  # as for the served runs: no run hits an earlier one
                    t0 = time.perf_counter()
                    llm.generate(batch, sp, use_tqdm=False)
                    walls.append(time.perf_counter() - t0)
                wall = min(walls)
                runs.append(
                    {
                        "concurrency": c,
                        "mode": "offline",
                        "num_prompts": len(batch),
                        "wall_s": wall,
                        "output_tok_s": len(batch) * args.output_len / wall,
                    }
                )
                print_run(runs[-1])
    served_modes = [m for m in modes if m != "offline"]
    server = None
    url = args.url
    if served_modes:
        if url is None:
            extra = ["--model", model] if model else []
            if "max_running_requests" in engine_args:
                extra += ["--max-running-requests", str(engine_args["max_running_requests"])]
            if args.load_format:
                extra += ["--load-format", args.load_format]
            extra += args.server_args.split()
            server = start_server(tempfile.mkdtemp(), *extra, kv_tokens=kv, timeout=600)
            url = server.url
            ready = [x for x in server.log().splitlines() if "ready at http://" in x]
            print(ready[-1] if ready else "no ready line", flush=True)
        info = httpx.get(f"{url}/get_server_info").json()
        device = info["device"].split(":")[0]
        procs = _server_procs(server.proc.pid) if server is not None else {}
        try:
            # Warm up (first requests pay one-time costs), then the measured runs.
            run_clients(url, prompts[:4], 4, float("inf"), 4, True, 1)
            for rate, c in itertools.product(rates, concurrencies):
                batch = prompts[: args.num_prompts or c]
                for mode in served_modes:
                    best = None
                    for _ in range(args.repeats):
                        stream = mode == "stream"
                        r = served_run(url, batch, args.output_len, args, rate, c, stream, procs)
                        if best is None or r["wall_s"] < best["wall_s"]:
                            best = r
                    runs.append(
                        {
                            "concurrency": c,
                            "mode": mode,
                            "request_rate": str(rate),
                            "num_prompts": len(batch),
                            **best,
                        }
                    )
                    print_run(runs[-1])
        finally:
            if server is not None:
                server.stop()
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    offline = {r["concurrency"]: r["output_tok_s"] for r in runs if r["mode"] == "offline"}
    for r in runs:
        # Only all-at-once runs: at a finite rate the arrivals set the throughput.
        if r["mode"] == "offline" or r["request_rate"] != "inf":
            continue
        if r["concurrency"] in offline:
            r["over_offline"] = r["output_tok_s"] / offline[r["concurrency"]]
    print(
        f"\ninput {args.input_len}, output {args.output_len}, rates {args.request_rate}, "
        f"{args.clients} client process(es)"
    )
    print(
        f"{'rate':>6} {'conc':>5} {'mode':>8} {'tok/s':>9} {'/offline':>8} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)"
    )
    nan = float("nan")
    for r in runs:
        itl, ttft = r.get("itl_s") or {}, r.get("ttft_s") or {}
        print(
            f"{r.get('request_rate', '-'):>6} {r['concurrency']:>5} {r['mode']:>8} "
            f"{r['output_tok_s']:>9.1f} {r.get('over_offline', nan):>8.3f} "
            f"{ttft.get('p50', nan) * 1e3:>9.1f} {ttft.get('p99', nan) * 1e3:>9.1f} "
            f"{itl.get('p50', nan) * 1e3:>8.1f} {itl.get('p99', nan) * 1e3:>8.1f}"
        )
    write_result(
        "serving",
        device,
        args.out,
        {
            "model": "proxy: tiny random Llama"
            if args.proxy
            else (Path(model).name if model else "smollm2-135m"),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rates": [str(r) for r in rates],
            "clients": args.clients,
            "runs": runs,
        },
    )


def print_run(r: dict) -> None:
    rate = f"rate {r['request_rate']} " if "request_rate" in r else ""
    line = f"{rate}{r['concurrency']:>5} {r['mode']:>8}: {r['output_tok_s']:.1f} tok/s"
    line += f" in {r['wall_s']:.2f} s"
    if r.get("itl_s"):
        line += f", ITL p50 {r['itl_s']['p50'] * 1e3:.1f} ms p99 {r['itl_s']['p99'] * 1e3:.1f} ms"
    if r.get("cpu_s"):
        line += ", CPU s " + " ".join(f"{k} {v:.1f}" for k, v in r["cpu_s"].items())
    print(line, flush=True)


if __name__ == "__main__":
    main()
