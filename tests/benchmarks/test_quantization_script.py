"""benchmarks/quantization.py still runs (at toy size, on the CPU): its H200 run's code paths,
one engine per method, the figures derived as the script's docstring says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.quantization import METHOD_NAMES, quantization_config  # noqa: E402
from braid.runtime.quantization import select_quantization  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_each_benchmark_method_is_a_checkpoint_config_braid_reads():
    names = {
        m: select_quantization(quantization_config(m, 128), None, dummy=True) for m in METHOD_NAMES
    }
    assert names["float"] is None
    assert {m: q.name for m, q in names.items() if q} == {
        "int4": "awq",
        "int8": "w8a16",
        "fp8": "fp8",
    }
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        quantization_config("int3", 128)


def test_tiny_cpu_run_writes_every_figure(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/quantization.py",
            "--tiny-cpu",
            "--methods",
            "float,int4,fp8",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "quantization" and r["preset"] == "tiny"
    assert r["command"].startswith("python benchmarks/quantization.py --tiny-cpu")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True,
                          capture_output=True).stdout.strip()  # fmt: skip
    assert head and r["code"].startswith(head[:7])  # the commit it was measured at
    bw = r["copy_bandwidth"]["bytes_per_s"]
    methods = r["methods"]
    assert list(methods) == ["float", "int4", "fp8"]
    # tiny-llama: 2 layers of (qkv 64x128, o 64x64, gate_up 64x256, down 128x64) float32.
    float_linear = 4 * 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    assert methods["float"]["linear_weight_bytes"] == float_linear
    # int4: half a byte a weight plus scales and zeros; fp8: a byte plus a scale per row.
    assert methods["int4"]["linear_weight_bytes"] < float_linear / 6
    assert float_linear / 4 < methods["fp8"]["linear_weight_bytes"] < float_linear / 3.5
    for name, m in methods.items():
        assert m["roofline_tok_s"] == pytest.approx(bw / m["decode_read_bytes"])
        assert [d["batch_size"] for d in m["decode"]] == [1, 2]
        for d in m["decode"]:
            assert d["tok_s"] > 0
            assert d["fraction_of_roofline"] == pytest.approx(
                d["tok_s"] / (d["batch_size"] * m["roofline_tok_s"])
            )
            base = next(b for b in methods["float"]["decode"] if b["batch_size"] == d["batch_size"])
            assert d["vs_float"] == pytest.approx(d["tok_s"] / base["tok_s"])
        prefill = m["prefill"]
        rate = r["fp8_matmul" if name == "fp8" else "matmul"]["flops_per_s"]
        assert prefill["mfu"] == pytest.approx(prefill["flops"] / min(prefill["s"]) / rate)
        assert {k["layer"] for k in m["layer0_kernels"]} == {
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        }
        assert all(k["us_m1"] > 0 and k["us_m2"] > 0 for k in m["layer0_kernels"])
    assert set(r["targets"]) == {"int4_decode_speedup", "fp8_decode_speedup", "fp8_prefill_mfu"}
