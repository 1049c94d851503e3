"""GGUF blocks: each type's decoder bit for bit against gguf-py's dequantizers (the layouts),
the kernel planes exact, and `gguf_linear` against its dequantize-then-matmul reference (one
row: the split-K GEMV; several rows: a tl.dot per tile of groups, the weight rounded to x's
dtype; many rows: the weight written out (`dequantize_gguf`, exact in float32) then a matmul;
ragged N and K past the tile; bias; the K-quants' super-blocks across splits); argument
checks. On a GPU: Llama-3.1-8B shapes in bfloat16 for every type and row class, and
CUDA-graph capture."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from braid.kernels import gguf_gemm, gguf_linear
from braid.kernels.gguf_gemm import dequantize_gguf
from braid.kernels.gguf_reference import (
    BLOCK_LAYOUTS,
    decode,
    dequantize,
    dequantize_kernel_planes,
    gguf_linear_reference,
    kernel_planes,
    random_blocks,
)
from braid.kernels.quant_planar import DEQUANTIZE_MIN_ROWS
from tests.kernels.conftest import CPU_DTYPES

TYPES = list(BLOCK_LAYOUTS)


def _raw(qtype, n, k, seed=0, scale=0.02):
    return random_blocks(qtype, n, k, torch.Generator().manual_seed(seed), scale=scale)


@pytest.mark.parametrize("qtype", TYPES)
def test_decoders_equal_gguf_py_bit_for_bit(qtype):
    raw = _raw(qtype, 9, 512)
    want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype])
    assert torch.equal(dequantize(raw, qtype), torch.from_numpy(want))
    planes = kernel_planes(decode(raw, qtype), qtype)
    assert torch.equal(dequantize_kernel_planes(planes), torch.from_numpy(want))
    # The K-quants hold their sub-blocks' integer scales and their super-blocks' float16 d,
    # as the file does; the others a float16 scale per 32.
    k_quant = qtype.endswith("_K")
    assert planes.scale.dtype == (
        {"Q4_K": torch.uint8, "Q6_K": torch.int8}.get(qtype, torch.float16)
    )
    assert (planes.super_scale is not None) == k_quant
    # Bits a weight in memory: 4-bit codes or bytes, then the planes: Q4_0's and Q6_K's offsets
    # are zero points, Q8_0 has none; Q4_K: 8-bit scales and mins per 32, d and dmin per 256.
    held = sum(t.numel() * t.element_size() for t in planes.tensors().values())
    bits = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q4_K": 4.625, "Q6_K": 8.5625}[qtype]
    assert held * 8 == bits * raw.shape[0] * 512


def test_a_block_with_a_non_finite_scale_keeps_its_weights():
    # A broken block (d inf or NaN) loads as the weights it decodes to, as the float path's.
    raw = _raw("Q8_0", 2, 64)
    raw[0, 0:2] = torch.tensor([float("inf")]).half().view(torch.uint8)
    planes = kernel_planes(decode(raw, "Q8_0"), "Q8_0")
    want = dequantize(raw, "Q8_0")
    got = dequantize_kernel_planes(planes)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
        got.nan_to_num(), want.nan_to_num()
    )


def test_gguf_py_quantized_blocks_decode_to_its_values():
    w = torch.randn(16, 64).numpy()
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        t = gguf.GGMLQuantizationType[qtype]
        raw = torch.from_numpy(gguf.quants.quantize(w, t))
        assert torch.equal(
            dequantize(raw, qtype), torch.from_numpy(gguf.quants.dequantize(raw.numpy(), t))
        )


def _close(got, want):
    rtol, atol = {torch.float32: (1e-5, 1e-4), torch.float16: (2**-10, 2e-3)}[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 20, DEQUANTIZE_MIN_ROWS])
def test_gguf_linear_matches_reference(device, qtype, dtype, m):
    # N = 40: a ragged last tile; K = 96: not a whole number of 64-wide tiles. The K-quants'
    # 1024: four super-blocks, two in each of the interpreter's two splits (a super-block
    # index taken from the split's start, not the tile's, fails here).
    k = 1024 if qtype.endswith("_K") else 96
    scale = 0.02 / 24 if qtype.endswith("_K") else 0.02
    planes = kernel_planes(decode(_raw(qtype, 40, k, scale=scale), qtype), qtype)
    planes = planes.to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    bias = torch.randn(40, generator=g).to(device=device, dtype=dtype)
    _close(gguf_linear(x, planes, bias), gguf_linear_reference(x, planes, bias))
    _close(gguf_linear(x, planes), gguf_linear_reference(x, planes))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [3, 20])
@pytest.mark.parametrize("setting", [("SWAP", True), ("BLOCK_M", 32)])
def test_gguf_linear_in_other_launch_shapes_matches_reference(
    device, qtype, dtype, m, setting, monkeypatch
):
    # The several-row kernel under the interpreter with the weights as the dot's left operand
    # (SWAP), and in blocks of 32 rows, where Q4_0 / Q4_1 take each word's factors instead of
    # spreading each group's (on a GPU every launch shape runs in
    # test_every_several_row_launch_shape_matches_reference).
    monkeypatch.setitem(gguf_gemm.INTERPRET_ROWS, *setting)
    test_gguf_linear_matches_reference(device, qtype, dtype, m)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_gguf_writes_the_exact_weights(device, qtype):
    # N = 40 and K = 96 (1024 for the K-quants): ragged tiles both ways.
    k = 1024 if qtype.endswith("_K") else 96
    planes = kernel_planes(decode(_raw(qtype, 40, k), qtype), qtype)
    want = dequantize_kernel_planes(planes)
    planes = planes.to(device)
    assert torch.equal(dequantize_gguf(planes, k, torch.float32).cpu(), want)
    assert torch.equal(dequantize_gguf(planes, k, torch.float16).cpu(), want.half())


def test_gguf_linear_checks_its_arguments(device):
    planes = kernel_planes(decode(_raw("Q4_0", 16, 64), "Q4_0"), "Q4_0")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="planes.codes must have shape"):
        gguf_linear(torch.randn(2, 96), planes)
    planes.bits = 6
    with pytest.raises(ValueError, match="planes.bits must be 4 or 8"):
        gguf_linear(x, planes)
    planes.bits, planes.group_size = 4, 24
    with pytest.raises(ValueError, match="group_size must be 16 or 32"):
        gguf_linear(x, planes)
    planes.group_size = 32
    with pytest.raises(ValueError, match="bias must have shape"):
        gguf_linear(x, planes, torch.randn(8))
    # The K-quants' integer scales come with their super-blocks' factors, and K whole
    # super-blocks.
    kq = kernel_planes(decode(_raw("Q4_K", 16, 256), "Q4_K"), "Q4_K")
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="planes.super_offset must be given exactly"):
        gguf_linear(x, dataclasses.replace(kq, super_offset=None))
    q6 = kernel_planes(decode(_raw("Q6_K", 16, 256), "Q6_K"), "Q6_K")
    with pytest.raises(ValueError, match="planes.super_offset must be given exactly"):
        gguf_linear(x, dataclasses.replace(q6, super_offset=kq.super_offset))
    with pytest.raises(
        ValueError, match=r"planes.scale must be one of \(float16\), got torch.uint8"
    ):
        gguf_linear(x, dataclasses.replace(kq, super_scale=None, super_offset=None))
    with pytest.raises(ValueError, match="planes.super_scale must be one of"):
        gguf_linear(x, dataclasses.replace(kq, super_scale=kq.super_scale.float()))
    with pytest.raises(ValueError, match="planes.super_scale must have shape"):
        gguf_linear(x, dataclasses.replace(kq, super_scale=kq.super_scale.repeat(2, 1)))
    half = dataclasses.replace(
        kq,
        codes=kq.codes[:, :16].contiguous(),
        scale=kq.scale[:4].contiguous(),
        offset=kq.offset[:4].contiguous(),
    )
    with pytest.raises(ValueError, match="need K a multiple of 256, got 128"):
        gguf_linear(torch.randn(2, 128), half)


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
def test_gguf_linear_on_llama_8b_shapes(qtype, m):
    dev = torch.device("cuda")
    for n, k in [(6144, 4096), (4096, 14336)]:
        scale = 0.02 / 24 if qtype.endswith("_K") else 0.02
        planes = kernel_planes(decode(_raw(qtype, n, k, scale=scale), qtype), qtype).to(dev)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        got, want = gguf_linear(x, planes), gguf_linear_reference(x, planes)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_every_several_row_launch_shape_matches_reference(qtype):
    """Each of `SHAPES`' launch shapes run as it is (the autotuner keeps one per shape, so
    the others would go untested), at rows of its class, ragged N."""
    dev = torch.device("cuda")
    n, k = 4096 + 48, 4096
    scale = 0.02 / 24 if qtype.endswith("_K") else 0.02
    planes = kernel_planes(decode(_raw(qtype, n, k, scale=scale), qtype), qtype).to(dev)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    for rows, shapes in gguf_gemm.SHAPES.items():
        x = torch.randn({16: 9, 64: 40, 128: 100}[rows], k, device=dev, dtype=torch.bfloat16)
        want = gguf_linear_reference(x, planes, bias).float()
        for shape in shapes:
            cfg = gguf_gemm._config(*shape)
            meta = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": 1}
            out = torch.empty(x.shape[0], n, device=dev, dtype=x.dtype)
            gguf_gemm._launch_rows(gguf_gemm._gguf_kernel, x, planes, bias, out, meta)
            torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2e-2, msg=str(shape))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gguf_linear_is_captured_in_a_cuda_graph(m):
    dev = torch.device("cuda")
    planes = kernel_planes(decode(_raw("Q4_1", 4096, 4096), "Q4_1"), "Q4_1").to(dev)
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    out = gguf_linear(x, planes)  # tunes eagerly first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gguf_linear(x, planes, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(
        out.float(), gguf_linear_reference(x, planes).float(), rtol=2**-7, atol=2e-2
    )
