"""What a step's grammar work costs on this machine's CPUs: filling the bitmask rows of a batch
and advancing its matchers, one matcher at a time against the library's own threads
(`GrammarMatcher.fill_many` / `advance_many`) with each thread count of `--threads`, per
backend, grammar and batch size.

    python benchmarks/grammar_batch.py --tokenizer DIR      # e.g. the embedded model's directory

Matchers are walked through random allowed tokens first, so each row starts in its own state.
Writes benchmarks/results/grammar_batch_<cpus>cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from braid.runtime.constrained import grammar as grammar_module  # noqa: E402
from braid.runtime.constrained.grammar import GrammarCompiler  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
SPECS = {"regex": ("regex", "[a-z0-9 ,.]*"), "json": ("json_schema", SCHEMA)}


def _walk(matchers, rng: random.Random, steps: int, eos: int) -> None:
    for m in matchers:
        for _ in range(rng.randrange(steps)):
            allowed = [t for t in m.allowed_tokens() if t != eos]
            if not allowed:
                break
            m.advance(rng.choice(allowed))


def measure(
    compiler: GrammarCompiler, backend: str, spec, batch: int, repeats: int, threads: list[str]
) -> dict:
    """Per-row fill and advance times one matcher at a time, and through the library's batch
    calls with each thread count in `threads` ("all": every CPU; the pool is built and used
    once before the timing)."""
    grammar = compiler.compile(*spec)
    words = (compiler.vocab.size + 31) // 32
    rng = random.Random(0)
    out = {}
    modes = [("one_at_a_time", 10**6, None)]
    modes += [(f"threads_{k}", 1, None if k == "all" else k) for k in threads]
    for mode, min_cpus, cap in modes:
        grammar_module.PARALLEL_MIN_CPUS = min_cpus
        if cap is None:
            os.environ.pop("BRAID_GRAMMAR_THREADS", None)
        else:
            os.environ["BRAID_GRAMMAR_THREADS"] = cap
        _clear_pools(backend)
        matchers = [grammar.matcher() for _ in range(batch)]
        _walk(matchers, rng, 6, compiler.eos_token_id)
        cls = type(matchers[0])
        buf = torch.zeros(batch, words, dtype=torch.int32)
        rows = list(range(batch))
        cls.fill_many(matchers, buf, rows)  # builds the pool, outside the timing
        fill = adv = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            cls.fill_many(matchers, buf, rows)
            fill += time.perf_counter() - t0
            tokens = []
            for i in range(batch):
                ids = torch.arange(words * 32)
                bits = ((buf[i][ids // 32] >> (ids % 32)) & 1).bool()
                allowed = [t for t in ids[bits].tolist() if t != compiler.eos_token_id]
                tokens.append(rng.choice(allowed) if allowed else compiler.eos_token_id)
            t0 = time.perf_counter()
            errors = cls.advance_many(matchers, tokens)
            adv += time.perf_counter() - t0
            for i, e in enumerate(errors):
                if e is not None:
                    matchers[i] = grammar.matcher()
        out[mode] = {
            "fill_us_per_row": fill / repeats / batch * 1e6,
            "advance_us_per_row": adv / repeats / batch * 1e6,
        }
    return out


def _clear_pools(backend: str) -> None:
    """Forget the backend's thread pool, so the next batch call builds it for the new
    threshold (only the backend measured is imported: xgrammar may not be installed)."""
    if backend == "llguidance":
        from braid.runtime.constrained import llguidance_backend

        llguidance_backend._executor.cache_clear()
    elif backend == "xgrammar":
        from braid.runtime.constrained import xgrammar_backend

        xgrammar_backend._batch.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--backends", default="llguidance,xgrammar")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--threads", default="all", help="comma-separated thread counts for the batch calls"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        from braid.runtime.models.source import resolve_model

        path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(path))
    cpus = len(os.sched_getaffinity(0))
    threads = args.threads.split(",")
    rows = []
    for backend in args.backends.split(","):
        compiler = GrammarCompiler(tok, backend, fallback=False)
        for name, spec in SPECS.items():
            for batch in (int(b) for b in args.batches.split(",")):
                r = {"backend": backend, "grammar": name, "batch": batch}
                r |= measure(compiler, backend, spec, batch, args.repeats, threads)
                print(json.dumps(r), flush=True)
                rows.append(r)
    write_result("grammar_batch", f"{cpus}cpu", args.out, {"cpus": cpus, "rows": rows})


if __name__ == "__main__":
    main()
