"""Start-up time of the embedded model: the first start (GGUF conversion into an empty cache)
and a second start (the converted copy reused), each in a fresh Python process.

    python benchmarks/load_time.py

Writes benchmarks/results/load_time.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

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
"""


def start(cache: str) -> dict:
    env = {"BRAID_CACHE_DIR": cache, "BRAID_LOG_LEVEL": "WARNING", "PATH": "/usr/bin:/bin"}
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    line = next(x for x in p.stdout.splitlines() if x.startswith("READY"))
    _, ready, engine = line.split()
    return {"process_wall_s": wall, "import_to_ready_s": float(ready), "llm_init_s": float(engine)}


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        first = start(cache)
        second = start(cache)
    print(f"{'start':>6} | {'LLM() s':>8} | {'import+LLM() s':>14} | {'process s':>9}")
    for name, r in (("first", first), ("second", second)):
        print(
            f"{name:>6} | {r['llm_init_s']:8.2f} | {r['import_to_ready_s']:14.2f} | "
            f"{r['process_wall_s']:9.2f}"
        )
    result = {
        "benchmark": "load_time",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/load_time.py",
        "model": "smollm2-135m (embedded GGUF)",
        "first_start": first,
        "second_start": second,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "load_time.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'load_time.json'}")


if __name__ == "__main__":
    main()
