"""The grammar backends compared on corpora (`benchmarks/structured.py` runs these):

- `backend_costs`: per backend, the cold compile time of each constraint of a corpus (in this
  process, one at a time) and the host time per token of filling its bitmask row and of finding
  its forced tokens (jump-forward), walking a valid instance token by token.
- `coverage`: per backend alone (no fallback), JSONSchemaBench schemas compiled on the pool the
  scheduler uses, with its time limit (an overrunning worker is killed): how many compile, how
  many are refused (a keyword the backend would not enforce) or fail, how long they take; and
  for the compiled ones, the share of the benchmark's valid instances each accepts and of its
  invalid instances each refuses.
- `generation`: for a sample of those schemas, SmolLM2 writes one output per schema under each
  backend alone (greedy, short `max_tokens`): the share that finishes and validates with
  `jsonschema` (formats checked).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import torch

from braid import SamplingParams
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler, PendingGrammars
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.ipc.to_scheduler import GenerateReq

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "data" / "jsonschemabench"
# Words in a refusal: the backend would not enforce the schema (as opposed to failing on it).
_REFUSED = ("not enforced", "does not take", "Unimplemented", "Unknown format", "would not",
            "only references", "may overlap", "not supported")  # fmt: skip


_AT = re.compile(r" \(at [^)]*\)")


def load_bench() -> list[dict[str, Any]]:
    """The JSONSchemaBench sample: {id, source, schema, valid, invalid} per schema."""
    out = []
    for path in sorted(BENCH.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            item = json.loads(line)
            out.append({**item, "source": path.stem})
    return out


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def walk_cost(
    compiler: GrammarCompiler, grammar, text: str
) -> tuple[bool, list[float], list[float]]:
    """Walk `text`'s tokens through a matcher of `grammar`: (accepted to a final state, the
    seconds of each bitmask fill, of each forced-token search)."""
    m = grammar.matcher()
    row = torch.empty((compiler.vocab.size + 31) // 32, dtype=torch.int32)
    fills, forced = [], []
    for t in compiler.vocab.encode(text):
        t0 = time.perf_counter()
        m.fill_bitmask(row)
        t1 = time.perf_counter()
        m.forced_tokens()
        fills.append(t1 - t0)
        forced.append(time.perf_counter() - t1)
        try:
            m.advance(t)
        except ValueError:
            return False, fills, forced
    return m.is_final, fills, forced


def backend_costs(tokenizer, backends: list[str], items: list[tuple[str, str, Any, str]]) -> dict:
    """`items`: (name, kind, spec, a text the spec accepts). Per backend (fallback on, as
    served): the backend building its vocabulary view, each item's cold compile, and the mask
    and forced-token time per token on the texts."""
    out = {}
    for backend in backends:
        compiler = GrammarCompiler(tokenizer, backend)
        t0 = time.perf_counter()
        compiler.get_backend(backend)
        setup_s = time.perf_counter() - t0
        compile_s: dict[str, float] = {}
        routed: dict[str, str] = {}
        fills: list[float] = []
        forced: list[float] = []
        accepted = 0
        for name, kind, spec, text in items:
            t0 = time.perf_counter()
            grammar = compiler.compile(kind, spec)
            compile_s[name] = time.perf_counter() - t0
            routed[name] = grammar.backend
            ok, f, j = walk_cost(compiler, grammar, text)
            accepted += ok
            fills += f
            forced += j
        own = [s for n, s in compile_s.items() if routed[n] == backend]
        out[backend] = {
            "vocabulary_build_s": setup_s,
            "compile_total_s": sum(own),
            "compile_max_s": max(own),
            "compile_per_item_s": compile_s,
            "routed_elsewhere": {n: b for n, b in routed.items() if b != backend},
            "mask_us_per_token_mean": 1e6 * statistics.fmean(fills),
            "mask_us_per_token_p50": 1e6 * _percentile(fills, 0.5),
            "mask_us_per_token_p99": 1e6 * _percentile(fills, 0.99),
            "forced_us_per_token_mean": 1e6 * statistics.fmean(forced),
            "tokens": len(fills),
            "instances_accepted": accepted,
            "items": len(items),
        }
        shown = {k: v for k, v in out[backend].items() if "per_item" not in k}
        print(json.dumps({"backend": backend, **shown}), flush=True)
    return out


def _classify(message: str) -> str:
    if "timed out" in message:
        return "timed_out"
    return "refused" if any(w in message for w in _REFUSED) else "failed"


def coverage(
    tokenizer,
    backend: str,
    bench: list[dict],
    timeout_s: float,
    workers: int = 2,
    fallback: bool = False,
):
    """`backend` alone on `bench` (see the module docstring), or with `fallback` as braid
    serves it; returns (summary, the compiled grammars by id, each schema's outcome)."""
    compiler = GrammarCompiler(tokenizer, backend, fallback=fallback)
    pool = AsyncGrammarCompiler(lambda: compiler, workers=workers)
    pending: PendingGrammars[str] = PendingGrammars(pool, timeout_s)
    pool.submit("regex", "warm").result()  # vocabulary and workers up: time compiles alone
    started: dict[str, float] = {}
    outcome: dict[str, str] = {}
    seconds: dict[str, float] = {}
    grammars = {}
    reasons: Counter[str] = Counter()
    queue = list(bench)
    try:
        while queue or len(pending):
            while queue and len(pending) < workers:  # as many at once as there are workers
                item = queue.pop(0)
                started[item["id"]] = time.perf_counter()
                pending.add(item["id"], "json_schema", item["schema"])
            pending.wait(0.02)
            ready, failed = pending.poll()
            now = time.perf_counter()
            for rid, grammar in ready:
                outcome[rid], seconds[rid], grammars[rid] = "compiled", now - started[rid], grammar
            for rid, message in failed:
                outcome[rid] = _classify(message)
                if outcome[rid] != "timed_out":
                    reasons[_AT.sub("", message.split(":", 1)[-1]).strip()[:100]] += 1
    finally:
        pool.shutdown()
    valid_ok = valid_n = invalid_refused = invalid_n = 0
    invalid_accepted: list[str] = []  # a grammar that accepts an invalid instance fails open
    for item in bench:
        grammar = grammars.get(item["id"])
        if grammar is None:
            continue
        for instance in item["valid"]:
            valid_n += 1
            valid_ok += walk_cost(compiler, grammar, json.dumps(instance))[0]
        for instance in item["invalid"]:
            invalid_n += 1
            if walk_cost(compiler, grammar, json.dumps(instance))[0]:
                invalid_accepted.append(item["id"])
            else:
                invalid_refused += 1
    counts = Counter(outcome.values())
    compiled = [seconds[i] for i in grammars]
    summary = {
        "schemas": len(bench),
        "compiled": counts["compiled"],
        "refused": counts["refused"],
        "failed": counts["failed"],
        "timed_out": counts["timed_out"],
        "compiled_fraction": counts["compiled"] / len(bench),
        "compile_s_p50": _percentile(compiled, 0.5),
        "compile_s_p90": _percentile(compiled, 0.9),
        "compile_s_max": max(compiled, default=float("nan")),
        "by_source": {
            src: sum(outcome[i["id"]] == "compiled" for i in bench if i["source"] == src)
            for src in sorted({i["source"] for i in bench})
        },
        "valid_instances_accepted": valid_ok / max(1, valid_n),
        "invalid_instances_refused": invalid_refused / max(1, invalid_n),
        "invalid_instances_accepted_by": invalid_accepted,
        "instances": [valid_n, invalid_n],
        "top_refusals": reasons.most_common(8),
        "time_limit_s": timeout_s,
        "compiled_by": dict(Counter(g.backend for g in grammars.values())),
    }
    return summary, grammars, outcome


def _validates(schema: Any, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)


def generation(sched, tokenizer, sample: list[dict], max_tokens: int, warm_s: float = 120) -> dict:
    """One greedy output per schema of `sample` on `sched` (its grammar backend alone): how
    many were refused, finished, and validate. The grammars are compiled first (up to
    `warm_s`), so that a burst of new schemas queueing for the workers does not count: that
    is `coverage`'s to measure."""
    pool = sched.grammars.waiting.compiler
    concurrent.futures.wait([pool.submit("json_schema", i["schema"]) for i in sample], warm_s)
    prompt = tokenizer.encode("Reply with one JSON value only.\n")
    refused: list[str] = []
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for item in sample:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=item["schema"])
        sched.handle(GenerateReq(item["id"], prompt, sp, 0))
    t0 = time.perf_counter()
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
            if out.error:
                refused.append(out.rid)
    texts = {rid: tokenizer.decode(t, skip_special_tokens=True) for rid, t in ids.items()}
    by_id = {item["id"]: item for item in sample}
    stopped = [rid for rid, f in finish.items() if f == "stop" and rid not in refused]
    valid = [rid for rid in stopped if _validates(by_id[rid]["schema"], texts[rid])]
    generated = len(sample) - len(refused)
    return {
        "sampled": len(sample),
        "refused_or_failed": len(refused),
        "generated": generated,
        "finished": len(stopped),
        "valid": len(valid),
        "valid_fraction_of_generated": len(valid) / max(1, generated),
        "valid_fraction_of_finished": len(valid) / max(1, len(stopped)),
        "invalid_finished": {rid: texts[rid][:120] for rid in stopped if rid not in valid},
        "unfinished": {
            rid: texts[rid][:120] for rid in ids if rid not in stopped and rid not in refused
        },
        "wall_s": time.perf_counter() - t0,
        "max_tokens": max_tokens,
    }
