"""Programmatic dependent launch (`braid/kernels/pdl.py`): the one-row GEMVs built with it wait
for the kernel before them before any global load, store or atomic (after their L2
prefetches), and the kernels before them trigger ahead of their first load: checked in the
sm_90 machine code that Triton's own ptxas builds here (`benchmarks/sass_counts.py --kernels
pdl`, in a process without the interpreter). On a GPU of capability 9.0 or later: a chain of
norms, int4 GEMVs and bf16 skinny GEMMs captured in a CUDA graph with PDL gives the bits the
same chain gives without it, eagerly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from braid.kernels import pdl
from tests.kernels.conftest import HAS_CUDA

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def orders(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pdl") / "pdl.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, "benchmarks/sass_counts.py", "--kernels", "pdl", "--out", str(out)],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}


GEMVS = ["int4 float32", "int4 f16x2", "int4 f16x2 rmsnorm+residual", "fp8 dot", "fp8", "int8"]
GEMVS += ["skinny rmsnorm+residual", "skinny"]


@pytest.mark.skipif(HAS_CUDA, reason="the sm_90 build check is the CPU machine's")
@pytest.mark.parametrize("kernel", GEMVS)
def test_a_gemv_built_for_pdl_prefetches_then_waits_before_touching_memory(orders, kernel):
    on, off = orders[f"{kernel} pdl=True"], orders[f"{kernel} pdl=False"]
    assert on["waits"] == 1 and on["branches_past_wait"] == 0
    assert on["prefetches_before_wait"] > 0
    assert on["memory_before_wait"] == []
    assert on["wait_at"] < on["first_memory_at"]
    # The bf16 skinny GEMM lets the projection after it start, once it has waited itself.
    if kernel.startswith("skinny"):
        assert on["triggers"] == 1 and on["trigger_at"] > on["wait_at"]
    # Built without PDL: no wait, no prefetch, no trigger.
    assert off["waits"] == 0 and off["prefetches_before_wait"] == 0 and off["triggers"] == 0


@pytest.mark.skipif(HAS_CUDA, reason="the sm_90 build check is the CPU machine's")
@pytest.mark.parametrize("kernel", ["rmsnorm", "silu_and_mul", "decode_stage2"])
def test_the_kernels_before_a_gemv_trigger_ahead_of_their_first_load(orders, kernel):
    row = orders[f"{kernel} trigger=True"]
    assert row["triggers"] == 1 and row["waits"] == 0
    assert row["trigger_at"] < row["first_memory_at"]


def test_pdl_is_off_on_the_cpu_and_braid_pdl_names_the_kernels_that_use_it(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"), "fp8")
    monkeypatch.delenv("BRAID_PDL", raising=False)
    assert pdl.kinds() == pdl.DEFAULT_KINDS
    monkeypatch.setenv("BRAID_PDL", "0")
    assert pdl.kinds() == frozenset()
    assert not pdl.enabled(torch.device("cuda", 0), "fp8")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("BRAID_PDL", "all")
    assert pdl.kinds() == frozenset(pdl.KINDS)
    monkeypatch.setenv("BRAID_PDL", "int4, skinny")
    assert pdl.kinds() == {"int4", "skinny"}
    monkeypatch.setenv("BRAID_PDL", "int4,int2")
    with pytest.raises(ValueError, match="int2"):
        pdl.kinds()


@pytest.mark.gpu
def test_gpu_a_norm_and_gemv_chain_in_a_cuda_graph_gives_the_eager_bits_without_pdl(monkeypatch):
    from braid.kernels.int4_gemv import int4_gemv
    from braid.kernels.norm import rmsnorm
    from braid.kernels.quant_gemv import GemvConfig, GemvWorkspace
    from braid.kernels.quant_reference import pack_int4, pack_int4_meta, pack_int4_planar
    from braid.kernels.skinny_gemm import skinny_linear

    dev, dt = torch.device("cuda"), torch.bfloat16
    monkeypatch.setenv("BRAID_PDL", "all")
    if not pdl.enabled(dev):
        pytest.skip("PDL needs a GPU of capability 9.0 or later")
    n = k = 4096
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(6):
        q = pack_int4_planar(pack_int4(torch.randint(0, 16, (n, k), generator=g))).to(dev)
        scales = ((torch.rand(k // 128, n, generator=g) + 0.5) / (4 * k**0.5)).half()
        zeros = torch.randint(0, 17, (k // 128, n), generator=g).to(torch.uint8)
        layers.append((q, pack_int4_meta(scales, zeros).to(dev)))
    weight = (torch.rand(k, generator=g) + 0.5).to(dev, dt)
    dense = (torch.randn(n, n, generator=g) / n**0.5).to(dev, dt)
    configs = [GemvConfig(256, 128, 16, 4, 2, packed=True), GemvConfig(128, 256, 8, 4, 3)]
    ws = GemvWorkspace(dev, 16 * n, n)

    def chain(h, residual, outs):
        for i, (q, meta) in enumerate(layers):
            normed, residual = rmsnorm(h, weight, 1e-5, residual)
            h = int4_gemv(normed, q, meta, 128, config=configs[i % 2], workspace=ws)
            # bf16's skinny GEMM, fused norm and plain: both wait, then trigger.
            h = skinny_linear(h, dense, norm_weight=weight, eps=1e-5)
            h = skinny_linear(h, dense, out=outs[i])
        return h

    h0 = torch.randn(1, k, generator=g).to(dev, dt)
    r0 = torch.randn(1, k, generator=g).to(dev, dt)
    outs = [torch.empty(1, n, device=dev, dtype=dt) for _ in layers]
    chain(h0, r0, outs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h0, r0, outs)
    monkeypatch.setenv("BRAID_PDL", "0")
    for seed in (1, 2, 3):
        h0.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(dev, dt))
        graph.replay()
        torch.cuda.synchronize()
        want = chain(h0, r0, [torch.empty_like(o) for o in outs])
        assert torch.equal(outs[-1], want)
    assert (ws.counters == 0).all()
