"""benchmarks/quant_kernels.py runs at toy size on the CPU (Triton's interpreter), so the H200
command does not rot unseen: every method's variants are checked against their references and
timed, and the runtime's tables are derived from the fastest correct ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's")
def test_smoke_run_checks_every_variant_and_writes_the_tables(tmp_path):
    out = tmp_path / "q.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run(
        [sys.executable, "benchmarks/quant_kernels.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["method"] for r in rows} == {"int4", "int8", "fp8"}
    assert {r["m"] for r in rows} == {1, 3, 40}
    variants = {r["variant"].split(":")[0] for r in rows}
    assert {"gemv", "planar", "dequant+cublas", "int4_linear(old)", "int8_linear"} <= variants
    assert all(r["ok"] and r["us"] > 0 and r["error"] < 2e-2 for r in rows)
    assert set(result["tables"]) == {
        "INT4_CONFIGS",
        "INT8_CONFIGS",
        "FP8_CONFIGS",
        "DEQUANTIZE_MIN_ROWS",
    }
    assert "DEQUANTIZE_MIN_ROWS =" in p.stdout and "INT8_CONFIGS = {(" in p.stdout
