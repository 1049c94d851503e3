"""Structured generation: what a grammar costs per decoded token, what jump-forward saves, and
how long grammars take to compile, in one run.

    python benchmarks/structured.py                  # CPU, embedded SmolLM2, fp32
    python benchmarks/structured.py --model DIR      # any model directory with a tokenizer

1. Decode cost: constrained (a JSON object with a free-text string: the bitmask of almost every
   token, every step) vs free requests, same prompts and output length (`ignore_eos`), at each
   batch size; jump-forward off so both run the same steps. Per-token decode time counts decode
   steps only (the prefill is the same for both). Also the bitmask's own cost per step (filling
   and applying it, measured alone) as a share of a free decode step: the same overhead without
   the noise a shared machine adds to the A/B.
2. Jump-forward: a schema with long fixed keys, greedy, with the format shown in the prompt,
   with and without jump-forward: model steps (prefill + decode forwards), wall time, and
   whether the text is the same.
3. Compile time of the 15-schema corpus (tests/runtime/json_schemas.py) on the scheduler's
   backend: each schema cold, the corpus again from the cache, and the corpus cold on the
   two-thread compile pool.
4. Each grammar backend on the corpus, with SGLang's character regex, regexes, choices and an
   EBNF grammar (`structured_corpus.backend_costs`): cold compile time per constraint, host
   time per token of the bitmask fill and of the forced-token search (jump-forward).

    python benchmarks/structured.py --corpus jsonschemabench    # JSON Schema coverage

runs instead, per backend alone, on the 300 JSONSchemaBench schemas under
tests/data/jsonschemabench: the share that compiles within the time limit, of the benchmark's
valid instances accepted and invalid ones refused, and for a sample the share of SmolLM2's
outputs that validate (`structured_corpus.coverage`, `generation`).

The scheduler runs in this process (the runtime's own class, without the IPC around it), so
steps can be counted and jump-forward switched per run. Prints a summary and writes JSON under
benchmarks/results/.
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

from benchmarks import structured_corpus  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from braid import SamplingParams  # noqa: E402
from braid.runtime.assets import ModelAssets  # noqa: E402
from braid.runtime.config import EngineConfig  # noqa: E402
from braid.runtime.constrained import grammar_backend_names  # noqa: E402
from braid.runtime.constrained.bitmask import BitmaskBuffer, apply_token_bitmask  # noqa: E402
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler  # noqa: E402
from braid.runtime.constrained.grammar import GrammarCompiler  # noqa: E402
from braid.runtime.executor.model_runner import ModelRunner  # noqa: E402
from braid.runtime.ipc.to_scheduler import GenerateReq  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402
from braid.runtime.models.source import resolve_model  # noqa: E402
from braid.runtime.scheduler.process import build_scheduler  # noqa: E402
from braid.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from tests.runtime.grammars import (  # noqa: E402
    ARITHMETIC,
    CHARACTER,
    CHARACTER_REGEX,
    INSTANCES,
    SQL,
)
from tests.runtime.json_schemas import CORPUS  # noqa: E402

FREE_TEXT = {
    "type": "object",
    "properties": {"summary": {"type": "string"}},
    "required": ["summary"],
}
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer"},
        "subscription_renewal_enabled": {"type": "boolean"},
        "preferred_contact_channel": {"enum": ["email", "phone", "sms"]},
        "outstanding_balance_in_cents": {"type": "integer"},
        "marketing_consent_given": {"type": "boolean"},
    },
    "required": [
        "customer_account_identifier",
        "subscription_renewal_enabled",
        "preferred_contact_channel",
        "outstanding_balance_in_cents",
        "marketing_consent_given",
    ],
}
LONG_KEYS_EXAMPLES = [
    {
        "customer_account_identifier": 1000 + 37 * i,
        "subscription_renewal_enabled": i % 2 == 0,
        "preferred_contact_channel": ["email", "phone", "sms"][i % 3],
        "outstanding_balance_in_cents": 250 * i,
        "marketing_consent_given": i % 3 == 0,
    }
    for i in range(16)
]


def long_keys_prompt(i: int) -> str:
    return (
        f"Customer record, JSON format: {json.dumps(LONG_KEYS_EXAMPLES[i])}\n"
        "The next customer's record:\n"
    )


def run(sched, reqs: list[tuple[list[int], SamplingParams]]) -> dict:
    """Run `reqs` to the end; step counts, decode-step time, wall time and each output."""
    s = sched.stats
    steps0, decode0 = s.prefill_steps + s.decode_steps, s.decode_steps
    for i, (ids, sp) in enumerate(reqs):
        sched.handle(GenerateReq(f"r{i}", ids, sp, i))
    out: dict[str, list[int]] = {}
    decode_s = 0.0
    t0 = time.perf_counter()
    while sched.has_work:
        before = s.decode_steps
        t = time.perf_counter()
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        if s.decode_steps > before:
            decode_s += time.perf_counter() - t
    return {
        "wall_s": time.perf_counter() - t0,
        "steps": s.prefill_steps + s.decode_steps - steps0,
        "decode_steps": s.decode_steps - decode0,
        "decode_s": decode_s,
        "outputs": [out[f"r{i}"] for i in range(len(reqs))],
    }


def decode_cost(sched, vocab: int, batch: int, output_len: int, input_len: int, repeats: int):
    rng = random.Random(batch)
    prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch)]
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    constrained = free.replace(json_schema=FREE_TEXT)
    sched.grammars.jump_forward_enabled = False
    best: dict[str, float] = {}
    for _ in range(repeats):  # interleaved, best of: the machine's load drifts
        for name, sp in (("free", free), ("constrained", constrained)):
            sched.flush_cache()
            r = run(sched, [(p, sp) for p in prompts])
            assert all(len(o) == output_len for o in r["outputs"])
            per_step = r["decode_s"] / r["decode_steps"]
            best[name] = min(best.get(name, float("inf")), per_step)
    sched.grammars.jump_forward_enabled = True
    return {
        "batch_size": batch,
        "free_decode_ms_per_token": 1e3 * best["free"] / batch,
        "constrained_decode_ms_per_token": 1e3 * best["constrained"] / batch,
        "overhead": best["constrained"] / best["free"] - 1,
    }


def jump_forward_ab(sched, tokenizer, batch: int, max_tokens: int, repeats: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=LONG_KEYS)
    reqs = [(tokenizer.encode(long_keys_prompt(i)), sp) for i in range(batch)]
    res = {}
    for jf in (False, True):
        sched.grammars.jump_forward_enabled = jf
        runs = []
        for _ in range(repeats):
            sched.flush_cache()
            runs.append(run(sched, reqs))
        best = min(runs, key=lambda r: r["wall_s"])
        res[jf] = best
    sched.grammars.jump_forward_enabled = True
    texts = {
        jf: [tokenizer.decode(o, skip_special_tokens=True) for o in res[jf]["outputs"]]
        for jf in res
    }
    return {
        "batch_size": batch,
        "steps_off": res[False]["steps"],
        "steps_on": res[True]["steps"],
        "steps_ratio": res[False]["steps"] / res[True]["steps"],
        "wall_s_off": res[False]["wall_s"],
        "wall_s_on": res[True]["wall_s"],
        "speedup": res[False]["wall_s"] / res[True]["wall_s"],
        "output_tokens_off": sum(len(o) for o in res[False]["outputs"]),
        "output_tokens_on": sum(len(o) for o in res[True]["outputs"]),
        "same_text": sum(a == b for a, b in zip(texts[False], texts[True])) / batch,
        "example_text": texts[True][0],
    }


def compile_times(tokenizer, backend: str, repeats: int) -> dict:
    """Best of `repeats`, each with fresh compilers (empty caches)."""
    vocab_s, cached_s, pool_s = [], [], []
    cold: dict[str, float] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiler = GrammarCompiler(tokenizer, backend)
        compiler.get_backend(backend)
        vocab_s.append(time.perf_counter() - t0)
        for name, schema in CORPUS.items():
            t = time.perf_counter()
            compiler.compile("json_schema", schema)
            cold[name] = min(cold.get(name, float("inf")), time.perf_counter() - t)
        t = time.perf_counter()
        for schema in CORPUS.values():
            compiler.compile("json_schema", schema)
        cached_s.append(time.perf_counter() - t)
        fresh = GrammarCompiler(tokenizer, backend)
        pool = AsyncGrammarCompiler(lambda c=fresh: c, workers=2)
        pool.submit("regex", "warm").result()  # the vocabulary view and the workers
        t = time.perf_counter()
        for f in [pool.submit("json_schema", s) for s in CORPUS.values()]:
            f.result()
        pool_s.append(time.perf_counter() - t)
        pool.shutdown()
    return {
        "backend": backend,
        "schemas": len(CORPUS),
        "vocabulary_build_s": min(vocab_s),
        "cold_total_s": sum(cold.values()),
        "cold_max_s": max(cold.values()),
        "cold_per_schema_s": cold,
        "cached_total_s": min(cached_s),
        "pool_cold_total_s": min(pool_s),
    }


def mask_cost(
    tokenizer, backend: str, vocab: int, device: torch.device, batch_sizes: str
) -> list[dict]:
    """Filling and applying the bitmask alone, every row inside a JSON string (the state that
    allows almost every token)."""
    compiler = GrammarCompiler(tokenizer, backend)
    grammar = compiler.compile("json_schema", FREE_TEXT)
    rows = []
    for batch in (int(b) for b in batch_sizes.split(",")):
        matchers = [grammar.matcher() for _ in range(batch)]
        for m in matchers:
            for t in tokenizer.encode('{"summary": "', add_special_tokens=False):
                m.advance(t)
        buf = BitmaskBuffer(max(vocab, compiler.vocab.size), device)
        logits = torch.randn(batch, vocab, device=device)
        n = 50
        t = time.perf_counter()
        for _ in range(n):
            mask, idx = buf.fill(matchers, list(range(batch)))
        fill = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for _ in range(n):
            apply_token_bitmask(logits, mask, idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        apply = (time.perf_counter() - t) / n
        rows.append({"batch_size": batch, "fill_ms": 1e3 * fill, "apply_ms": 1e3 * apply})
    return rows


def corpus_items() -> list[tuple[str, str, object, str]]:
    """(name, kind, spec, a text it accepts) for `structured_corpus.backend_costs`."""
    items = [(n, "json_schema", schema, json.dumps(INSTANCES[n])) for n, schema in CORPUS.items()]
    return items + [
        ("sglang_character_regex", "regex", CHARACTER_REGEX, CHARACTER),
        ("regex_year", "regex", r" [12][0-9]{3}", " 1999"),
        ("choice", "choice", ["apple", "banana", "cherry pie"], "cherry pie"),
        ("ebnf_arithmetic", "ebnf", ARITHMETIC, "12 + 7 = 19"),
        ("ebnf_sql", "ebnf", SQL, "SELECT id, name FROM users WHERE age > 30;"),
    ]


def scheduler_alone(model_dir: Path, assets, backend: str, kv_tokens: int) -> Scheduler:
    """A scheduler whose grammars all go to `backend` (no fallback): what it alone covers."""
    config = EngineConfig(
        model=str(model_dir), kv_tokens=kv_tokens, show_progress=False, grammar_backend=backend
    )
    runner = ModelRunner(config, ModelConfig.from_dir(model_dir), model_dir)
    tokenizer = assets.tokenizer
    return Scheduler(
        runner,
        config,
        eos_token_ids=assets.eos_token_ids,
        grammar_compiler=lambda: GrammarCompiler(tokenizer, backend, fallback=False),
    )


def jsonschemabench(args, model_dir: Path, assets) -> None:
    bench = structured_corpus.load_bench()
    step = max(1, len(bench) // args.sample)
    sample = bench[::step][: args.sample]
    results = {}
    for backend in args.backends.split(","):
        # "braid": the default backend with its fallbacks, as served.
        served = backend == "braid"
        name = EngineConfig().effective_grammar_backend if served else backend
        summary, _, _ = structured_corpus.coverage(
            assets.tokenizer, name, bench, args.compile_timeout, fallback=served
        )
        print(json.dumps({"backend": backend, **summary}), flush=True)
        if served:
            config = EngineConfig(model=str(model_dir), kv_tokens=args.kv_tokens)
            sched = build_scheduler(config, model_dir, assets.eos_token_ids)
        else:
            sched = scheduler_alone(model_dir, assets, backend, args.kv_tokens)
        gen = structured_corpus.generation(sched, assets.tokenizer, sample, args.gen_max_tokens)
        sched.grammars.waiting.compiler.shutdown()
        del sched
        print(json.dumps({"backend": backend, **gen}), flush=True)
        results[backend] = {"coverage": summary, "generation": gen}
    print(f"\n{len(bench)} JSONSchemaBench schemas, each backend alone (braid: with fallbacks)")
    print(
        f"{'backend':>10} | {'compile':>7} | {'refused':>7} | {'failed':>6} | {'timeout':>7} | "
        f"{'p50 s':>6} | {'valid ok':>8} | {'invalid no':>10} | generated valid"
    )
    for b, r in results.items():
        c, g = r["coverage"], r["generation"]
        print(
            f"{b:>10} | {100 * c['compiled_fraction']:6.1f}% | {c['refused']:>7} | "
            f"{c['failed']:>6} | {c['timed_out']:>7} | {c['compile_s_p50']:6.3f} | "
            f"{100 * c['valid_instances_accepted']:7.1f}% | "
            f"{100 * c['invalid_instances_refused']:9.1f}% | "
            f"{g['valid']}/{g['generated']} ({g['finished']} finished)"
        )
    write_result(
        "structured_jsonschemabench",
        "cpu" if not torch.cuda.is_available() else "cuda",
        args.out,
        {
            "model": model_dir.name,
            "schemas": len(bench),
            "sample": [item["id"] for item in sample],
            "compile_timeout_s": args.compile_timeout,
            "gen_max_tokens": args.gen_max_tokens,
            "backends": results,
        },
        script="benchmarks/structured.py",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--jump-batch-sizes", default="1,16")
    ap.add_argument("--jump-max-tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point (best is kept)")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument(
        "--grammar-backend", default=None, help="the scheduler's backend (default: braid's)"
    )
    ap.add_argument(
        "--backends",
        default=",".join(grammar_backend_names()),
        help="backends to compare; jsonschemabench also takes braid (the default with fallbacks)",
    )
    ap.add_argument("--corpus", choices=("schemas", "jsonschemabench"), default="schemas")
    ap.add_argument("--sample", type=int, default=24, help="jsonschemabench: outputs per backend")
    ap.add_argument("--gen-max-tokens", type=int, default=64, help="jsonschemabench: per output")
    ap.add_argument(
        "--compile-timeout", type=float, default=10.0, help="jsonschemabench: seconds per schema"
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default: results/structured[_<corpus>]_<dev>.json)"
    )
    args = ap.parse_args()

    model_dir = resolve_model(args.model)
    assets = ModelAssets.load(str(model_dir))
    if assets.tokenizer is None:
        raise SystemExit("structured generation needs a model with a tokenizer")
    if args.corpus == "jsonschemabench":
        return jsonschemabench(args, model_dir, assets)
    tokenizer = assets.tokenizer
    config = EngineConfig(
        model=str(model_dir),
        kv_tokens=args.kv_tokens,
        show_progress=False,
        grammar_backend=args.grammar_backend,
    )
    backend = config.effective_grammar_backend
    sched = build_scheduler(config, model_dir, assets.eos_token_ids)
    device = sched.device
    vocab = sched.vocab_size
    # Warm up: the first forwards, and the vocabulary the grammar compiler loads.
    sched.grammars.waiting.compiler.submit("json_schema", FREE_TEXT).result()
    run(
        sched,
        [([100, 101, 102], SamplingParams(temperature=0.0, max_tokens=2, json_schema=FREE_TEXT))],
    )

    mask_rows = mask_cost(tokenizer, backend, vocab, device, args.batch_sizes)
    mask = {r["batch_size"]: r for r in mask_rows}
    decode = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        row = decode_cost(sched, vocab, bs, args.output_len, args.input_len, args.repeats)
        # The bitmask's own cost against a free decode step: what the A/B above measures,
        # without the noise of a shared machine.
        mask_ms = mask[bs]["fill_ms"] + mask[bs]["apply_ms"]
        row["mask_ms_per_step"] = mask_ms
        row["mask_share_of_free_step"] = mask_ms / (row["free_decode_ms_per_token"] * bs)
        decode.append(row)
        print(json.dumps(row), flush=True)
    jump = []
    for bs in (int(b) for b in args.jump_batch_sizes.split(",")):
        row = jump_forward_ab(sched, tokenizer, bs, args.jump_max_tokens, args.repeats)
        jump.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "example_text"}), flush=True)
    compile_ = compile_times(tokenizer, backend, args.repeats)
    print(json.dumps({k: v for k, v in compile_.items() if k != "cold_per_schema_s"}), flush=True)
    backends = structured_corpus.backend_costs(tokenizer, args.backends.split(","), corpus_items())

    print(f"\nmodel {model_dir.name} on {device}")
    print(
        f"{'batch':>5} | {'free ms/tok':>11} | {'constrained ms/tok':>18} | {'overhead':>8} | "
        "bitmask alone"
    )
    for r in decode:
        print(
            f"{r['batch_size']:>5} | {r['free_decode_ms_per_token']:11.2f} | "
            f"{r['constrained_decode_ms_per_token']:18.2f} | {100 * r['overhead']:7.1f}% | "
            f"{r['mask_ms_per_step']:.2f} ms/step ({100 * r['mask_share_of_free_step']:.1f}%)"
        )
    print(
        f"\n{'batch':>5} | {'steps off/on':>12} | {'ratio':>5} | {'wall off/on s':>13} | same text"
    )
    for r in jump:
        print(
            f"{r['batch_size']:>5} | {r['steps_off']:>5}/{r['steps_on']:<6} | "
            f"{r['steps_ratio']:5.2f} | {r['wall_s_off']:6.2f}/{r['wall_s_on']:<6.2f} | "
            f"{r['same_text']:.2f}"
        )
    print(
        f"\ncompile ({compile_['schemas']} schemas): cold {compile_['cold_total_s']:.2f} s "
        f"(max {compile_['cold_max_s']:.2f} s), cached {1e3 * compile_['cached_total_s']:.2f} ms, "
        f"pool of 2 cold {compile_['pool_cold_total_s']:.2f} s; vocabulary "
        f"{compile_['vocabulary_build_s']:.2f} s ({backend})"
    )
    print(
        f"\n{'backend':>10} | {'compile s (max)':>15} | {'character regex s':>17} | "
        f"{'mask us/tok mean p50 p99':>24} | forced us/tok"
    )
    for b, r in backends.items():
        char = r["compile_per_item_s"]["sglang_character_regex"]
        print(
            f"{b:>10} | {r['compile_total_s']:6.2f} ({r['compile_max_s']:5.2f}) | {char:17.3f} | "
            f"{r['mask_us_per_token_mean']:8.1f} {r['mask_us_per_token_p50']:6.1f} "
            f"{r['mask_us_per_token_p99']:8.1f} | {r['forced_us_per_token_mean']:.1f}"
        )

    write_result(
        "structured",
        device.type,
        args.out,
        {
            "model": model_dir.name,
            "dtype": str(sched.runner.dtype),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "decode": decode,
            "jump_forward": jump,
            "grammar_backend": backend,
            "compile": compile_,
            "mask": list(mask.values()),
            "backends": backends,
        },
    )


if __name__ == "__main__":
    main()
