"""skinny_linear against its float32 reference: tails of N and K, bias, strided rows, `out=`,
argument checks; the fused `silu_and_mul` activation against the reference and the two-kernel
path, with the activation's rounding checked bit for bit; the fused RMSNorm prologue (with and
without the residual add) against `rmsnorm` then the matmul, with the norm's rounding and the
new residual checked bit for bit; the Llama MLP's choice of path. On a GPU, Llama-3.1-8B shapes,
CUDA-graph capture, and a tiny bf16 Llama's greedy tokens with the fused MLP equal to those
without it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from braid.kernels import rmsnorm, silu_and_mul, skinny_linear
from braid.kernels.reference import silu_and_mul_reference
from braid.kernels.skinny_gemm import MAX_ROWS, skinny_linear_reference
from braid.runtime.layers.fusion import (
    FUSED_MLP_MAX_ROWS,
    select_one_row_forward,
    select_silu_mul_down,
    silu_mul_down,
)
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.llama import LlamaMLP
from tests.kernels.conftest import CPU_DTYPES


def _inputs(m, n, k, dtype, device, *, bias=False, seed=0):
    """Weights scaled by 1/sqrt(K) so outputs are O(1) at any K: then a rounding flip of the
    output dtype, not the size of the sum, is what the tolerance has to cover."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    return x, w, b


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Kernel and reference both sum in float32 (in different orders) and round once, so a
    16-bit result is at most one unit in the last place off: relative 2**-7 (bfloat16),
    2**-10 (float16). float32: summation-order error only."""
    rtol, atol = {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (2**-10, 1e-4),
        torch.bfloat16: (2**-7, 1e-3),
    }[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# ---- CPU (interpreter) or GPU, small shapes ---------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(72, 200), (32, 128)])  # ragged tails; then whole blocks
def test_matches_reference_for_ragged_and_whole_blocks(device, dtype, m, n, k):
    x, w, _ = _inputs(m, n, k, dtype, device, seed=m)
    x0, w0 = x.clone(), w.clone()
    got = skinny_linear(x, w)
    _close(got, skinny_linear_reference(x, w))
    assert got.is_contiguous() and got.device == x.device
    assert torch.equal(x, x0) and torch.equal(w, w0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_bias_is_added_before_the_single_rounding(device, dtype):
    x, w, b = _inputs(5, 40, 70, dtype, device, bias=True)
    _close(skinny_linear(x, w, b), skinny_linear_reference(x, w, b))
    # The bias really is added: without it the result is not the same.
    assert not torch.allclose(skinny_linear(x, w).float(), skinny_linear(x, w, b).float())


def test_strided_rows_and_out_are_honoured(device):
    x_wide, w, b = _inputs(4, 24, 96, torch.float32, device, bias=True)
    x = x_wide[:, :80]  # row stride 96, unit stride in K
    w = w[:, :80].contiguous()
    out_wide = torch.full((4, 40), 7.0, device=device)
    out = out_wide[:, 8:32]  # row stride 40
    got = skinny_linear(x, w, b, out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(out, skinny_linear_reference(x, w, b))
    assert (out_wide[:, :8] == 7).all() and (out_wide[:, 32:] == 7).all()  # nothing outside


def test_matches_f_linear_in_float32(device):
    x, w, b = _inputs(MAX_ROWS, 48, 333, torch.float32, device, bias=True)
    _close(skinny_linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_bad_arguments_raise_value_error_naming_them(device):
    x, w, b = _inputs(2, 24, 32, torch.float32, device, bias=True)
    cases = [
        ((x[0], w), "x must have 2 dimensions"),
        ((x[None], w), "x must have 2 dimensions"),
        ((x[:0], w), "x must have 1..16 rows"),
        ((torch.randn(MAX_ROWS + 1, 32, device=device), w), "x must have 1..16 rows"),
        ((x.int(), w), "x must be one of"),
        ((torch.randn(32, 2, device=device).t(), w), "x must have unit stride"),
        ((x, w[:, :16].contiguous()), "weight has 16 columns, x has 32"),
        ((x, w.half()), "weight dtype"),
        ((x, w.to("meta")), "weight is on meta"),
        ((x, torch.randn(32, 24, device=device).t()), "weight must have unit stride"),
        ((x, torch.randn(24, 64, device=device)[:, :32]), "weight must be contiguous"),
        ((x, w, b[:8]), "bias must have shape"),
        ((x, w, b.half()), "bias dtype"),
        ((x, w, b[None]), "bias must have 1 dimensions"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_linear(*args)
    with pytest.raises(ValueError, match="out must have shape"):
        skinny_linear(x, w, out=torch.empty(2, 23, device=device))
    with pytest.raises(ValueError, match="out must be one of"):
        skinny_linear(x, w, out=torch.empty(2, 24, device=device, dtype=torch.float16))


# ---- the fused activation: x = [gate | up] ----------------------------------------------------


def _fused_inputs(m, n, k, dtype, device, *, bias=False, seed=0):
    """x = [gate | up] of 2K standard-normal columns; weight [N, K] and bias as `_inputs`."""
    x, _, b = _inputs(m, n, 2 * k, dtype, device, bias=bias, seed=seed)
    _, w, _ = _inputs(1, n, k, dtype, device, seed=seed + 1)
    return x, w, b


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 5])  # the one-row multiply-add form; the tl.dot form
@pytest.mark.parametrize("n,k", [(72, 200), (32, 128)])  # gate/up split off the block grid; on it
def test_fused_silu_and_mul_matches_reference_and_the_two_kernel_path(device, dtype, m, n, k):
    x, w, b = _fused_inputs(m, n, k, dtype, device, bias=True, seed=m + k)
    x0 = x.clone()
    got = skinny_linear(x, w, b, activation="silu_and_mul")
    assert got.shape == (m, n) and got.is_contiguous() and torch.equal(x, x0)
    _close(got, skinny_linear_reference(x, w, b, activation="silu_and_mul"))
    # The runtime's torch path: silu_and_mul_reference in x's dtype, then the matmul (float32
    # accumulation, one rounding: F.linear itself in float32, its float32 form in 16 bits).
    h = silu_and_mul_reference(x)
    want = (
        F.linear(h, w, b) if dtype == torch.float32 else F.linear(h.float(), w.float(), b.float())
    )
    _close(got, want.to(dtype))
    # The activation is really applied (x's gate half alone would give another answer).
    assert not torch.allclose(got.float(), skinny_linear(x[:, :k], w, b).float(), atol=1e-2)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_fused_activation_is_rounded_exactly_as_silu_and_mul_rounds_it(device, dtype, m):
    """Through an identity weight the output is the activation itself, rounded once more to
    its own dtype (a no-op): so it must equal the `silu_and_mul` kernel's output bit for bit.
    The control shows the check can fail: skipping the rounding of silu(gate) before the
    product changes some 16-bit results."""
    k = 200
    x = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    eye = torch.eye(k, device=device, dtype=dtype)
    got = skinny_linear(x, eye, activation="silu_and_mul")
    assert torch.equal(got, silu_and_mul(x))
    _close(got, silu_and_mul_reference(x))
    if dtype != torch.float32:
        gate, up = x[:, :k].float(), x[:, k:].float()
        unrounded = (F.silu(gate) * up).to(dtype)
        assert not torch.equal(unrounded, silu_and_mul(x))


def test_fused_honours_strided_rows_and_out(device):
    x_wide, w, b = _fused_inputs(3, 40, 64, torch.float32, device, bias=True, seed=7)
    x = torch.cat([x_wide, torch.full((3, 16), 9.0, device=device)], dim=1)[:, :128]
    assert x.stride(0) == 144
    out_wide = torch.full((3, 48), 7.0, device=device)
    out = out_wide[:, 4:44]
    got = skinny_linear(x, w, b, out=out, activation="silu_and_mul")
    assert got.data_ptr() == out.data_ptr()
    _close(out, skinny_linear_reference(x, w, b, activation="silu_and_mul"))
    assert (out_wide[:, :4] == 7).all() and (out_wide[:, 44:] == 7).all()


def test_fused_bad_arguments_raise_value_error_naming_them(device):
    x, w, _ = _fused_inputs(2, 24, 32, torch.float32, device)
    with pytest.raises(ValueError, match="activation must be None or one of"):
        skinny_linear(x, w, activation="gelu")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        skinny_linear(x, w, activation="")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        skinny_linear_reference(x, w, activation="relu")
    # [gate | up] must be twice the weight's K wide; a plain call wants exactly K.
    with pytest.raises(ValueError, match=r"x must have 2 \* K = 64 columns"):
        skinny_linear(x[:, :32], w, activation="silu_and_mul")
    with pytest.raises(ValueError, match=r"x must have 2 \* K = 64 columns"):
        skinny_linear(torch.randn(2, 63, device=device), w, activation="silu_and_mul")
    with pytest.raises(ValueError, match="weight has 32 columns, x has 64"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match="x must have 1..16 rows"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 64, device=device), w, activation="silu_and_mul")


# ---- the fused RMSNorm prologue: x (+ residual) normalised, then the matmul --------------------

EPS = 1e-5


def _norm_inputs(n, k, dtype, device, *, residual, seed=0):
    """One row x, its residual (or None), an RMSNorm weight around 1, and weight [N, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(device=device, dtype=dtype)
    r = torch.randn(1, k, generator=g).to(device=device, dtype=dtype) if residual else None
    nw = (1 + 0.5 * torch.randn(k, generator=g)).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    return x, r, nw, w


def _fused_norm(x, w, nw, r, **kw):
    """skinny_linear with the norm fused; returns (result, residual_out or None)."""
    ro = torch.full_like(x, float("nan")) if r is not None else None
    got = skinny_linear(x, w, norm_weight=nw, eps=EPS, residual=r, residual_out=ro, **kw)
    return got, ro


def _rmsnorm(x, nw, r):
    """`rmsnorm`'s (normalised row, new residual or None)."""
    if r is None:
        return rmsnorm(x, nw, EPS), None
    return rmsnorm(x, nw, EPS, r)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("k", [200, 128])  # K off the block grid; on it
def test_fused_norm_matches_rmsnorm_then_the_matmul(device, dtype, residual, k):
    n = 72
    x, r, nw, w = _norm_inputs(n, k, dtype, device, residual=residual, seed=k + residual)
    x0, r0 = x.clone(), (r.clone() if r is not None else None)
    got, ro = _fused_norm(x, w, nw, r)
    assert got.shape == (1, n) and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(x, x0) and (r is None or torch.equal(r, r0))
    h, new_residual = _rmsnorm(x, nw, r)
    if r is not None:
        assert torch.equal(ro, new_residual)
    if dtype == torch.float32:
        _close(got, F.linear(h, w))
    else:
        # One rounding of a float32 sum each: one unit in the last place apart at most.
        _close(got, skinny_linear_reference(x, w, norm_weight=nw, eps=EPS, residual=r))
        _close(got, skinny_linear(h, w))
        _close(got, F.linear(h.float(), w.float()).to(dtype))
    # The norm (and the residual) are really applied: the raw row gives another answer.
    assert not torch.allclose(got.float(), skinny_linear(x, w).float(), atol=1e-2)
    if r is not None:
        unnormed = skinny_linear((x.float() + r.float()).to(dtype), w)
        assert not torch.allclose(got.float(), unnormed.float(), atol=1e-2)
        assert not torch.allclose(got.float(), _fused_norm(x, w, nw, None)[0].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_fused_norm_is_rounded_exactly_as_rmsnorm_rounds_it(device, dtype, residual):
    """Through an identity weight the output is the normalised row itself, rounded once more
    to its own dtype (a no-op): so it must equal `rmsnorm`'s output bit for bit. x and the
    residual are multiples of 1/16 below 4 in size, so the sum of squares is exact in float32
    whatever order the two kernels reduce it in (on a GPU their orders differ); the inverse
    norm, the product and both roundings are arbitrary. The control shows the check can fail:
    skipping the rounding of the normalised row before the weight changes some 16-bit results."""
    k = 200
    g = torch.Generator().manual_seed(11 + residual)
    x = (torch.randint(-64, 64, (1, k), generator=g) / 16).to(device, dtype)
    r = (torch.randint(-64, 64, (1, k), generator=g) / 16).to(device, dtype) if residual else None
    nw = (1 + 0.5 * torch.randn(k, generator=g)).to(device, dtype)
    eye = torch.eye(k, device=device, dtype=dtype)
    got, ro = _fused_norm(x, eye, nw, r)
    h, new_residual = _rmsnorm(x, nw, r)
    assert torch.equal(got, h)
    assert r is None or torch.equal(ro, new_residual)
    if dtype != torch.float32:
        s = x.float() if r is None else new_residual.float()
        unrounded = (nw.float() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
        assert not torch.equal(unrounded, h)


def test_fused_norm_honours_strided_x_and_residual_and_out(device):
    k, n = 96, 40
    x, r, nw, w = _norm_inputs(n, k, torch.float32, device, residual=True, seed=3)
    x_wide = torch.cat([x, torch.full((1, 8), 9.0, device=device)], dim=1)[:, :k]
    r_wide = torch.cat([torch.full((1, 4), 9.0, device=device), r], dim=1)[:, 4:]
    ro_wide = torch.full((1, k + 8), 7.0, device=device)
    ro = ro_wide[:, 4 : 4 + k]
    out_wide = torch.full((1, n + 8), 7.0, device=device)
    out = out_wide[:, 4 : 4 + n]
    got = skinny_linear(
        x_wide, w, norm_weight=nw, eps=EPS, residual=r_wide, residual_out=ro, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    h, new_residual = rmsnorm(x, nw, EPS, r)
    _close(out, F.linear(h, w))
    assert torch.equal(ro, new_residual)
    for wide in (ro_wide, out_wide):  # nothing written outside
        assert (wide[:, :4] == 7).all() and (wide[:, -4:] == 7).all()


def test_fused_norm_bias_is_added_after_the_matmul(device):
    x, r, nw, w = _norm_inputs(40, 64, torch.float32, device, residual=True, seed=5)
    b = torch.randn(40, device=device)
    got, _ = _fused_norm(x, w, nw, r, bias=b)
    _close(got, F.linear(rmsnorm(x, nw, EPS, r)[0], w, b))


def test_fused_norm_reference_writes_residual_out(device):
    x, r, nw, w = _norm_inputs(24, 32, torch.float32, device, residual=True, seed=9)
    ro = torch.empty_like(x)
    got = skinny_linear_reference(x, w, norm_weight=nw, eps=EPS, residual=r, residual_out=ro)
    h, new_residual = rmsnorm(x, nw, EPS, r)
    _close(got, F.linear(h, w))
    assert torch.equal(ro, new_residual)


def test_fused_norm_bad_arguments_raise_value_error_naming_them(device):
    k = 32
    x, r, nw, w = _norm_inputs(24, k, torch.float32, device, residual=True)
    ro = torch.empty_like(x)
    two = torch.randn(2, k, device=device)
    both = torch.randn(2 * k, device=device)
    kw = dict(norm_weight=nw, eps=EPS)
    cases = [
        ((two, w), kw, "x must have exactly one row with norm_weight"),
        ((x, w), {**kw, "activation": "silu_and_mul"}, "activation must be None with norm_weight"),
        ((x, w), {**kw, "residual": r}, "residual_out is required"),
        ((x, w), {**kw, "residual_out": ro}, "residual_out must be None without residual"),
        ((x, w), {"residual": r, "residual_out": ro}, "need norm_weight"),
        ((x, w), {"residual_out": ro}, "need norm_weight"),
        ((x, w), {**kw, "norm_weight": nw[:16]}, r"norm_weight must have shape \(32,\)"),
        ((x, w), {**kw, "norm_weight": nw.half()}, "norm_weight must be one of"),
        ((x, w), {**kw, "norm_weight": nw[None]}, "norm_weight must have 1 dimensions"),
        ((x, w), {**kw, "norm_weight": both[::2]}, "norm_weight must have unit stride"),
        ((x, w), {**kw, "eps": -1.0}, "eps must be a finite number"),
        ((x, w), {**kw, "eps": float("nan")}, "eps must be a finite number"),
        ((x, w), {**kw, "residual": r[:, :16], "residual_out": ro}, "residual must have shape"),
        ((x, w), {**kw, "residual": r.half(), "residual_out": ro}, "residual must be one of"),
        ((x, w), {**kw, "residual": r, "residual_out": ro.half()}, "residual_out must be one of"),
        ((x, w), {**kw, "residual": r, "residual_out": ro[0]}, "residual_out must have 2 dim"),
        ((x, w), {**kw, "residual": r, "residual_out": x}, "residual_out must not overlap x"),
        (
            (x, w),
            {**kw, "residual": r, "residual_out": r},
            "residual_out must not overlap residual",
        ),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_linear(*args, **kwargs)
    # Partial overlaps count too: residual_out half over x's row, or over out.
    buf = torch.randn(1, 2 * k, device=device)
    with pytest.raises(ValueError, match="residual_out must not overlap x"):
        skinny_linear(buf[:, :k], w, **kw, residual=r, residual_out=buf[:, k // 2 : k // 2 + k])
    out_buf = torch.empty(1, 64, device=device)
    with pytest.raises(ValueError, match="residual_out must not overlap out"):
        skinny_linear(x, w, **kw, residual=r, residual_out=out_buf[:, 16:48], out=out_buf[:, :24])
    # Adjacent, not overlapping: accepted.
    skinny_linear(buf[:, :k], w, **kw, residual=r, residual_out=buf[:, k:])


# ---- the Llama MLP's choice of path -----------------------------------------------------------


def _mlp_config(*, mlp_bias: bool) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=128,
        intermediate_size=320,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        mlp_bias=mlp_bias,
    )


def test_mlp_uses_two_kernels_off_cuda_and_in_float32():
    for dtype in (torch.float32, torch.bfloat16):
        assert LlamaMLP(_mlp_config(mlp_bias=False), dtype).silu_mul_down is silu_mul_down
    assert select_silu_mul_down(torch.device("cuda"), torch.float32) is silu_mul_down
    assert select_silu_mul_down(torch.device("cpu"), torch.float16) is silu_mul_down
    # Only CUDA 16-bit weights get the fused form (chosen without touching the device).
    assert select_silu_mul_down(torch.device("cuda"), torch.bfloat16) is not silu_mul_down


# ---- GPU, Llama-3.1-8B shapes -----------------------------------------------------------------

GPU_DTYPES = (torch.bfloat16, torch.float16)
# (N, K): fused qkv, o_proj, fused gate_up, down_proj.
LLAMA_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n,k", LLAMA_8B_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 16])
def test_real_sizes_gpu(dtype, n, k, m):
    x, w, _ = _inputs(m, n, k, dtype, "cuda", seed=n + k + m)
    _close(skinny_linear(x, w), skinny_linear_reference(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_fused_real_size_matches_the_two_kernel_path_gpu(dtype, m):
    """down_proj of Llama-3.1-8B (N=4096, K=14336). Against `silu_and_mul` then the plain
    kernel, both sum in float32 and round once: one unit in the last place. Against cuBLAS,
    whose 16-bit split-K may reduce in 16 bits (torch allows it by default): a few units."""
    n, k = 4096, 14336
    x, w, _ = _fused_inputs(m, n, k, dtype, "cuda", seed=m)
    got = skinny_linear(x, w, activation="silu_and_mul")
    h = silu_and_mul(x)
    _close(got, skinny_linear(h, w))
    torch.testing.assert_close(got.float(), F.linear(h, w).float(), rtol=2**-6, atol=2**-6)
    _close(got, skinny_linear_reference(x, w, activation="silu_and_mul"))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "silu_and_mul"])
@pytest.mark.parametrize("m", [1, 3])
def test_graph_capture_after_one_eager_call_gpu(activation, m):
    """After the first (autotuning) call, a launch records into a CUDA graph (it would raise
    inside capture if it synchronised) and replays with the inputs' new values."""
    make = _inputs if activation is None else _fused_inputs
    x, w, b = make(m, 4096, 4096, torch.bfloat16, "cuda", bias=True)
    out = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
    skinny_linear(x, w, b, out=out, activation=activation)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, b, out=out, activation=activation)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, skinny_linear_reference(x, w, b, activation=activation))


NORM_SHAPES = [(6144, 4096), (28672, 4096)]  # qkv_proj, gate_up_proj: each after a norm


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,k", NORM_SHAPES)
def test_fused_norm_real_sizes_match_rmsnorm_then_the_matmul_gpu(dtype, residual, n, k):
    """Against `rmsnorm` then the plain kernel: the same rounded input (up to the sum of
    squares' order, which moves a normalised element by an ulp at most, rarely), float32 sums
    rounded once: one unit in the last place. Against cuBLAS, whose 16-bit split-K may
    reduce in 16 bits: a few units. The new residual is bit for bit rmsnorm's."""
    x, r, nw, w = _norm_inputs(n, k, dtype, "cuda", residual=residual, seed=n + residual)
    got, ro = _fused_norm(x, w, nw, r)
    h, new_residual = _rmsnorm(x, nw, r)
    if r is not None:
        assert torch.equal(ro, new_residual)
    _close(got, skinny_linear(h, w))
    torch.testing.assert_close(got.float(), F.linear(h, w).float(), rtol=2**-6, atol=2**-6)
    _close(got, skinny_linear_reference(x, w, norm_weight=nw, eps=EPS, residual=r))


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_fused_norm_graph_capture_after_one_eager_call_gpu(residual):
    """As for the plain kernel: the fused norm records into a CUDA graph after its first
    (autotuning) call and replays with new x, residual and norm weight."""
    n, k = 6144, 4096
    x, r, nw, w = _norm_inputs(n, k, torch.bfloat16, "cuda", residual=residual, seed=21)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ro = torch.empty_like(x) if residual else None
    kw = dict(out=out, norm_weight=nw, eps=EPS, residual=r, residual_out=ro)
    skinny_linear(x, w, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, **kw)
    x.copy_(torch.randn_like(x))
    nw.copy_(1 + 0.5 * torch.randn_like(nw))
    if r is not None:
        r.copy_(torch.randn_like(r))
    graph.replay()
    torch.cuda.synchronize()
    h, new_residual = _rmsnorm(x, nw, r)
    _close(out, skinny_linear(h, w))
    if r is not None:
        assert torch.equal(ro, new_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_mlp_built_on_cuda_fuses_up_to_its_row_limit_gpu(dtype):
    """Both paths are deterministic, so bitwise equality says which one ran."""
    with torch.device("cuda"):
        mlp = LlamaMLP(_mlp_config(mlp_bias=True), dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    for p in mlp.parameters():
        p.data.normal_(0.0, 0.05, generator=g)
    assert mlp.silu_mul_down is not silu_mul_down
    down = mlp.down_proj
    for rows in (1, FUSED_MLP_MAX_ROWS, FUSED_MLP_MAX_ROWS + 1, MAX_ROWS + 3):
        x = torch.randn(rows, 128, device="cuda", generator=g).to(dtype)
        gate_up = mlp.gate_up_proj(x)
        got = mlp(x)
        two_kernels = silu_mul_down(gate_up, down)
        if rows <= FUSED_MLP_MAX_ROWS:
            fused = skinny_linear(gate_up, down.weight, down.bias, activation="silu_and_mul")
            assert torch.equal(got, fused)
            _close(got, skinny_linear(silu_and_mul(gate_up), down.weight, down.bias))
            torch.testing.assert_close(got.float(), two_kernels.float(), rtol=2**-6, atol=2**-6)
        else:
            assert torch.equal(got, two_kernels)


@pytest.mark.gpu
def test_tiny_bf16_llama_gives_the_same_greedy_tokens_with_and_without_the_fused_mlp_gpu(
    tiny_model_dirs,
):
    """One request at a time, so every decode step (and the 1-token prompt's prefill) is a
    single row, the fused path. The reference scheduler runs eagerly with every layer's MLP
    switched to the two-kernel path; the fused one keeps its CUDA graphs, whose warm-up
    autotunes the fused kernel before capture. The two differ only in the float32 summation
    order of down_proj, so a greedy token could flip only on a near-tie of bf16 logits."""
    from braid import SamplingParams
    from braid.runtime.ipc.to_scheduler import GenerateReq
    from tests.conftest import local_scheduler, run_to_end

    path = tiny_model_dirs["llama"]
    kw = dict(dtype="bfloat16", kv_tokens=2048, cuda_graph_max_bs=4)
    fused = local_scheduler(path, **kw)
    reference = local_scheduler(path, disable_cuda_graph=True, **kw)
    fused_layers = fused.runner.model.model.layers
    assert all(layer.mlp.silu_mul_down is not silu_mul_down for layer in fused_layers)
    for layer in reference.runner.model.model.layers:
        layer.mlp.silu_mul_down = silu_mul_down
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 6, 40)]
    for i, prompt in enumerate(prompts):
        tokens = []
        for sched in (fused, reference):
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            sched.handle(GenerateReq(f"r{i}", prompt, params, 0))
            tokens.append(run_to_end(sched)[f"r{i}"])
        assert len(tokens[0]) == 16
        assert tokens[0] == tokens[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_token_fused_layer_gives_the_unfused_tokens(tiny_model_dirs, device, arch):
    """`select_one_row_forward`'s layer (norms inside the projections, the activation inside
    down_proj, o_proj in the skinny kernel) on the device the kernels run on here (on CPU:
    the interpreter, float16, with the CUDA choice forced), against the layer's own path:
    the same greedy tokens for every prefill of one token and batch-1 decode step."""
    import types

    from braid.runtime.ipc.to_scheduler import GenerateReq
    from braid.runtime.sampling_params import SamplingParams
    from tests.conftest import local_scheduler, run_to_end

    dtype = "float16" if device.type == "cpu" else "bfloat16"
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = []
    for fused in (False, True):
        sched = local_scheduler(
            tiny_model_dirs[arch],
            kv_tokens=2048,
            dtype=dtype,
            device=device.type,
            disable_cuda_graph=True,
        )
        fn = select_one_row_forward(types.SimpleNamespace(type="cuda"), getattr(torch, dtype))
        assert fn is not None
        for layer in sched.runner.model.model.layers:
            layer.one_row = fn if fused else None
        # One at a time: batch-1 decode steps; "b" is also a one-token prefill.
        tokens = {}
        for rid, prompt in (("a", [7, 100, 3, 42, 9]), ("b", [300])):
            sched.handle(GenerateReq(rid, prompt, sp, 0))
            tokens |= run_to_end(sched)
        got.append(tokens)
    assert got[1] == got[0]
    assert [len(t) for t in got[0].values()] == [8, 8]


def test_a_measured_choice_leaves_one_candidate(tmp_path, monkeypatch):
    """`skinny_gemm.json` names the autotuner's earlier choice per GPU and case: only that
    configuration is left (nothing benchmarked, one compile on a fresh machine); a case or GPU
    it does not name, or a choice no longer among the candidates, leaves them all."""
    import triton

    from braid.kernels import skinny_gemm

    key = skinny_gemm.tuned_key(6144, 4096, torch.bfloat16, None, True, True, False)
    assert key == "6144/4096/bfloat16/-/110"
    table = {"GPU A": {key: [32, 256, 4, 4]}, "GPU B": {key: [48, 256, 4, 4]}}
    path = tmp_path / "skinny_gemm.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", path)
    skinny_gemm._tuned_table.cache_clear()
    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in [(16, 256, 4, 4), (32, 256, 4, 4), (32, 256, 8, 3)]
    ]
    try:
        (only,) = skinny_gemm.known_choice(configs, "GPU A", key)
        assert only is configs[1]
        assert skinny_gemm.known_choice(configs, "GPU B", key) == configs  # not a candidate
        assert skinny_gemm.known_choice(configs, "GPU C", key) == configs
        other = skinny_gemm.tuned_key(4096, 4096, torch.bfloat16, None, False, False, False)
        assert skinny_gemm.known_choice(configs, "GPU A", other) == configs
    finally:
        skinny_gemm._tuned_table.cache_clear()


@pytest.mark.gpu
def test_a_measured_choice_is_launched_without_benchmarking_gpu(tmp_path, monkeypatch):
    from braid.kernels import skinny_gemm

    name = torch.cuda.get_device_name()
    n, k = 1000, 2000  # a shape no other test tunes in this process
    key = skinny_gemm.tuned_key(n, k, torch.bfloat16, None, False, False, False)
    path = tmp_path / "skinny_gemm.json"
    path.write_text(json.dumps({name: {key: [64, 128, 4, 4]}}))
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", path)
    skinny_gemm._tuned_table.cache_clear()
    try:
        x, w, _ = _inputs(2, n, k, torch.bfloat16, "cuda", seed=5)
        _close(skinny_linear(x, w), skinny_linear_reference(x, w))
        chosen = [c for key_, c in skinny_gemm._kernel.cache.items() if key_[:2] == (n, k)]
        assert len(chosen) == 1
        c = chosen[0]
        assert [c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages] == [
            64, 128, 4, 4,
        ]  # fmt: skip
    finally:
        skinny_gemm._tuned_table.cache_clear()
