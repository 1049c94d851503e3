"""The GGUF benchmarks still run at toy size on the CPU and write every figure their docstrings
name: benchmarks/gguf_cpu.py (a tiny GGUF file, every braid method and transformers; no
llama.cpp here) and benchmarks/gguf_gpu.py (its kernel loop under Triton's interpreter).
benchmarks/cpu_step.py times a few forwards of the embedded model. benchmarks/perplexity.py
runs whole in tests/runtime/test_perplexity.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], out: Path, **env) -> dict:
    p = subprocess.run(
        [sys.executable, *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_gguf_cpu_tiny_run_writes_every_engine(tmp_path):
    r = _run(["benchmarks/gguf_cpu.py", "--tiny-cpu", "--repeats", "1"], tmp_path / "c.json")
    engines = r["engines"]
    assert set(engines) == {"braid float32", "braid gguf", "braid int8", "transformers float32"}
    assert all(e["tokens_per_s"]["1"] > 0 for e in engines.values())
    # Kept quantized holds fewer weight bytes than float32, so more KV fits beside them.
    f, g = engines["braid float32"], engines["braid gguf"]
    assert g["weight_mb"] < f["weight_mb"]
    assert g["kv_tokens_in_budget"] > f["kv_tokens_in_budget"]


def test_gguf_gpu_tiny_run_checks_every_type(tmp_path):
    r = _run(["benchmarks/gguf_gpu.py", "--tiny"], tmp_path / "g.json", TRITON_INTERPRET="1")
    rows = [row for row in r["kernels"] if row["layer"] != "layer"]
    assert {row["type"] for row in rows} == {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"}
    assert {row["rows"] for row in rows} == {1, 16, 512}
    assert all(row["max_abs_err_vs_reference"] < 1e-2 for row in rows)
    # Each type's "layer" row sums its shapes' times, per row count.
    for qtype in ("Q4_K", "Q6_K"):
        layer = next(x for x in r["kernels"] if x["type"] == qtype and x["layer"] == "layer")
        shapes = [x for x in rows if x["type"] == qtype and x["rows"] == layer["rows"]]
        assert layer["us"] == pytest.approx(sum(x["us"] for x in shapes), rel=1e-3)


def test_gguf_gpu_times_a_baseline_with_its_own_planes(tmp_path):
    # The kernel and the planes of the working tree given as the baseline: each row carries
    # the baseline's time and its error against the reference of today's planes (a zero
    # point's type and a K-quant's).
    args = ["benchmarks/gguf_gpu.py", "--tiny", "--rows", "1", "--types", "Q4_0,Q4_K"]
    args += ["--baseline", "braid/kernels/gguf_gemm.py"]
    args += ["--baseline-reference", "braid/kernels/gguf_reference.py"]
    r = _run(args, tmp_path / "g.json", TRITON_INTERPRET="1")
    rows = [row for row in r["kernels"] if row["layer"] != "layer"]
    assert [row["type"] for row in rows] == ["Q4_0", "Q4_K"]
    assert all(row["baseline_us"] > 0 for row in rows)
    assert all(row["baseline_max_abs_err_vs_reference"] < 1e-2 for row in rows)


@pytest.mark.parametrize(
    "slots, layers, batch", [("shuffled", "native", 1), ("run", "python", 1), ("run", "native", 3)]
)
def test_cpu_step_times_the_embedded_models_forward(tmp_path, slots, layers, batch):
    args = ["benchmarks/cpu_step.py", "--context", "16", "--steps", "2", "--rounds", "2"]
    extra = ["--slots", slots, "--layers", layers, "--batch", str(batch)]
    r = _run([*args, *extra], tmp_path / "s.json")
    assert (r["method"], r["slots"], r["context"], r["steps"]) == ("gguf", slots, 16, 2)
    assert (r["layers"], r["batch"], r["native_decode"]) == (layers, batch, layers == "native")
    assert len(r["rounds_ms"]) == 2 and r["forward_ms"] == min(r["rounds_ms"]) > 0
