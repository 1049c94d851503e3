"""Start-up time of the embedded model: the first start (GGUF conversion into an empty cache)
and a second start (the converted copy reused), each in a fresh Python process; then, with the
converted copy, `--engines` engines started one after another in one process (a test suite's
or a notebook's pattern), with the runtime's children started from the fork server (the
default) and spawned (`BRAID_START_METHOD=spawn`), alternating over `--repeats` processes.

    python benchmarks/load_time.py
    python benchmarks/load_time.py --engines 4 --repeats 3

Writes benchmarks/results/load_time.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

# Time from interpreter start to a ready engine, measured inside the child process.
CHILD = """
import time
t0 = time.perf_counter()
import braid
llm = braid.LLM(show_progress=False, kv_tokens=4096)
ready = time.perf_counter() - t0
out = llm.generate(["Hello"], braid.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
print(f"READY {ready:.3f} {llm.load_time_s:.3f}")
for _ in range(ENGINES - 1):
    llm.shutdown()
    t0 = time.perf_counter()
    llm = braid.LLM(show_progress=False, kv_tokens=4096)
    print(f"AGAIN {time.perf_counter() - t0:.3f}")
"""


def start(cache: str, engines: int = 1, method: str = "forkserver") -> dict:
    env = {
        "BRAID_CACHE_DIR": cache,
        "BRAID_LOG_LEVEL": "WARNING",
        "BRAID_START_METHOD": method,
        "PATH": "/usr/bin:/bin",
    }
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", f"ENGINES = {engines}\n" + CHILD],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - t0
    lines = p.stdout.splitlines()
    _, ready, engine = next(x for x in lines if x.startswith("READY")).split()
    out = {"process_wall_s": wall, "import_to_ready_s": float(ready), "llm_init_s": float(engine)}
    if engines > 1:
        out["later_llm_init_s"] = [float(x.split()[1]) for x in lines if x.startswith("AGAIN")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4, help="engines started in one process")
    ap.add_argument("--repeats", type=int, default=3, help="processes per start method")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"forkserver": [], "spawn": []}
    with tempfile.TemporaryDirectory() as cache:
        first = start(cache)
        second = start(cache)
        for _ in tqdm(range(args.repeats), desc="processes of each method"):
            for method, done in runs.items():
                done.append(start(cache, args.engines, method))
    print(f"{'start':>6} | {'LLM() s':>8} | {'import+LLM() s':>14} | {'process s':>9}")
    for name, r in (("first", first), ("second", second)):
        print(
            f"{name:>6} | {r['llm_init_s']:8.2f} | {r['import_to_ready_s']:14.2f} | "
            f"{r['process_wall_s']:9.2f}"
        )
    summary = {}
    for method, done in runs.items():
        firsts = [r["llm_init_s"] for r in done]
        later = [t for r in done for t in r["later_llm_init_s"]]
        summary[method] = {
            "first_llm_init_median_s": statistics.median(firsts),
            "later_llm_init_median_s": statistics.median(later),
            "later_llm_init_best_s": min(later),
        }
        print(
            f"{method}: an engine's LLM() in a process, first {statistics.median(firsts):.2f} s, "
            f"later ones median {statistics.median(later):.2f} s (best {min(later):.2f})"
        )
    result = {
        "benchmark": "load_time",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/load_time.py " + " ".join(sys.argv[1:]),
        "model": "smollm2-135m (embedded GGUF)",
        "first_start": first,
        "second_start": second,
        "engines_per_process": args.engines,
        "in_one_process": {"runs": runs, "summary": summary},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "load_time.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'load_time.json'}")


if __name__ == "__main__":
    main()
