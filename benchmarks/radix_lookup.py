"""The radix cache's prefix lookups at an agent workload's shape: the host work lpm and the
`program` policy pay at every admission (they look up every waiting request's prompt).

    python benchmarks/radix_lookup.py            # 256 sequences, ~1k tokens, page size 1

A tree of `--sequences` cached sequences (a shared system prompt of `--system` tokens, then
each its own 200-1200 tokens, as the agents benchmark's programs grow), then one pass looks
up each sequence extended by `--new` tokens (the program's next call): milliseconds per pass
(median of `--repeats`) and tokens matched (every cached token: a check). To compare against
an earlier radix cache, run the script with PYTHONPATH pointing at a checkout of it. Writes
benchmarks/results/radix_lookup_cpu.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from braid.runtime.cache.memory_pool import PageAllocator  # noqa: E402
from braid.runtime.cache.radix_cache import RadixCache  # noqa: E402

VOCAB = 49152


def build(sequences: int, system: int, new: int, seed: int = 0):
    """The cache holding `sequences` sequences, and the prompts that extend each of them."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(system)]
    seqs = [
        prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(200, 1200))]
        for _ in range(sequences)
    ]
    alloc = PageAllocator(sum(map(len, seqs)) + 1, 1)
    cache = RadixCache(alloc)
    for s in seqs:
        cache.insert(s, alloc.alloc(len(s)))
    prompts = [s + [rng.randrange(VOCAB) for _ in range(new)] for s in seqs]
    cached = sum(map(len, seqs)) - system * (sequences - 1)
    return cache, prompts, sum(map(len, seqs)), cached


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--system", type=int, default=300, help="shared prefix tokens")
    ap.add_argument("--new", type=int, default=100, help="tokens each prompt adds")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cache, prompts, expected, cached = build(args.sequences, args.system, args.new)
    times, matched = [], 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        matched = sum(len(cache.match_prefix(p).pages) for p in prompts)
        times.append(time.perf_counter() - t0)
    if matched != expected:
        raise RuntimeError(f"matched {matched} tokens, expected {expected}")
    ms = statistics.median(times) * 1e3
    print(f"{args.sequences} lookups: {ms:.2f} ms per pass ({matched} tokens matched)")
    write_result(
        "radix_lookup",
        "cpu",
        args.out,
        {
            "sequences": args.sequences,
            "system_tokens": args.system,
            "new_tokens": args.new,
            "cached_tokens": cached,
            "matched_tokens": matched,
            "ms_per_pass": ms,
            "us_per_lookup": ms * 1e3 / args.sequences,
            "pass_ms": [t * 1e3 for t in times],
        },
    )


if __name__ == "__main__":
    main()
