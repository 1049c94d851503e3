"""benchmarks/attention_backends.py runs at toy size on the CPU (Triton's interpreter, no
FlashInfer), so the H200 command does not rot unseen: the pool it builds (shuffled pages, page
sizes 1 and 16) gives the Triton backend the output `torch_native` computes, for decode and for
an extend with a cached prefix, and every case is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.attention_backends import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's")
def test_smoke_run_times_triton_and_matches_torch_native(tmp_path):
    out = tmp_path / "a.json"
    p = subprocess.run(
        [sys.executable, "benchmarks/attention_backends.py", "bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert {(c["backend"], c["mode"]) for c in cases} == {
        ("triton", "decode"),
        ("triton", "extend"),
    }
    for c in cases:
        assert c["error"] is None, c
        assert c["eager_us"] > 0 and c["plan_us"] > 0
        assert c["max_abs_err"] < 2e-2, c


@pytest.mark.parametrize("page_size", [1, 16])
def test_each_request_owns_whole_pages_in_position_order(page_size):
    pool, table, fb, (q, k, v) = build(3, 37, 5, page_size, torch.float32, torch.device("cpu"))
    slots = table.table[fb.req_pool_indices, :42]
    assert torch.equal(slots % page_size, torch.arange(42).repeat(3, 1) % page_size)
    pages = slots // page_size
    assert len(set(pages.flatten().tolist())) == 3 * -(-42 // page_size)  # no page shared
    assert bool((slots >= page_size).all())  # page 0 is the padding page
    assert torch.equal(fb.out_cache_loc, slots[:, 37:].reshape(-1))
    assert q.shape == (15, 32, 128) and k.shape == v.shape == (15, 8, 128)
