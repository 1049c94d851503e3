"""The benchmark scripts still run (at toy sizes): a benchmark that rots is found here, not
on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_offline_throughput_runs_and_matches_transformers(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run(
        [
            sys.executable,
            "benchmarks/offline_throughput.py",
            "--model",
            "benchmarks/configs/tiny-llama",
            "--load-format",
            "dummy",
            "--batch-sizes",
            "1,2",
            "--input-len",
            "6",
            "--output-len",
            "3",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["rows"]] == [1, 2]
    # Same random weights in both engines, float32: the same greedy tokens.
    assert all(r["same_tokens"] == 1.0 for r in result["rows"])
    assert result["machine"]["torch"]
