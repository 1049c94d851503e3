"""The quantized-weight kernels against their dequantize-then-matmul references: `int4_linear`
(one row: the multiply-add form; several rows and many: tl.dot, with ragged N and row blocks,
group sizes from 16 to K, bias), `int8_linear` (ragged K), `per_token_quant_fp8` bit for bit
(rounding ties, subnormals, the 448 clamp, zero rows, strided rows); argument checks. On a GPU:
Llama-3.1-8B shapes in bfloat16 for every row class, CUDA-graph capture, and the fp8 layer
(`torch._scaled_mm`) against its reference."""

from __future__ import annotations

import pytest
import torch

from braid.kernels import int4_linear, int8_linear, per_token_quant_fp8
from braid.kernels.quant_reference import (
    FP8_MAX,
    int4_linear_reference,
    int8_linear_reference,
    pack_int4,
    per_token_quant_fp8_reference,
)
from tests.kernels.conftest import CPU_DTYPES


def _int4(n, k, group, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    # Zeros up to 16 (GPTQ's v1 checkpoints can hold one); scales ~ 1 / sqrt(K) so outputs
    # are O(1) at any K.
    zeros = torch.randint(0, 17, (k // group, n), generator=g).to(torch.uint8)
    scales = (torch.rand(k // group, n, generator=g) + 0.5) / (4 * k**0.5)
    return (
        pack_int4(codes).to(device),
        scales.to(device=device, dtype=dtype),
        zeros.to(device),
    )


def _x(m, k, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(device=device, dtype=dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Both sum in float32 (in different orders) and round once: float32 is off by
    summation order only, a 16-bit result by at most a unit in the last place."""
    rtol, atol = {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (2**-10, 1e-3),
        torch.bfloat16: (2**-7, 1e-2),
    }[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# ---- CPU (interpreter) or GPU, small shapes ---------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 37])  # one row; a few; several row blocks
@pytest.mark.parametrize("n,k,group", [(40, 128, 32), (24, 96, 48), (16, 64, 64)])
def test_int4_matches_the_dequantized_matmul(device, dtype, m, n, k, group):
    qweight, scales, zeros = _int4(n, k, group, dtype, device)
    x = _x(m, k, dtype, device)
    got = int4_linear(x, qweight, scales, zeros, group)
    _close(got, int4_linear_reference(x, qweight, scales, zeros, group))
    assert got.is_contiguous() and got.device == x.device


@pytest.mark.parametrize("m", [1, 5])
def test_int4_bias_is_added_before_the_single_rounding(device, m):
    dtype = torch.float16
    qweight, scales, zeros = _int4(24, 64, 32, dtype, device)
    x, b = _x(m, 64, dtype, device), _x(24, 1, dtype, device).reshape(24)
    got = int4_linear(x, qweight, scales, zeros, 32, b)
    _close(got, int4_linear_reference(x, qweight, scales, zeros, 32, b))
    assert not torch.allclose(got, int4_linear(x, qweight, scales, zeros, 32))


def test_int4_each_group_uses_its_own_scale_and_zero(device):
    # A kernel applying one group's scale or zero to the next fails this: only the last group
    # of inputs is nonzero, so its scale and zero alone make the result.
    qweight, scales, zeros = _int4(16, 64, 16, torch.float32, device)
    x = torch.zeros(2, 64, device=device)
    x[:, 48:] = 1.0
    scales[:3] = 1000.0
    zeros[:3] = 0
    _close(
        int4_linear(x, qweight, scales, zeros, 16),
        int4_linear_reference(x, qweight, scales, zeros, 16),
    )
    assert int4_linear(x, qweight, scales, zeros, 16).abs().max() < 100


def test_int4_strided_rows_and_out(device):
    qweight, scales, zeros = _int4(16, 64, 32, torch.float32, device)
    wide = _x(4, 80, torch.float32, device)
    x = wide[:, :64]
    out_wide = torch.full((4, 24), 7.0, device=device)
    out = out_wide[:, 4:20]
    got = int4_linear(x, qweight, scales, zeros, 32, out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(got, int4_linear_reference(x, qweight, scales, zeros, 32))
    assert (out_wide[:, :4] == 7).all() and (out_wide[:, 20:] == 7).all()


def test_int4_refuses_bad_arguments_naming_them(device):
    qweight, scales, zeros = _int4(16, 64, 32, torch.float32, device)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="group_size 48 must be a multiple of 16 that divides K"):
        int4_linear(x, qweight, scales, zeros, 48)
    with pytest.raises(ValueError, match=r"qweight must have shape \(16, 4\), got \(16, 8\)"):
        int4_linear(x[:, :32], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="zeros must be one of"):
        int4_linear(x, qweight, scales, zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match="qweight must be one of"):
        int4_linear(x, qweight.to(torch.int64), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 16\)"):
        int4_linear(x, qweight, scales.T.contiguous(), zeros, 32)
    with pytest.raises(ValueError, match="bias dtype"):
        int4_linear(
            x, qweight, scales, zeros, 32, torch.zeros(16, dtype=torch.float16, device=device)
        )


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("n,k", [(40, 200), (16, 64)])  # a ragged K tail; whole blocks
def test_int8_matches_the_dequantized_matmul(device, dtype, m, n, k):
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    scales = ((torch.rand(n, generator=g) + 0.5) / (64 * k**0.5)).to(device=device, dtype=dtype)
    x, b = _x(m, k, dtype, device), _x(n, 1, dtype, device).reshape(n)
    _close(int8_linear(x, w, scales), int8_linear_reference(x, w, scales))
    _close(int8_linear(x, w, scales, b), int8_linear_reference(x, w, scales, b))


def test_int8_refuses_bad_arguments_naming_them(device):
    w = torch.zeros(16, 64, dtype=torch.int8, device=device)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="weight has 64 columns, x has 32"):
        int8_linear(x[:, :32], w, torch.ones(16, device=device))
    with pytest.raises(ValueError, match=r"scales must have shape \(16,\)"):
        int8_linear(x, w, torch.ones(8, device=device))
    with pytest.raises(ValueError, match="weight must be one of"):
        int8_linear(x, w.to(torch.uint8), torch.ones(16, device=device))


def _codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fp8_quantization_is_the_references_bit_for_bit(device):
    # Row scale 1 (each row holds 448): every value rounds at its own e4m3 grid, across the
    # whole normal range, the subnormals near zero and the ties between grid points.
    grid = torch.linspace(-FP8_MAX, FP8_MAX, 9001)
    tiny = torch.linspace(-0.02, 0.02, 9001)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    rows = [torch.cat([torch.tensor([FP8_MAX]), v]) for v in (grid, tiny, ties)]
    width = max(len(r) for r in rows)
    x = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    x = torch.cat([x, torch.zeros(1, width), torch.randn(3, width) * 1e-3]).to(device)
    codes, scales = per_token_quant_fp8(x)
    want_codes, want_scales = per_token_quant_fp8_reference(x)
    assert _codes_equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert scales.shape == (x.shape[0], 1) and (codes[3].float() == 0).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fp8_quantization_of_strided_rows(device, dtype):
    wide = (torch.randn(5, 300) * 20).to(device=device, dtype=dtype)
    x = wide[:, 7:263]
    codes, scales = per_token_quant_fp8(x)
    want_codes, want_scales = per_token_quant_fp8_reference(x)
    assert _codes_equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert codes.is_contiguous()


# ---- GPU ----------------------------------------------------------------------------------------

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 48, 512])
@pytest.mark.parametrize("shape", list(LLAMA_8B))
def test_gpu_llama_8b_shapes_in_bf16(m, shape):
    n, k = LLAMA_8B[shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    qweight, scales, zeros = _int4(n, k, 128, dt, dev)
    x = _x(m, k, dt, dev)
    _close(
        int4_linear(x, qweight, scales, zeros, 128),
        int4_linear_reference(x, qweight, scales, zeros, 128),
    )
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    s = torch.rand(n, device=dev, dtype=dt) / (64 * k**0.5)
    _close(int8_linear(x, w, s), int8_linear_reference(x, w, s))


@pytest.mark.gpu
def test_gpu_int4_and_int8_replay_in_a_cuda_graph():
    dev, dt = torch.device("cuda"), torch.bfloat16
    n, k = 4096, 4096
    qweight, scales, zeros = _int4(n, k, 128, dt, dev)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    s = torch.rand(n, device=dev, dtype=dt) / 1000
    x = _x(1, k, dt, dev)
    out4, out8 = int4_linear(x, qweight, scales, zeros, 128), int8_linear(x, w, s)  # tune first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_linear(x, qweight, scales, zeros, 128, out=out4)
        int8_linear(x, w, s, out=out8)
    x.copy_(_x(1, k, dt, dev, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    _close(out4, int4_linear_reference(x, qweight, scales, zeros, 128))
    _close(out8, int8_linear_reference(x, w, s))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 300])
def test_gpu_fp8_layer_matches_its_reference(m):
    from braid.runtime.quantization.base import LinearSpec
    from braid.runtime.quantization.fp8 import Fp8LinearMethod

    dev = torch.device("cuda")
    spec = LinearSpec("fp8_layer", 4096, {None: (0, 6144)}, torch.bfloat16, dev)
    method = Fp8LinearMethod(spec, online=True)
    (placeholder,) = method.create_weights().values()
    placeholder.weight_loader(placeholder, torch.randn(6144, 4096, device=dev) * 0.02, None)
    method.finish_loading()
    x = _x(m, 4096, torch.bfloat16, dev)
    bias = _x(6144, 1, torch.bfloat16, dev).reshape(-1)
    _close(method.apply(x, bias), method.reference(x, bias))
    codes, scales = per_token_quant_fp8(x)
    want_codes, want_scales = per_token_quant_fp8_reference(x)
    assert _codes_equal(codes, want_codes) and torch.equal(scales, want_scales)
