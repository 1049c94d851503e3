"""The agent-traffic benchmark (benchmarks/agents.py) at toy size: every setup runs every
program to its end and the comparison is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(tmp_path: Path, *args: str) -> dict:
    """Run the benchmark at one rate (50 programs/s) on an 8192-token pool, its tool calls a
    tenth as long; its JSON."""
    out = tmp_path / "agents.json"
    cmd = [sys.executable, *args, "--rates", "50", "--kv-tokens", "8192", "--out", str(out)]
    cmd += ["--tool-scale", "0.1"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_agent_traffic_runs_every_setup(tmp_path):
    model, _ = build_tiny_constrained_model(tmp_path / "tiny")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # a ReAct program's context outgrows 512
    (model / "config.json").write_text(json.dumps(config))
    res = _run(
        tmp_path,
        "benchmarks/programs.py",
        "--agent-traffic",
        "--model",
        str(model),
        "--programs",
        "3",
        "--mix",
        "heavy",
    )
    assert res["mix"] == "heavy" and len(res["unloaded_times_s"]) == 3
    assert res["unloaded_p99_s"] >= res["unloaded_s"] > 0
    assert set(res["setups"]) == {
        *("fcfs", "lpm", "program", "program+pins", "program-srpt", "program-srpt+pins")
    }
    for name, row in res["setups"].items():
        assert row["programs"] == 3, name
        assert 0 < row["p50_s"] <= row["p99_s"], (name, row)
        assert row["prefill_tokens_computed"] > 0, (name, row)
        assert len(row["completion_s"]) == 3
        assert max(row["completion_s"]) == pytest.approx(row["p99_s"], abs=0.01)
    assert res["setups"]["lpm"]["p50_vs_lpm"] == 1.0
    assert res["unloaded_s"] > 0 and res["lpm_sweep"][0]["rate"] == 50.0
    assert res["tool_scale"] == 0.1


def test_agent_traffic_runs_on_a_configs_shapes_with_random_weights(tmp_path):
    """The H200 run's path (`--gpu-config`: a config's shapes, random bf16 weights, SmolLM2's
    tokenizer) at toy size on the CPU, two setups chosen, each run twice (`--repeats`)."""
    res = _run(
        tmp_path,
        "benchmarks/agents.py",
        *("--gpu-config", "tiny-llama", "--programs", "2", "--setups", "program+pins"),
        *("--repeats", "2"),
    )
    assert res["config"] == "tiny-llama" and res["device"] == "cpu" and res["mix"] == "uniform"
    assert set(res["setups"]) == {"lpm", "program+pins"}  # lpm always: the baseline
    assert res["repeats"] == 2
    for name, row in res["setups"].items():
        assert row["programs"] == 2 and row["prefill_tokens_computed"] > 0, (name, row)
        p50s = row["p50_rounds_s"]
        assert len(p50s) == 2 and row["p50_s"] == pytest.approx(sum(p50s) / 2), (name, row)
        assert len(row["p50_vs_lpm_rounds"]) == 2 and len(row["completion_s_rounds"]) == 2
    assert res["setups"]["lpm"]["p50_vs_lpm_rounds"] == [1.0, 1.0]


def test_the_heavy_mix_gives_each_program_its_own_thought_length():
    import agents

    uniform = agents.workload(256, 4.0, seed=0)
    heavy = agents.workload(256, 4.0, seed=0, mix="heavy")
    assert all("thought_tokens" not in args for _, args in uniform)
    lengths = sorted(args["thought_tokens"] for _, args in heavy)
    assert agents.HEAVY_MIN <= lengths[0] and lengths[-1] <= agents.HEAVY_MAX
    # Heavy-tailed: most programs think briefly, a few at the cap.
    assert lengths[len(lengths) // 2] < 3 * agents.HEAVY_MIN and lengths[-3] == agents.HEAVY_MAX
    # Arrival times follow the rate alone: the same programs at every rate.
    slower = agents.workload(256, 2.0, seed=0, mix="heavy")
    assert [a for _, a in slower] == [a for _, a in heavy]
    assert slower[-1][0] > heavy[-1][0]
    # A smoke run's shorter tool calls: the same programs, each wait scaled.
    scaled = agents.workload(256, 4.0, seed=0, mix="heavy", tool_scale=0.1)
    for (at, a), (at_s, b) in zip(heavy, scaled):
        assert at == at_s and a["task"] == b["task"]
        assert b["tools_ms"] == [round(ms * 0.1) for ms in a["tools_ms"]]
    with pytest.raises(ValueError, match="unknown mix 'long'"):
        agents.workload(4, 1.0, seed=0, mix="long")


def test_rounds_are_summed_up_over_the_figures_every_round_has():
    import agents

    # A round shorter than the sampler's second has no running / queued means (a test run
    # under load once failed with a KeyError here).
    long = {"p50_s": 2.0, "running_requests_mean": 3.0, "completion_s": [1.0, 3.0]}
    short = {"p50_s": 4.0, "completion_s": [2.0, 6.0]}
    third = {"p50_s": 3.0, "running_requests_mean": 5.0, "completion_s": [3.0]}
    row = agents._median_row([long, short, third])
    assert row["p50_s"] == 3.0 and "running_requests_mean" not in row
    assert row["p50_rounds_s"] == [2.0, 4.0, 3.0]
    assert row["completion_s_rounds"] == [[1.0, 3.0], [2.0, 6.0], [3.0]]
    assert agents._median_row([long, third])["running_requests_mean"] == 4.0
