"""The CPU linear's oneDNN path: its primitive caches are bounded before first use (an
unbounded default let a server's RSS grow with every new token count: docs/benchmarks.md,
Soak), and the environment still wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from braid.runtime.layers.linear import ONEDNN_CACHE_ENTRIES

VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
PROBE = f"""
VARS = {VARS!r}
import json, os, torch
from braid.runtime.layers.linear import Linear
lin = Linear(8, {{None: 4}}, bias=False, dtype=torch.float32)
lin.weight.data.normal_()
x = torch.randn(3, 8)
ok = torch.allclose(lin(x), x @ lin.weight.T, atol=1e-5)
print(json.dumps({{"fn": lin._linear.__name__, "ok": ok,
                  "env": {{v: os.environ.get(v) for v in VARS}}}}))
"""


def _probe(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in VARS}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_onednn_linear_bounds_its_primitive_caches():
    got = _probe({})
    assert got["fn"] == "_onednn_linear" and got["ok"]
    assert got["env"] == {v: str(ONEDNN_CACHE_ENTRIES) for v in VARS}


def test_environment_sets_the_cache_size_when_given():
    got = _probe({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"})
    assert got["ok"]
    assert got["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "256"}
