"""The benchmark scripts still run (at toy sizes): a benchmark that rots is found here, not
on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_no_script_shadows_an_installed_module():
    """A script runs with its own directory first on sys.path, so a script named like an
    installed module hides that module from every import, transformers' included:
    transformers 5.25 imports the `kernels` package, which `benchmarks/kernels.py` (now
    `kernel_timings.py`) hid, and every benchmark that loads a transformers model failed."""
    import importlib.util

    clashes = []
    for folder in ("benchmarks", "examples", "tools"):
        for script in sorted((ROOT / folder).glob("*.py")):
            spec = importlib.util.find_spec(script.stem)
            if spec is not None and spec.origin and Path(spec.origin).parent != script.parent:
                clashes.append(f"{folder}/{script.name} hides {spec.origin}")
    assert not clashes, clashes


def test_partial_chunks_script_runs_both_settings_on_the_same_prompts(tmp_path):
    """At toy size (budget 16, prompts of 8-30 tokens): both settings' runs, round by round,
    on the same prompts (the same tokens computed); only the budget-filled engine cuts prompts
    that fit a step of their own, so it cuts more."""
    out = tmp_path / "r.json"
    args = ["--model", "benchmarks/configs/tiny-llama", "--load-format", "dummy"]
    args += ["--num-prompts", "8", "--min-len", "8", "--max-len", "30", "--output-len", "2"]
    args += ["--chunked-prefill-size", "16", "--repeats", "2", "--out", str(out)]
    subprocess.run(
        [sys.executable, "benchmarks/partial_chunks.py", *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    filled, whole = result["runs"]["budget-filled"], result["runs"]["whole-prompts"]
    assert len(filled) == len(whole) == len(result["ratios"]) == 2
    for a, b in zip(filled, whole):
        assert a["prefill_tokens_computed"] == b["prefill_tokens_computed"] > 8 * 8
        assert a["chunked_prompts"] > b["chunked_prompts"]


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


def _gpu_script(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/gpu.py", *args, "--out", str(tmp_path / "r.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.mark.parametrize("figure", ["decode", "prefill", "offline", "prefix"])
def test_gpu_figures_run_at_toy_size_on_cpu(tmp_path, figure):
    p = _gpu_script(tmp_path, figure, "--tiny-cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["benchmark"] == f"gpu_{figure}"
    assert r["command"].startswith(f"python benchmarks/gpu.py {figure} --tiny-cpu")
    assert r["machine"]["torch"] and r["machine"]["transformers"]
    bw, rate = r["copy_bandwidth"]["bytes_per_s"], r["matmul"]["flops_per_s"]
    assert bw > 0 and rate > 0
    # tiny-llama: 2 layers of (qkv 64x128, o 64x64, gate_up 64x256, down 128x64) weights,
    # plus embedding, lm_head (512x64 each) and 5 norms of 64, float32.
    layer_params = 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    assert r["weight_bytes"] == 4 * (layer_params + 2 * 512 * 64 + 5 * 64)
    if figure == "decode":
        assert r["roofline_tok_s"] == pytest.approx(bw / r["weight_bytes"])
        assert r["fraction_of_roofline"] == pytest.approx(r["braid_tok_s"] / r["roofline_tok_s"])
        assert len(r["braid_s"]) == 2 and r["hf_tok_s"] > 0
    elif figure == "prefill":
        n = r["prompt_len"]
        flops = 2 * layer_params * n + 2 * 512 * 64 + 4 * 2 * 4 * 16 * n * (n + 1) // 2
        assert r["flops"] == flops
        assert r["mfu"] == pytest.approx(flops / min(r["braid_s"]) / rate)
    elif figure == "offline":
        assert r["bound"]["bound_s"] > 0
        assert r["fraction_of_bound"] == pytest.approx(r["bound"]["bound_s"] / r["braid_s"])
        assert [h["batch_size"] for h in r["hf_rows"]] == [2, 4]
        assert r["speedup"] == pytest.approx(r["braid_tok_s"] / r["hf_tok_s"])
    else:
        rows = {row["workload"]: row for row in r["rows"]}
        assert set(rows) == {"mmlu_5shot", "hellaswag_20shot", "multi_turn_chat"}
        for row in rows.values():
            assert row["no_cache"]["hit_rate"] == 0.0
            assert row["cache"]["hit_rate"] > 0.5
            assert row["cache"]["hit_rate"] <= row["cache"]["best_hit_rate"] + 1e-9
            assert (
                row["cache"]["prefill_tokens_computed"] < row["no_cache"]["prefill_tokens_computed"]
            )


def test_gpu_script_refuses_an_unknown_engine_arg(tmp_path):
    p = _gpu_script(tmp_path, "decode", "--tiny-cpu", "--engine-arg", "no_such_knob=1")
    assert p.returncode == 2
    assert "no_such_knob" in p.stderr and "kv_tokens" in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gpu_script_without_cuda_says_so_and_points_to_tiny_cpu(tmp_path):
    p = _gpu_script(tmp_path, "decode")
    assert p.returncode != 0
    assert "CUDA" in p.stderr and "--tiny-cpu" in p.stderr
    assert not (tmp_path / "r.json").exists()


def test_gpu_cost_of_llama_8b_gives_the_device_readme_roofline():
    from benchmarks.gpu_cost import ModelCost, offline_bound
    from braid.runtime.models.config import ModelConfig

    cost = ModelCost.of(
        ModelConfig.from_dir(ROOT / "benchmarks/configs/llama-3.1-8b"), torch.bfloat16
    )
    # ../shared/device/README.md: 16.06 GB of weights, 4.23 TB/s copy -> 263 tokens/s.
    assert cost.weight_bytes == 16_060_522_496
    assert round(4.23e12 / cost.weight_bytes) == 263
    # One prompt of 1 token, 2 out: its prefill, then one decode step over 2 keys, which reads
    # every weight and 2 tokens of KV (memory-bound at these rates).
    bound = offline_bound(cost, 1, 1, 2, 1, bw=1e12, rate=1e15)
    step = (cost.weight_bytes + 2 * cost.kv_bytes_per_token) / 1e12
    assert bound["bound_s"] == pytest.approx(cost.forward_flops(1) / 1e15 + step)


def test_structured_runs_at_toy_size(tmp_path):
    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    model, _ = build_tiny_constrained_model(tmp_path / "tiny")
    out = tmp_path / "r.json"
    subprocess.run(
        [
            sys.executable,
            "benchmarks/structured.py",
            "--model",
            str(model),
            "--batch-sizes",
            "1,2",
            "--jump-batch-sizes",
            "1",
            "--jump-max-tokens",
            "40",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--repeats",
            "1",
            "--kv-tokens",
            "1024",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=400,
    )
    r = json.loads(out.read_text())
    assert [row["batch_size"] for row in r["decode"]] == [1, 2]
    (jump,) = r["jump_forward"]
    assert jump["steps_on"] < jump["steps_off"]  # the schema's long keys are forced
    assert r["compile"]["schemas"] == 15 and r["compile"]["cached_total_s"] < 0.1


def _smoke(tmp_path: Path, script: str, *args: str) -> dict:
    """benchmarks/`script` --smoke `args` under the interpreter (it must succeed): its JSON."""
    out = tmp_path / "smoke.json"
    subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--smoke", *args, "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    return json.loads(out.read_text())


def test_extend_tuning_sweep_runs_at_toy_size(tmp_path):
    """benchmarks/tune_extend.py (the H200 sweep) through the interpreter: each configuration
    is checked against the default's output, then timed."""
    result = _smoke(tmp_path, "tune_extend.py", "--repeats", "1", "--per-repeat", "1")
    assert [r["config"] for r in result["rows"]] == [[16, 16, 4, 1], [32, 16, 4, 2]]
    assert all(r["us"] > 0 and "error" not in r for r in result["rows"]), result["rows"]
    assert result["best"]["2x(5+20)"]["config"] in ([16, 16, 4, 1], [32, 16, 4, 2])


def test_overlap_probe_runs_at_toy_size_and_its_halves_are_the_full_batch(tmp_path):
    """benchmarks/overlap_probe.py (issue 21's two-stream question) through the interpreter:
    the two half-batches, each with its own requests' KV, give the full batch's output, and
    so does the lanes' pipeline (attention of one half beside the other's GEMMs) in the order
    it launches its kernels (its events are the GPU's: there the probe reports their error)."""
    result = _smoke(tmp_path, "overlap_probe.py", "--carveouts", "8")
    assert result["halves_error"] < 1e-5 and result["lanes_error"] < 1e-5
    times = ("attention_ms", "gemms_ms", "serial_ms", "halves_serial_ms", "two_streams_ms")
    assert all(result[t] > 0 for t in times + ("cublaslt_two_streams_ms", "serial_eager_ms"))
    assert list(result["carveout_ms"]) == ["8"] and result["carveout_ms"]["8"] > 0
    assert result["lanes"]["eager_ms"] > 0 and result["lanes"]["graph_ms"] > 0
    assert result["green"] == {}  # green contexts are a GPU's
    evict = result["evict_first"]  # the same with attention's K/V loads evict-first in L2
    assert evict["serial_ms"] > 0 and evict["lanes"]["eager_ms"] > 0 and evict["green"] == {}


def test_radix_lookup_matches_every_cached_token_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "benchmarks/radix_lookup.py", "--sequences", "12", "--system", "40"]
        + ["--repeats", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "radix_lookup" and r["sequences"] == 12
    # Each prompt extends a cached sequence: all of it matches, the shared prefix once cached.
    assert r["matched_tokens"] - r["cached_tokens"] == 40 * 11
    assert len(r["pass_ms"]) == 2 and r["ms_per_pass"] > 0


def test_tensor_parallel_script_runs_tp1_and_tp2_at_toy_size_on_cpu(tmp_path):
    """benchmarks/tensor_parallel.py's engine figures at tp=1 and tp=2 over gloo, each
    against one rank's share: half the weights, and the all-reduces measured first."""
    out = tmp_path / "tp.json"
    cmd = ["benchmarks/tensor_parallel.py", "engine", "--tiny-cpu"]
    cmd += ["--figures", "decode,prefill,offline", "--out", str(out)]
    p = subprocess.run(
        [sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    one, two = r["tp"]["1"], r["tp"]["2"]
    ar = r["allreduce_batch1"][0]
    assert (ar["hidden"], ar["rows"], ar["bytes"]) == (64, 1, 256) and ar["eager_us"] > 0
    w1, w2 = one["decode"]["tp_roofline"], two["decode"]["tp_roofline"]
    assert w1["allreduce_s"] == 0 and w2["allreduce_s"] == pytest.approx(4 * ar["eager_us"] * 1e-6)
    # tiny-llama's rank 1 of 2 holds half of every matrix; the 5 norms stay whole.
    assert w2["rank_weight_bytes"] == (w1["rank_weight_bytes"] + 4 * 5 * 64) // 2
    for fig in ("decode", "prefill", "offline"):
        ratio = two[fig]["braid_tok_s"] / one[fig]["braid_tok_s"]
        assert r["tp2_over_tp1"][fig] == pytest.approx(ratio)
    assert two["offline"]["bound"]["bound_s"] < one["offline"]["bound"]["bound_s"]


def test_gpu_cost_of_one_rank_is_its_share_of_the_model():
    from benchmarks.gpu_cost import ModelCost
    from braid.runtime.models.config import ModelConfig

    cfg = ModelConfig.from_dir(ROOT / "benchmarks/configs/llama-3.1-70b")
    whole, rank = ModelCost.of(cfg, torch.bfloat16), ModelCost.of(cfg, torch.bfloat16, 2)
    assert whole.weight_bytes == pytest.approx(141.1e9, rel=1e-3)  # Llama-3.1-70B: 70.55 B
    norms = 2 * (2 * 80 + 1) * 8192  # two per layer and the final one, bf16, on every rank
    assert rank.weight_bytes == (whole.weight_bytes + norms) // 2
    assert rank.kv_bytes_per_token * 2 == whole.kv_bytes_per_token
    assert rank.attn_flops_per_pair * 2 == whole.attn_flops_per_pair
    assert rank.lm_head_params * 2 == whole.lm_head_params
