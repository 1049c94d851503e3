"""benchmarks/profile_gemv.py: its cases run at toy size on the CPU (Triton's interpreter), so
the Nsight Compute command does not rot unseen, and its summary reads ncu's raw page (a header
row, a units row, one row per kernel) into per-case figures."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _script(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/profile_gemv.py with `args`, under Triton's interpreter; it must succeed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "benchmarks/profile_gemv.py", *args]
    p = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's")
def test_smoke_run_calls_every_case():
    sys.path.insert(0, str(ROOT))
    from benchmarks.profile_gemv import CASES

    p = _script("--smoke")
    printed = [line for line in p.stdout.splitlines() if line.startswith("case ")]
    assert printed == [f"case {i}: {c[0]}" for i, c in enumerate(CASES)]


def test_summary_reads_the_raw_page_per_case(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.profile_gemv import CASES

    stalled = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum"]
    header += ["dram__bytes_read.sum.pct_of_peak_sustained_elapsed", "launch__grid_size"]
    header += [stalled.format("long_scoreboard"), stalled.format("barrier")]
    header += [stalled.format("wait"), "device__attribute_display_name"]
    units = ["", "", "us", "Mbyte", "%", "", "inst", "inst", "inst", ""]
    kernels = [
        ["0", "_int4_gemv_f16x2_kernel", "10", "12.0", "31.5", "384", "5.5", "0", "0.2", "H"],
        ["1", "void cublasLt::splitKreduce_kernel<32>", "2", "0.1", "1", "8", "0", "0", "0", "H"],
        ["2", "_int4_gemv_f16x2_kernel", "8", "12.0", "40.0", "384", "3", "1.5", "n/a", "H"],
    ]
    raw = tmp_path / "raw.csv"
    with raw.open("w", newline="") as f:
        csv.writer(f).writerows([header, units, *kernels])
    out = tmp_path / "p.json"
    _script("--summarize", str(raw), "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    # A helper kernel (cuBLAS's split-K reduction) belongs to the case before it.
    assert [r["case"] for r in rows] == [CASES[0][0], f"{CASES[0][0]} (helper)", CASES[1][0]]
    first, _, second = rows
    assert first["us"] == 10.0 and first["programs"] == 384.0 and first["gpu"] == "H"
    assert first["dram_read_bytes"] == 12e6  # in the units ncu named
    assert first["dram_read_tb_per_s"] == pytest.approx(1.2)  # 12 MB in 10 us
    assert first["dram_pct_of_peak"] == 31.5
    # Stall reasons, largest first; zeros and unreadable values left out.
    assert list(first["stalls"].items()) == [("long_scoreboard", 5.5), ("wait", 0.2)]
    assert list(second["stalls"]) == ["long_scoreboard", "barrier"]
    # Times in milliseconds are converted; a unit the summary does not know is refused.
    units[2] = "ms"
    with raw.open("w", newline="") as f:
        csv.writer(f).writerows([header, units, kernels[0]])
    from benchmarks.profile_gemv import summarize

    assert summarize(raw)[0]["us"] == 10_000.0
    units[2] = "cycle"
    with raw.open("w", newline="") as f:
        csv.writer(f).writerows([header, units, kernels[0]])
    with pytest.raises(ValueError, match="gpu__time_duration.sum in unknown unit 'cycle'"):
        summarize(raw)
