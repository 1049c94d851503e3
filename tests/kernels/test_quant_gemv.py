"""The one-row GEMVs (`int4_gemv` over the planar layout, `int8_gemv`, `fp8_gemv` with its
in-kernel activation quantization) and the planar int4 GEMM and dequantization against the
dequantize-then-matmul references: every group size path (groups of whole 128-input blocks,
of planes, of single planes), split-K with ragged splits, ragged N and K, bias; the split-K
reduction's bits independent of run and its counters back at zero; the planar layout's packing.
On a GPU: Llama-3.1-8B shapes in bfloat16 at the tables' configurations, CUDA-graph replay,
and each method's layer against its reference at 1, 16 and 300 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from braid.kernels.fp8_quant import per_token_quant_fp8
from braid.kernels.int4_gemv import int4_gemv
from braid.kernels.int4_pairs import PackedInputs, pack_int4_inputs
from braid.kernels.quant_gemv import GemvConfig, GemvWorkspace, fp8_gemv, int8_gemv
from braid.kernels.quant_planar import dequantize_int4_planar, int4_planar_linear
from braid.kernels.quant_reference import (
    FP8_DTYPE,
    dequantize_int4,
    fp8_linear_reference,
    int4_linear_reference,
    int8_linear_reference,
    pack_int4,
    pack_int4_meta,
    pack_int4_planar,
    per_token_quant_fp8_reference,
    unpack_int4,
    unpack_int4_meta,
    unpack_int4_planar,
)
from tests.kernels.conftest import CPU_DTYPES, HAS_CUDA


def _int4(n, k, group, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scales = ((torch.rand(k // group, n, generator=g) + 0.5) / (4 * k**0.5)).half()
    zeros = torch.randint(0, 17, (k // group, n), generator=g).to(torch.uint8)
    planar = pack_int4_planar(qweight).to(device)
    meta = pack_int4_meta(scales, zeros).to(device)
    return (qweight.to(device), scales.to(device), zeros.to(device)), (planar, meta)


def _x(m, k, dtype, device, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).to(device=device, dtype=dtype)


def _close(got, want):
    """Float32 sums in another order, rounded once: a unit in the last place at most."""
    rtol, atol = {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (2**-10, 1e-3),
        torch.bfloat16: (2**-7, 1e-2),
    }[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# ---- layouts ------------------------------------------------------------------------------------


def test_planar_packing_puts_plane_p_of_word_w_at_input_16p_plus_w():
    codes = torch.randint(0, 16, (3, 200), generator=torch.Generator().manual_seed(0))
    words = pack_int4_planar(pack_int4(codes))
    assert words.shape == (3, 32)  # K padded to 256
    assert torch.equal(unpack_int4_planar(words, 200), codes.to(torch.uint8))
    nibbles = unpack_int4(words).reshape(3, 2, 16, 8)  # [row, block, word, plane]
    assert torch.equal(nibbles[:, 1, 5, 3], codes[:, 128 + 16 * 3 + 5].to(torch.uint8))
    assert (unpack_int4_planar(words, 256)[:, 200:] == 0).all()  # the padding holds zeros


def test_meta_holds_each_groups_zero_and_float16_scale():
    scales = torch.rand(4, 24).half() + 0.01
    zeros = torch.randint(0, 17, (4, 24)).to(torch.uint8)
    got_scales, got_zeros = unpack_int4_meta(pack_int4_meta(scales, zeros))
    assert torch.equal(got_scales, scales) and torch.equal(got_zeros, zeros)


# ---- int4 ---------------------------------------------------------------------------------------

INT4_CASES = [
    # (n, k, group, config): groups of blocks, of planes, of one plane; splits even and ragged.
    (40, 256, 128, GemvConfig(16, 128, 1)),
    (64, 512, 256, GemvConfig(32, 256, 2)),
    (48, 320, 64, GemvConfig(16, 256, 2)),
    (24, 96, 48, GemvConfig(8, 128, 1)),
    (20, 160, 32, GemvConfig(32, 128, 3)),
    (16, 64, 16, GemvConfig(16, 128, 1)),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n,k,group,config", INT4_CASES)
def test_int4_gemv_matches_the_dequantized_matmul(device, dtype, n, k, group, config):
    (q, s, z), (planar, meta) = _int4(n, k, group, device)
    x, bias = _x(1, k, dtype, device), _x(1, n, dtype, device, seed=2).reshape(n)
    want = int4_linear_reference(x, q, s, z, group, bias)
    _close(int4_gemv(x, planar, meta, group, bias, config=config), want)


def test_int4_gemv_each_group_uses_its_own_zero_and_scale(device):
    # Only the last group's inputs are nonzero: a kernel that applies one group's scale or
    # zero to another's sums is off by orders of magnitude.
    (q, s, z), _ = _int4(32, 512, 64, device)
    s[:7] = 1000.0
    z[:7] = 0
    planar, meta = pack_int4_planar(q), pack_int4_meta(s, z)
    x = torch.zeros(1, 512, device=device)
    x[:, 448:] = 1.0
    got = int4_gemv(x, planar, meta, 64, config=GemvConfig(16, 256, 2))
    _close(got, int4_linear_reference(x, q, s, z, 64))
    assert got.abs().max() < 100


def test_split_k_gives_the_same_bits_every_run_and_leaves_its_counters_at_zero(device):
    (_, _, _), (planar, meta) = _int4(64, 1024, 128, device)
    x = _x(1, 1024, torch.float32, device)
    ws = GemvWorkspace(device, 4 * 64, 4)
    cfg = GemvConfig(16, 128, 4)
    first = int4_gemv(x, planar, meta, 128, config=cfg, workspace=ws)
    for _ in range(2):
        assert torch.equal(int4_gemv(x, planar, meta, 128, config=cfg, workspace=ws), first)
    assert (ws.counters == 0).all()
    # One split alone sums in another order, not to another value.
    _close(int4_gemv(x, planar, meta, 128, config=GemvConfig(16, 128, 1)), first)


def test_every_gemv_gives_the_same_bits_with_its_splits_launched_first(device):
    # The grid's order (`splits_first`) changes which program is which row block and split:
    # a mix-up of the two reads other rows or other K and no longer agrees.
    from dataclasses import replace

    n, k = 72, 1024  # 5 row blocks of 16 (the last ragged), 4 splits
    _, (planar, meta) = _int4(n, k, 128, device)
    g = torch.Generator().manual_seed(3)
    w8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    wf = (torch.randn(n, k, generator=g) * 0.3).to(FP8_DTYPE).to(device)
    scales = (torch.rand(n, generator=g) + 0.5).to(device) / 64
    x = _x(1, k, torch.float16, device)

    def int4(c, ws, x=x):
        return int4_gemv(x, planar, meta, 128, config=c, workspace=ws)

    cases = [
        (lambda c, ws: int4(c, ws, x.float()), GemvConfig(16, 128, 4)),
        (int4, GemvConfig(16, 128, 4, packed=True)),
        (int4, GemvConfig(16, 128, 4, packed=2)),
        (
            lambda c, ws: int8_gemv(x, w8, scales.half(), config=c, workspace=ws),
            GemvConfig(16, 64, 4),
        ),
        (lambda c, ws: fp8_gemv(x, wf, scales, config=c, workspace=ws), GemvConfig(16, 64, 4)),
        (
            lambda c, ws: fp8_gemv(x, wf, scales, config=c, workspace=ws),
            GemvConfig(16, 64, 4, dot=True),
        ),
    ]
    for call, cfg in cases:
        ws = GemvWorkspace(device, 4 * n, 5)
        want = call(cfg, ws)
        got = call(replace(cfg, splits_first=True), ws)
        assert torch.equal(got, want), cfg
        assert (ws.counters == 0).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [2, 37])
@pytest.mark.parametrize("n,k,group", [(40, 256, 128), (48, 320, 64), (24, 96, 48)])
def test_int4_planar_gemm_and_dequantization_match_the_reference(device, dtype, m, n, k, group):
    (q, s, z), (planar, meta) = _int4(n, k, group, device)
    x, bias = _x(m, k, dtype, device), _x(1, n, dtype, device, seed=2).reshape(n)
    want = int4_linear_reference(x, q, s, z, group, bias)
    _close(int4_planar_linear(x, planar, meta, group, bias, config=(16, 16, 4, 1)), want)
    w = dequantize_int4_planar(planar, meta, group, k, torch.float32)
    assert torch.equal(w, dequantize_int4(q, s, z, group))


PACKED_CASES = [
    # (n, k, group, config, x scale): splits even and ragged (SUBS not dividing a split), N
    # ragged, groups of one and of two blocks; inputs whose products would overflow float16
    # unscaled (|x| up to ~4e3: 8 products of 16 * 4e3 > 65504) and inputs near float16's
    # subnormals.
    (40, 256, 128, GemvConfig(16, 128, 1, packed=True), 1.0),
    (64, 1024, 256, GemvConfig(32, 256, 3, packed=True), 1.0),
    (48, 640, 128, GemvConfig(32, 256, 2, packed=True), 1e3),
    (32, 384, 128, GemvConfig(16, 128, 2, packed=True), 1e-4),
    # The second form (codes as float16 subnormals, the zero after the sums) at the same cases.
    (40, 256, 128, GemvConfig(16, 128, 1, packed=2), 1.0),
    (64, 1024, 256, GemvConfig(32, 256, 3, packed=2), 1.0),
    (48, 640, 128, GemvConfig(32, 256, 2, packed=2), 1e3),
    (32, 384, 128, GemvConfig(16, 128, 2, packed=2), 1e-4),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,config,scale", PACKED_CASES)
def test_int4_gemv_in_float16_pairs_matches_the_dequantized_matmul(
    device, dtype, n, k, group, config, scale
):
    (q, s, z), (planar, meta) = _int4(n, k, group, device)
    x = _x(1, k, dtype, device, scale=scale)
    bias = _x(1, n, dtype, device, seed=2, scale=scale).reshape(n)
    got = int4_gemv(x, planar, meta, group, bias, config=config)
    want = int4_linear_reference(x.float(), q, s, z, group, bias.float())
    # Each product and each sum of 8 rounded to float16, then float32 sums: a few float16
    # units off in all (measured 2.5-6e-4 in float16, what bfloat16's output rounding hides).
    # Planes paired with the wrong inputs or halves, or a scale not undone, are off by O(1).
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < {torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,config,scale", PACKED_CASES)
def test_int4_gemv_over_inputs_packed_ahead_gives_the_same_bits(
    device, dtype, n, k, group, config, scale
):
    """`pack_int4_inputs` makes the float16 pairs, scales and block sums each program of the
    packed form makes (one jit helper, `_block_inputs`): the GEMV that loads them gives the
    same bits, with ragged splits (blocks past a split's end masked) and both forms."""
    _, (planar, meta) = _int4(n, k, group, device)
    x = _x(1, k, dtype, device, scale=scale)
    bias = _x(1, n, dtype, device, seed=2, scale=scale).reshape(n)
    want = int4_gemv(x, planar, meta, group, bias, config=config)
    ahead = pack_int4_inputs(x, config.packed)
    assert ahead.words.shape == (k // 128, 64) and ahead.scales.shape == (k // 128, 2)
    got = int4_gemv(x, planar, meta, group, bias, config=config, packed_inputs=ahead)
    assert torch.equal(got, want)
    # The words are what the GEMV multiplies: other inputs' words give another result.
    other = pack_int4_inputs(_x(1, k, dtype, device, seed=5, scale=scale), config.packed)
    moved = int4_gemv(x, planar, meta, group, bias, config=config, packed_inputs=other)
    assert not torch.equal(moved, want)


def test_inputs_packed_ahead_are_refused_where_they_do_not_fit(device):
    _, (planar, meta) = _int4(16, 256, 128, device)
    x = _x(1, 256, torch.float16, device)
    first, second = GemvConfig(16, 128, 2, packed=1), GemvConfig(16, 128, 2, packed=2)
    with pytest.raises(ValueError, match="config.packed is 2, the inputs' form 1"):
        int4_gemv(x, planar, meta, 128, config=second, packed_inputs=pack_int4_inputs(x, 1))
    ahead = pack_int4_inputs(x, 1)
    w = _x(1, 256, torch.float16, device).reshape(256)
    with pytest.raises(ValueError, match="prologue True"):
        int4_gemv(x, planar, meta, 128, config=first, norm_weight=w, packed_inputs=ahead)
    zero_form = PackedInputs(ahead.words, ahead.scales, 0)
    with pytest.raises(ValueError, match="config.packed is 0"):  # the float32 form
        int4_gemv(x, planar, meta, 128, config=GemvConfig(16, 128, 2), packed_inputs=zero_form)
    short = PackedInputs(ahead.words[:1], ahead.scales[:1], 1)
    with pytest.raises(ValueError, match=r"packed_inputs.words must have shape \(2, 64\)"):
        int4_gemv(x, planar, meta, 128, config=first, packed_inputs=short)
    with pytest.raises(ValueError, match="form must be 1 or 2"):
        pack_int4_inputs(x, 0)
    with pytest.raises(ValueError, match=r"x must have shape \(1, K\) with K a multiple of 128"):
        pack_int4_inputs(_x(1, 200, torch.float16, device), 1)
    with pytest.raises(ValueError, match=r"x must be one of \(.*\), got torch.float32"):
        pack_int4_inputs(x.float(), 1)


def _produced(producer, dtype, device, k):
    """(input, the producer's keyword arguments, its output, the new residual or None) of
    the kernel before a GEMV: the norm (with or without the residual) or the activation."""
    from braid.kernels.activation import silu_and_mul
    from braid.kernels.norm import rmsnorm

    if producer == "silu_and_mul":
        gate_up = _x(1, 2 * k, dtype, device, scale=3.0)
        return gate_up, dict(activation="silu_and_mul"), silu_and_mul(gate_up), None
    x = _x(1, k, dtype, device, scale=4.0)
    weight = _x(1, k, dtype, device, seed=3).reshape(k)
    if producer == "norm":
        return x, dict(norm_weight=weight, eps=1e-5), rmsnorm(x, weight, 1e-5), None
    residual = _x(1, k, dtype, device, seed=4)
    normed, added = rmsnorm(x, weight, 1e-5, residual)
    kwargs = dict(norm_weight=weight, eps=1e-5, residual=residual,
                  residual_out=torch.empty_like(x))  # fmt: skip
    return x, kwargs, normed, added


PRODUCERS = ["norm", "norm+residual", "silu_and_mul"]


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("k", [384, 4096])
def test_inputs_packed_in_the_producers_place_are_its_output_packed(device, producer, form, k):
    """`pack_int4_inputs` with the norm's or the activation's arguments packs what that
    kernel would have stored (one launch in its place), bit for bit: the words of its output
    (the sum of squares in one load as wide as `rmsnorm`'s, with its warps, so in its order),
    and the new residual."""
    x, kwargs, produced, added = _produced(producer, torch.float16, device, k)
    got = pack_int4_inputs(x, form, **kwargs)
    want = pack_int4_inputs(produced, form)
    assert torch.equal(got.words, want.words) and torch.equal(got.scales, want.scales)
    if added is not None:
        assert torch.equal(kwargs["residual_out"], added)


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("k", [200, 4096, 6144])
def test_fp8_codes_made_in_the_producers_place_are_its_output_quantized(device, producer, k):
    """`per_token_quant_fp8` with the norm's or the activation's arguments quantizes what
    that kernel would have stored: its codes and scale (and the new residual), the same bits
    where the sum of squares is one load as wide as `rmsnorm`'s (K <= 4096); at K = 6144 it
    adds in two loads, which may flip a code's last place."""
    x, kwargs, produced, added = _produced(producer, torch.float16, device, k)
    codes, scale = per_token_quant_fp8(x, **kwargs)
    want_codes, want_scale = per_token_quant_fp8(produced)
    exact = producer == "silu_and_mul" or k <= 4096
    if exact:
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scale, want_scale)
    else:
        # A flipped last place of a normalised element moves its code by one e4m3 step at
        # most (an eighth of its size), or the row's scale by a last place.
        torch.testing.assert_close(scale, want_scale, rtol=2e-3, atol=0)
        got, want = codes.float() * scale, want_codes.float() * want_scale
        torch.testing.assert_close(got, want, rtol=0.13, atol=want_scale.item() * 2**-9)
    if added is not None:
        assert torch.equal(kwargs["residual_out"], added)


def test_producers_in_the_preparing_launch_refuse_what_they_cannot_fuse(device):
    x = _x(1, 256, torch.float16, device)
    w = _x(1, 256, torch.float16, device).reshape(256)
    for prepare in (lambda **kw: pack_int4_inputs(x, 1, **kw), per_token_quant_fp8):
        args = {} if prepare is not per_token_quant_fp8 else {"x": x}
        with pytest.raises(ValueError, match="activation must be None with norm_weight"):
            prepare(**args, activation="silu_and_mul", norm_weight=w)
        with pytest.raises(ValueError, match="residual and residual_out need norm_weight"):
            prepare(**args, residual=x)
        with pytest.raises(ValueError, match="residual_out is required with residual"):
            prepare(**args, norm_weight=w, residual=x)
        with pytest.raises(ValueError, match="activation must be None or one of"):
            prepare(**args, activation="gelu")
    with pytest.raises(ValueError, match=r"x must have shape \(1, 2 \* K\) \(\[gate \| up\]\)"):
        pack_int4_inputs(_x(1, 384, torch.float16, device), 1, activation="silu_and_mul")
    with pytest.raises(ValueError, match=r"x must have shape \(1, K\) and unit stride"):
        per_token_quant_fp8(_x(2, 256, torch.float16, device), norm_weight=w)
    with pytest.raises(ValueError, match="residual_out must not overlap x"):
        per_token_quant_fp8(x, norm_weight=w, residual=x.clone(), residual_out=x)


@pytest.mark.skipif(HAS_CUDA, reason="runs the kernels on the CPU (the GPU test of the same)")
def test_the_prepared_one_row_forward_gives_the_tokens_of_the_gemvs_preparing_x(monkeypatch):
    """The prepared forward's data flow on the CPU: an fp8 model with its CUDA kernels
    installed (`_use_cuda`, run by Triton's interpreter: the one-row GEMV, per-token codes
    then `_scaled_mm` for more rows) decodes one sequence with each norm and the activation
    making the next GEMV's codes, and gives the greedy tokens of the same model whose GEMVs
    quantize x themselves (the residual, o_proj's own path and the down projection's
    [gate | up] input all checked through the tokens)."""
    from braid.runtime.ipc.to_scheduler import GenerateReq
    from braid.runtime.layers.fusion import select_prepared_one_row_forward
    from braid.runtime.layers.linear import Linear
    from braid.runtime.models.llama import LlamaDecoderLayer
    from braid.runtime.quantization.base import INPUTS_AHEAD_ENV
    from braid.runtime.quantization.fp8 import Fp8LinearMethod
    from braid.runtime.sampling_params import SamplingParams
    from tests.conftest import local_scheduler, run_to_end

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama"
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for mode in ("0", "fused"):
        monkeypatch.setenv(INPUTS_AHEAD_ENV, mode)
        sched = local_scheduler(
            path, kv_tokens=256, device="cpu", load_format="dummy", quantization="fp8"
        )
        model = sched.runner.model
        for m in model.modules():
            if isinstance(m, Linear) and isinstance(m.method, Fp8LinearMethod):
                m.method._use_cuda()
        layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
        for layer in layers:
            layer.one_row = select_prepared_one_row_forward(layer)
        assert all((layer.one_row is not None) == (mode == "fused") for layer in layers)
        sched.handle(GenerateReq("a", [5, 17, 300, 42, 9, 77], sp, 0))
        tokens[mode] = run_to_end(sched)["a"]
    assert len(tokens["0"]) == 8 and tokens["fused"] == tokens["0"]


def test_the_two_packed_forms_are_different_kernels_with_the_same_result(device):
    # The second form (`packed` 2) really runs: other roundings, so other bits, same product;
    # and a form that does not exist is refused.
    (q, s, z), (planar, meta) = _int4(64, 1024, 128, device)
    x = _x(1, 1024, torch.float16, device)
    first = int4_gemv(x, planar, meta, 128, config=GemvConfig(16, 128, 2, packed=1))
    second = int4_gemv(x, planar, meta, 128, config=GemvConfig(16, 128, 2, packed=2))
    assert not torch.equal(first, second)
    assert ((second.float() - first.float()).norm() / first.float().norm()).item() < 2e-3
    with pytest.raises(ValueError, match="packed must be 0, 1 or 2, got 3"):
        GemvConfig(16, 128, 2, packed=3)


def test_a_packed_config_keeps_the_float32_kernel_where_pairs_do_not_apply(device):
    # float32 inputs, and groups smaller than a 128-input block: the float32 kernel's bits.
    packed, plain = GemvConfig(16, 128, 2, packed=True), GemvConfig(16, 128, 2)
    _, (planar, meta) = _int4(32, 512, 128, device)
    x = _x(1, 512, torch.float32, device)
    assert torch.equal(
        int4_gemv(x, planar, meta, 128, config=packed),
        int4_gemv(x, planar, meta, 128, config=plain),
    )
    _, (planar, meta) = _int4(32, 512, 64, device)
    x = _x(1, 512, torch.float16, device)
    assert torch.equal(
        int4_gemv(x, planar, meta, 64, config=packed), int4_gemv(x, planar, meta, 64, config=plain)
    )


@pytest.mark.parametrize("packed", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gemv_with_silu_and_mul_fused_equals_the_two_kernels(device, dtype, packed):
    from braid.kernels.activation import silu_and_mul

    _, (planar, meta) = _int4(48, 384, 128, device)
    gate_up = _x(1, 768, dtype, device, scale=3.0)
    cfg = GemvConfig(16, 128, 2, packed=packed)
    fused = int4_gemv(gate_up, planar, meta, 128, activation="silu_and_mul", config=cfg)
    # The same activation bits (silu rounded, then the product rounded), the same pairs.
    assert torch.equal(fused, int4_gemv(silu_and_mul(gate_up), planar, meta, 128, config=cfg))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("packed", [1, 2])
def test_int4_gemv_with_rmsnorm_fused_matches_the_two_kernels(device, dtype, with_residual, packed):
    from braid.kernels.norm import rmsnorm

    (q, s, z), (planar, meta) = _int4(40, 512, 256, device)
    x = _x(1, 512, dtype, device, scale=4.0)
    weight = _x(1, 512, dtype, device, seed=3).reshape(512)
    residual = _x(1, 512, dtype, device, seed=4) if with_residual else None
    new = torch.empty_like(x) if with_residual else None
    cfg = GemvConfig(32, 256, 3, packed=packed)  # splits ragged: every program makes the norm
    got = int4_gemv(
        x, planar, meta, 256, norm_weight=weight, eps=1e-5, residual=residual,
        residual_out=new, config=cfg,
    )  # fmt: skip
    normed = rmsnorm(x, weight, 1e-5, residual)
    if with_residual:
        normed, added = normed
        assert torch.equal(new, added)  # bit for bit rmsnorm's second result
    want = int4_gemv(normed, planar, meta, 256, config=cfg)
    # The inverse norm summed in another order: a last-place flip of a normalised element
    # at most, far inside the pairs' float16 rounding.
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 2e-3, err
    ref = int4_linear_reference(normed.float(), q, s, z, 256)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 8e-3


def test_int4_gemv_prologues_refuse_what_they_cannot_fuse(device):
    _, (planar, meta) = _int4(16, 256, 128, device)
    x = _x(1, 256, torch.float16, device)
    w = _x(1, 256, torch.float16, device).reshape(256)
    with pytest.raises(ValueError, match=r"x must have shape \(1, 2 \* K\)"):
        int4_gemv(_x(2, 512, torch.float16, device), planar, meta, 128, activation="silu_and_mul")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        int4_gemv(x, planar, meta, 128, activation="gelu")
    with pytest.raises(ValueError, match="activation must be None with norm_weight"):
        int4_gemv(x, planar, meta, 128, activation="silu_and_mul", norm_weight=w)
    with pytest.raises(ValueError, match="a fused prologue runs in float16 pairs"):
        int4_gemv(x.float(), planar, meta, 128, norm_weight=w.float())
    with pytest.raises(ValueError, match="residual_out is required with residual"):
        int4_gemv(x, planar, meta, 128, norm_weight=w, residual=x.clone())
    with pytest.raises(ValueError, match="residual and residual_out need norm_weight"):
        int4_gemv(x, planar, meta, 128, residual=x.clone(), residual_out=x.clone())
    _, (planar64, meta64) = _int4(16, 256, 64, device)
    with pytest.raises(ValueError, match="group_size a multiple of 128, got torch.float16 and 64"):
        int4_gemv(x, planar64, meta64, 64, norm_weight=w)


def test_int4_launchers_refuse_bad_arguments_naming_them(device):
    _, (planar, meta) = _int4(16, 256, 128, device)
    x = _x(1, 256, torch.float32, device)
    with pytest.raises(ValueError, match=r"x must have shape \(1, 256\)"):
        int4_gemv(x.expand(2, 256), planar, meta, 128)
    with pytest.raises(ValueError, match=r"qweight must have shape \(16, 64\), got \(16, 32\)"):
        int4_gemv(_x(1, 512, torch.float32, device), planar, meta, 128)
    with pytest.raises(ValueError, match=r"meta must have shape \(4, 16\)"):
        int4_gemv(x, planar, meta, 64)
    with pytest.raises(ValueError, match="block_k must be a multiple of 128"):
        int4_gemv(x, planar, meta, 128, config=GemvConfig(16, 64))
    with pytest.raises(ValueError, match="meta must be one of"):
        int4_planar_linear(x, planar, meta.float(), 128)


# ---- int8 and fp8 -------------------------------------------------------------------------------

BYTE_CONFIGS = [GemvConfig(16, 64, 1), GemvConfig(8, 128, 2), GemvConfig(16, 32, 3)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("config", BYTE_CONFIGS)
@pytest.mark.parametrize("n,k", [(40, 200), (16, 512)])  # a ragged K; whole blocks
def test_int8_gemv_matches_the_dequantized_matmul(device, dtype, config, n, k):
    g = torch.Generator().manual_seed(n)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    scales = ((torch.rand(n, generator=g) + 0.5) / (64 * k**0.5)).to(device=device, dtype=dtype)
    x, bias = _x(1, k, dtype, device), _x(1, n, dtype, device, seed=2).reshape(n)
    got = int8_gemv(x, w, scales, bias, config=config)
    _close(got, int8_linear_reference(x, w, scales, bias))


# The fp8 GEMV's tensor-core form too (`dot`): a ragged split, a tile wider than N.
FP8_CONFIGS = [*BYTE_CONFIGS, GemvConfig(16, 64, 3, dot=True), GemvConfig(64, 32, 1, dot=True)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("config", FP8_CONFIGS)
@pytest.mark.parametrize("n,k", [(40, 200), (16, 512)])
def test_fp8_gemv_is_w8a8_with_the_per_token_codes(device, dtype, config, n, k):
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(n, k, generator=g) * 0.3).to(FP8_DTYPE).to(device)
    scales = (torch.rand(n, generator=g) + 0.5).to(device)
    x, bias = _x(1, k, dtype, device, scale=5.0), _x(1, n, dtype, device, seed=2).reshape(n)
    got = fp8_gemv(x, w, scales, bias, out_dtype=torch.float32, config=config)
    want = fp8_linear_reference(x, w, scales, bias, torch.float32)
    if config.dot and got.is_cuda:  # sums of 32 products rounded in the tensor cores
        assert ((got - want).norm() / want.norm()).item() < 2e-4
    else:  # e4m3 products are exact in float32: only the order of the sum differs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Not the unquantized product: the activation really went through e4m3.
    exact = x.float() @ (w.float() * scales[:, None]).T + bias.float()
    assert (got - exact).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("config", FP8_CONFIGS)
@pytest.mark.parametrize("n,k", [(40, 200), (16, 512)])
def test_fp8_gemv_over_codes_made_ahead_gives_the_same_bits(device, dtype, config, n, k):
    """`per_token_quant_fp8`'s codes and scale, made before the launch, are what every
    program makes from x: the GEMV that loads them gives the same bits (a ragged K, split
    and not, CUDA cores and tensor cores)."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(n, k, generator=g) * 0.3).to(FP8_DTYPE).to(device)
    scales = (torch.rand(n, generator=g) + 0.5).to(device)
    x, bias = _x(1, k, dtype, device, scale=5.0), _x(1, n, dtype, device, seed=2).reshape(n)
    want = fp8_gemv(x, w, scales, bias, out_dtype=torch.float32, config=config)
    codes, scale = per_token_quant_fp8(x)
    got = fp8_gemv(x, w, scales, bias, out_dtype=torch.float32, config=config, x_codes=codes,
                   x_scale=scale)  # fmt: skip
    assert torch.equal(got, want)
    # The codes are what the kernel multiplies: another row's codes give another result.
    other_codes, other_scale = per_token_quant_fp8(_x(1, k, dtype, device, seed=7))
    moved = fp8_gemv(x, w, scales, bias, out_dtype=torch.float32, config=config,
                     x_codes=other_codes, x_scale=other_scale)  # fmt: skip
    assert not torch.equal(moved, want)
    # And the scale given is the one applied (twice the scale: exactly twice the output).
    plain = fp8_gemv(x, w, scales, out_dtype=torch.float32, config=config, x_codes=codes,
                     x_scale=scale)  # fmt: skip
    doubled = fp8_gemv(x, w, scales, out_dtype=torch.float32, config=config, x_codes=codes,
                       x_scale=scale * 2)  # fmt: skip
    assert torch.equal(doubled, plain * 2)


def test_fp8_codes_made_ahead_are_refused_where_they_do_not_fit(device):
    w = torch.zeros(16, 256, device=device).to(FP8_DTYPE)
    scales = torch.ones(16, device=device)
    x = _x(1, 256, torch.bfloat16, device)
    codes, scale = per_token_quant_fp8(x)
    with pytest.raises(ValueError, match="x_codes and x_scale go together"):
        fp8_gemv(x, w, scales, x_codes=codes)
    with pytest.raises(ValueError, match=r"x_codes must have shape \(1, 256\)"):
        fp8_gemv(x, w, scales, x_codes=codes[:, :128], x_scale=scale)
    with pytest.raises(ValueError, match="x_codes must be one of"):
        fp8_gemv(x, w, scales, x_codes=x, x_scale=scale)
    with pytest.raises(ValueError, match=r"x_scale must have shape \(1, 1\)"):
        fp8_gemv(x, w, scales, x_codes=codes, x_scale=torch.ones(1, 2, device=device))


def test_a_tensor_core_fp8_config_must_fit_the_instruction():
    w = torch.zeros(64, 128, dtype=FP8_DTYPE)
    x, scales = torch.ones(1, 128), torch.ones(64)
    for bad in (GemvConfig(64, 48, dot=True), GemvConfig(8, 64, dot=True)):
        with pytest.raises(ValueError, match="tensor-core config needs block_k a multiple of 32"):
            fp8_gemv(x, w, scales, config=bad)


def test_the_fp8_reference_scale_is_one_ieee_division_then_a_reciprocal():
    # Rows whose max / 448 and max * (1 / 448) differ in float32: the reference must divide
    # (it used to compute a different scale on CUDA than on the CPU).
    amax = torch.rand(20000, dtype=torch.float64) * 100 + 1
    divided = (amax / 448).float()
    multiplied = amax.float() * torch.tensor(1 / 448, dtype=torch.float32)
    rows = amax.float()[divided != multiplied][:64]
    assert len(rows) > 0
    x = torch.stack([rows, -rows / 3], dim=1)
    codes, scales = per_token_quant_fp8_reference(x)
    assert torch.equal(scales[:, 0], (rows.double() / 448).float())
    inverse = (1 / scales.double()).float()
    assert torch.equal(codes.float(), (x * inverse).clamp(-448, 448).to(FP8_DTYPE).float())


# ---- GPU -----------------------------------------------------------------------------------------

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA_8B))
def test_gpu_gemvs_at_llama_8b_shapes_in_bf16(shape):
    n, k = LLAMA_8B[shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    (q, s, z), (planar, meta) = _int4(n, k, 128, dev)
    x = _x(1, k, dt, dev)
    want4 = int4_linear_reference(x, q, s, z, 128)
    _close(int4_gemv(x, planar, meta, 128), want4)
    for cfg in (
        GemvConfig(512, 128, 8, 4, 2, packed=True),
        GemvConfig(256, 256, 4, 4, 2, packed=True),
        GemvConfig(256, 128, 16, 4, 2, packed=2, splits_first=True),
    ):
        got = int4_gemv(x, planar, meta, 128, config=cfg)
        err = ((got.float() - want4.float()).norm() / want4.float().norm()).item()
        assert err < 8e-3, f"relative error {err:.2e} with {cfg}"
    for m in (16, 300):
        xm = _x(m, k, dt, dev)
        _close(int4_planar_linear(xm, planar, meta, 128), int4_linear_reference(xm, q, s, z, 128))
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    s8 = torch.rand(n, device=dev, dtype=dt) / (64 * k**0.5)
    _close(int8_gemv(x, w8, s8), int8_linear_reference(x, w8, s8))
    wf = (torch.randn(n, k, device=dev) * 0.3).to(FP8_DTYPE)
    sf = torch.rand(n, device=dev) / 100
    _close(fp8_gemv(x, wf, sf), fp8_linear_reference(x, wf, sf))
    want = fp8_linear_reference(x, wf, sf, None, torch.float32)
    for cfg in (GemvConfig(64, 256, 4, 4, 3, dot=True), GemvConfig(128, 256, 1, 4, 3, dot=True)):
        got = fp8_gemv(x, wf, sf, out_dtype=torch.float32, config=cfg)
        # Sums of 32 products rounded in the tensor cores, then summed in float32: close to
        # the reference as a whole (whole blocks kept in the tensor cores' precision were
        # ~1e-3 off at single outputs), not equal up to the order of a float32 sum.
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-4, f"relative error {err:.2e} with {cfg}"


@pytest.mark.gpu
def test_gpu_int4_prologues_at_llama_8b_shapes():
    from braid.kernels.activation import silu_and_mul
    from braid.kernels.norm import rmsnorm

    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg = GemvConfig(512, 128, 8, 4, 2, packed=True)
    _, (planar, meta) = _int4(4096, 14336, 128, dev)
    gate_up = _x(1, 2 * 14336, dt, dev, scale=3.0)
    fused = int4_gemv(gate_up, planar, meta, 128, activation="silu_and_mul", config=cfg)
    want = int4_gemv(silu_and_mul(gate_up), planar, meta, 128, config=cfg)
    assert ((fused.float() - want.float()).norm() / want.float().norm()).item() < 1e-3
    _, (planar, meta) = _int4(6144, 4096, 128, dev)
    x, residual = _x(1, 4096, dt, dev, scale=4.0), _x(1, 4096, dt, dev, seed=4)
    weight = _x(1, 4096, dt, dev, seed=3).reshape(4096)
    new = torch.empty_like(x)
    fused = int4_gemv(
        x, planar, meta, 128, norm_weight=weight, eps=1e-5, residual=residual,
        residual_out=new, config=cfg,
    )  # fmt: skip
    normed, added = rmsnorm(x, weight, 1e-5, residual)
    assert torch.equal(new, added)
    want = int4_gemv(normed, planar, meta, 128, config=cfg)
    assert ((fused.float() - want.float()).norm() / want.float().norm()).item() < 1e-3


@pytest.mark.gpu
def test_gpu_split_k_gemvs_replay_in_a_cuda_graph():
    dev, dt = torch.device("cuda"), torch.bfloat16
    n, k = 4096, 4096
    (q, s, z), (planar, meta) = _int4(n, k, 128, dev)
    wf = (torch.randn(n, k, device=dev) * 0.3).to(FP8_DTYPE)
    sf = torch.rand(n, device=dev) / 100
    x = _x(1, k, dt, dev)
    ws4 = GemvWorkspace(dev, 8 * n, n)
    ws8 = GemvWorkspace(dev, 8 * n, n)
    ws4p = GemvWorkspace(dev, 8 * n, n)
    cfg4, cfg8 = GemvConfig(128, 256, 8, 4, 2), GemvConfig(32, 512, 4, 4, 2)
    cfg4p = GemvConfig(512, 128, 8, 4, 2, packed=True, splits_first=True)
    out4 = int4_gemv(x, planar, meta, 128, config=cfg4, workspace=ws4)
    out4p = int4_gemv(x, planar, meta, 128, config=cfg4p, workspace=ws4p)
    out8 = fp8_gemv(x, wf, sf, config=cfg8, workspace=ws8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_gemv(x, planar, meta, 128, out=out4, config=cfg4, workspace=ws4)
        int4_gemv(x, planar, meta, 128, out=out4p, config=cfg4p, workspace=ws4p)
        fp8_gemv(x, wf, sf, out=out8, config=cfg8, workspace=ws8)
    for seed in (5, 6):
        x.copy_(_x(1, k, dt, dev, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        want4 = int4_linear_reference(x, q, s, z, 128)
        _close(out4, want4)
        assert ((out4p.float() - want4.float()).norm() / want4.float().norm()).item() < 8e-3
        _close(out8, fp8_linear_reference(x, wf, sf))
    assert (ws4.counters == 0).all() and (ws8.counters == 0).all() and (ws4p.counters == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["awq", "w8a16", "fp8"])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_each_methods_layer_matches_its_reference(method, m):
    from braid.runtime.quantization import select_quantization
    from braid.runtime.quantization.base import LinearSpec

    dev = torch.device("cuda")
    spec = LinearSpec("layer", 4096, {None: (0, 6144)}, torch.bfloat16, dev)
    layer = select_quantization(None, method, dummy=False).linear_method(spec, ("layer",))
    (placeholder,) = layer.create_weights().values()
    placeholder.weight_loader(placeholder, torch.randn(6144, 4096, device=dev) * 0.02, None)
    layer.finish_loading()
    x = _x(m, 4096, torch.bfloat16, dev)
    bias = _x(1, 6144, torch.bfloat16, dev, seed=2).reshape(-1)
    got, want = layer.apply(x, bias), layer.reference(x, bias)
    from braid.kernels.quant_planar import DEQUANTIZE_MIN_ROWS

    if method == "awq" and m >= DEQUANTIZE_MIN_ROWS:
        # This path rounds each dequantized weight to bfloat16 once (as a bf16 model's weights
        # are) and multiplies with cuBLAS: one rounding per weight more than the reference's
        # float32 product, so a sum of 4096 products can move by a few bf16 units where it
        # nearly cancels (seen on an H200: 0.011 at an output of 0.06; outputs are ~1.3).
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=3e-2)
    else:
        _close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_gpu_one_row_layer_with_its_input_prepared_ahead_gives_the_same_bits(method, monkeypatch):
    """BRAID_GEMV_INPUTS_AHEAD=1 (read when a layer loads): the one-row GEMV's input made by
    a launch of its own (int4's float16 pairs, fp8's codes), at Llama-3.1-8B's down shape
    with the GPU's table configuration for both (`same_launch_shapes`); the same bits as the
    GEMV preparing it, and the preparing launch runs with the flag alone."""
    from braid.kernels import fp8_quant, int4_pairs
    from braid.kernels.quant_gemv import config_for
    from tests.conftest import same_launch_shapes

    same_launch_shapes(monkeypatch)
    from braid.runtime.quantization import select_quantization
    from braid.runtime.quantization.base import INPUTS_AHEAD_ENV, LinearSpec

    dev = torch.device("cuda")
    if method == "awq" and not config_for("int4", 4096, 14336, dev).packed:
        pytest.skip(f"{torch.cuda.get_device_name()}: no packed one-row int4 form in its table")
    module, name = (int4_pairs, "pack_int4_inputs") if method == "awq" else (
        fp8_quant, "per_token_quant_fp8"
    )  # fmt: skip
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    spec = LinearSpec("layer", 14336, {None: (0, 4096)}, torch.bfloat16, dev)
    w = torch.randn(4096, 14336, device=dev) * 0.02
    x = _x(1, 14336, torch.bfloat16, dev)
    outs = []
    for ahead in ("0", "1"):
        monkeypatch.setenv(INPUTS_AHEAD_ENV, ahead)
        layer = select_quantization(None, method, dummy=False).linear_method(spec, ("layer",))
        (placeholder,) = layer.create_weights().values()
        placeholder.weight_loader(placeholder, w.clone(), None)
        layer.finish_loading()
        calls.clear()
        outs.append(layer.apply(x, None))
        assert len(calls) == int(ahead)
    assert torch.equal(outs[1], outs[0])


def test_tuned_configuration_files_are_read_or_refused_naming_the_file(tmp_path):
    from braid.kernels._checks import tuned_configs

    path = tmp_path / "quant_gemv.json"
    assert tuned_configs(path, "Some GPU") == {}  # no file: the built-in tables
    path.write_text('{"Some GPU": {"int4/1/2": [16, 128, 1, 4, 2, false]}}')
    assert tuned_configs(path, "Some GPU") == {"int4/1/2": [16, 128, 1, 4, 2, False]}
    assert tuned_configs(path, "Other GPU") == {}
    path.write_text('{"Some GPU": {"int4/1/2": [16, 128')  # cut short
    with pytest.raises(ValueError, match=r"quant_gemv.json: not valid JSON"):
        tuned_configs(path, "Some GPU")
    path.write_text('{"Some GPU": [16, 128]}')
    with pytest.raises(ValueError, match=r"quant_gemv.json: expected .* got list for 'Some GPU'"):
        tuned_configs(path, "Some GPU")
