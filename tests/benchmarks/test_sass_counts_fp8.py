"""benchmarks/sass_counts.py --kernels fp8: the fp8 GEMV over codes made ahead compiles for
sm_90 (here, no GPU: the CPU tests run the interpreter) and drops the row's max |x| pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the sm_90 build check is the CPU machine's")
def test_fp8_gemv_over_codes_made_ahead_compiles_and_issues_fewer_instructions(tmp_path):
    out = tmp_path / "fp8.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "benchmarks/sass_counts.py", "--kernels", "fp8", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    made = [k for k in rows if "codes ahead" not in k]  # "fp8[ dot] NxK"
    pairs = [(k, "{} codes ahead {}".format(*k.rsplit(" ", 1))) for k in made]
    assert len(pairs) == 4
    for made, ahead in pairs:
        assert rows[ahead]["spill_stores"] == 0
        # The max |x| pass (L2 reads of the whole row and a reduction) is gone.
        assert rows[ahead]["kernel_instructions"] < 0.8 * rows[made]["kernel_instructions"]
        assert rows[ahead]["loop_instructions"] <= rows[made]["loop_instructions"]
