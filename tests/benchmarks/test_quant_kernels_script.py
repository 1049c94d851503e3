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
    reads = {"read_bf16", "read_int4", "read_int8", "read_fp8", "read_int4_rows"}
    ahead_methods = {"int4_ahead", "fp8_ahead"}
    assert {r["method"] for r in rows} == {"int4", "int8", "fp8"} | ahead_methods | reads
    assert {r["m"] for r in rows} == {1, 3, 40}
    assert {r["m"] for r in rows if r["method"] in reads | ahead_methods} == {1}
    variants = {r["variant"].split(":")[0] for r in rows}
    assert {"gemv", "planar", "dequant+cublas", "int4_linear(old)", "int8_linear"} <= variants
    # The GEMV over inputs packed ahead, both forms, checked against int4's reference.
    ahead = {r["variant"] for r in rows if r["method"] == "int4_ahead"}
    assert any(v.endswith("_f16x2") for v in ahead) and any(v.endswith("_f16x2z") for v in ahead)
    # The fp8 GEMV over codes made ahead, on the CUDA cores and the tensor cores.
    fp8_ahead = {r["variant"] for r in rows if r["method"] == "fp8_ahead"}
    fp8_ahead = {v for v in fp8_ahead if v.startswith("ahead:")}
    assert any(v.endswith("_dot") for v in fp8_ahead) and any("_dot" not in v for v in fp8_ahead)
    # And each with its preparing launch timed too, at the table's configuration.
    assert {"pack+ahead:table", "quant+ahead:table"} <= {r["variant"] for r in rows}
    assert all(r["ok"] and r["us"] > 0 and r["error"] < 2e-2 for r in rows)
    assert set(result["tables"]) == {
        "INT4_CONFIGS",
        "INT8_CONFIGS",
        "FP8_CONFIGS",
        "INT4_AHEAD_CONFIGS",
        "FP8_AHEAD_CONFIGS",
        "DEQUANTIZE_MIN_ROWS",
    }
    assert "DEQUANTIZE_MIN_ROWS =" in p.stdout and "INT8_CONFIGS = {(" in p.stdout
    # The GEMVs over inputs made ahead get launch shapes of their own, where a GEMV over them
    # (not one timed with its preparing launch) is the best of its shape.
    assert "FP8_AHEAD_CONFIGS = {" in p.stdout and "INT4_AHEAD_CONFIGS = {" in p.stdout
    for method in ("int4_ahead", "fp8_ahead"):
        shapes = {(r["n"], r["k"]) for r in rows if r["method"] == method}
        fastest = [min((r["us"], r["variant"]) for r in rows if r["method"] == method
                       and (r["n"], r["k"]) == shape)[1] for shape in shapes]  # fmt: skip
        won = sum(v.startswith("ahead:") for v in fastest)
        assert len(result["tables"][f"{method.upper()}_CONFIGS"]) == won
    # Each one-row GEMV's time over the floor of reading its bytes, and a layer's sums.
    assert any(line.startswith("a ") and "int4 " in line and "x its read floor" in line
               for line in result["best"])  # fmt: skip
    assert any(line.startswith("a layer M=1 read_int4") for line in result["best"])
    assert any(line.startswith("a layer M=1 int4_ahead") for line in result["best"])
    assert any(line.startswith("a layer M=1 fp8_ahead") for line in result["best"])
    assert any(r["variant"].endswith("_dot") and r["method"] == "fp8" for r in rows)
    assert any(r["variant"].endswith("_f16x2") and r["method"] == "int4" for r in rows)
    assert any(r["variant"].endswith("_f16x2_sf") and r["method"] == "int4" for r in rows)
    assert any(r["variant"].endswith("_f16x2z_sf") and r["method"] == "int4" for r in rows)


def test_write_config_merges_the_one_row_choices_under_the_gpu(tmp_path):
    """`--write-config`: each method's one-row choice per shape, fp8's tensor-core flag,
    int4's float16-pairs flag and the grid order included, merged into quant_gemv.json under
    the GPU's name (other GPUs' entries kept), and read back by `config_for` on that GPU."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.quant_kernels import write_config
    from braid.kernels import quant_gemv

    path = tmp_path / "quant_gemv.json"
    path.write_text(json.dumps({"Other GPU": {"fp8/1/2": [16, 512, 1, 4, 3, False]}}))
    tables = {
        "INT4_CONFIGS": {
            (4096, 4096): (256, 128, 8, 4, 3),
            (6144, 4096): (512, 128, 8, 4, 2, False, True),
            (28672, 4096): (256, 256, 8, 4, 2, False, 2, True),
        },
        "INT8_CONFIGS": {},
        "FP8_CONFIGS": {(4096, 14336): (64, 256, 4, 4, 3, True, False)},
        "INT4_AHEAD_CONFIGS": {},
        "FP8_AHEAD_CONFIGS": {(4096, 14336): (16, 512, 1, 4, 3, False, 0, False)},
    }
    write_config(tables, "Some GPU", path)
    data = json.loads(path.read_text())
    assert data["Other GPU"] == {"fp8/1/2": [16, 512, 1, 4, 3, False]}
    assert data["Some GPU"] == {
        "fp8/4096/14336": [64, 256, 4, 4, 3, True, False, False],
        "fp8_ahead/4096/14336": [16, 512, 1, 4, 3, False, 0, False],
        "int4/28672/4096": [256, 256, 8, 4, 2, False, 2, True],
        "int4/4096/4096": [256, 128, 8, 4, 3, False, False, False],
        "int4/6144/4096": [512, 128, 8, 4, 2, False, True, False],
    }
    old = quant_gemv.TUNED_CONFIGS
    try:
        quant_gemv.TUNED_CONFIGS = path
        quant_gemv._tuned_table.cache_clear()
        names = {0: "Some GPU", 1: "Other GPU"}
        real = quant_gemv.cuda_device_name
        quant_gemv.cuda_device_name = names.get
        try:
            cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
            got = quant_gemv.config_for("fp8", 4096, 14336, cuda0)
            assert got == quant_gemv.GemvConfig(64, 256, 4, 4, 3, dot=True)
            got = quant_gemv.config_for("int4", 6144, 4096, cuda0)
            assert got == quant_gemv.GemvConfig(512, 128, 8, 4, 2, packed=True)
            got = quant_gemv.config_for("int4", 28672, 4096, cuda0)
            assert got == quant_gemv.GemvConfig(256, 256, 8, 4, 2, packed=2, splits_first=True)
            # The GEMV over codes made ahead: its own entry, else its kind's choice.
            got = quant_gemv.config_for("fp8_ahead", 4096, 14336, cuda0)
            assert got == quant_gemv.GemvConfig(16, 512, 1, 4, 3)
            got = quant_gemv.config_for("int4_ahead", 28672, 4096, cuda0)
            assert got == quant_gemv.GemvConfig(256, 256, 8, 4, 2, packed=2, splits_first=True)
            # An entry written before the packed flag existed (six fields) still reads.
            assert quant_gemv.config_for("fp8", 1, 2, cuda1) == quant_gemv.GemvConfig(
                16, 512, 1, 4, 3
            )
            # Not measured on that GPU, or not a GPU: the tables' choice.
            table = quant_gemv.FP8_CONFIGS[(4096, 14336)]
            assert quant_gemv.config_for("fp8", 4096, 14336, cuda1) == table
            assert quant_gemv.config_for("fp8", 4096, 14336, torch.device("cpu")) == table
        finally:
            quant_gemv.cuda_device_name = real
    finally:
        quant_gemv.TUNED_CONFIGS = old
        quant_gemv._tuned_table.cache_clear()
