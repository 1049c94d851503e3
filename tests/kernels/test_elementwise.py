"""rmsnorm, rotary, silu_and_mul and apply_token_bitmask_ against their references and the
runtime layers they stand in for."""

from __future__ import annotations

import pytest
import torch

from braid.kernels import apply_token_bitmask_, rmsnorm, rotary, silu_and_mul
from braid.kernels.activation import silu_and_mul_reference
from braid.kernels.argmax import CHUNK, argmax_rows, argmax_rows_reference
from braid.kernels.kv_store import store_kv_reference
from braid.kernels.norm import rmsnorm_reference
from braid.kernels.rope import rotary_reference
from braid.kernels.token_bitmask import apply_token_bitmask_reference
from braid.runtime.layers.activation import silu_and_mul as layer_silu_and_mul
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.rotary import (
    FusedRotaryTables,
    RotaryEmbedding,
    apply_rotary,
    mrope_axes,
)
from tests.kernels.conftest import CPU_DTYPES

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to two roundings of the dtype (the kernel rounds once from fp32, the torch
    reference at each op; fp32: a few ulp of accumulated reduction). On the H200, fp16 at
    real sizes showed 2 of 16M elements two fp16 ulps apart."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[want.dtype]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ---- rmsnorm ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rmsnorm_matches_the_module_with_and_without_residual(device, dtype):
    norm = RMSNorm(40, 1e-6, dtype).to(device)
    norm.weight.data.copy_(torch.randn(40))
    x = torch.randn(3, 5, 40, device=device).to(dtype)
    res = torch.randn(3, 5, 40, device=device).to(dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = rmsnorm(x, norm.weight, 1e-6, res)
    want_out, want_res = norm(x, res)
    _ulp_close(out, want_out)
    assert torch.equal(new_res, want_res)  # the sum is rounded exactly as torch rounds it
    _ulp_close(rmsnorm(x, norm.weight, 1e-6), norm(x))
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


def test_rmsnorm_promotes_to_weight_dtype_and_reads_strided_rows(device):
    # Seeded: about 1 draw in 300 puts one element a float32 rounding past the tolerance.
    torch.manual_seed(0)
    x = torch.randn(6, 80, device=device).half()[:, :48]  # row stride 80
    w = torch.randn(48, device=device)
    got = rmsnorm(x, w, 1e-5)
    assert got.dtype == torch.float32
    _ulp_close(got, rmsnorm_reference(x, w, 1e-5))


def test_rmsnorm_rejects_bad_arguments(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="weight has 8"):
        rmsnorm(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        rmsnorm(x, torch.ones(16, device=device), 1e-6, torch.randn(4, 8, device=device))
    with pytest.raises(ValueError, match="residual must be one of"):
        rmsnorm(x, torch.ones(16, device=device), 1e-6, x.half())
    with pytest.raises(ValueError, match="x must have unit stride"):
        rmsnorm(x.t(), torch.ones(4, device=device), 1e-6)


# ---- rotary -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rotary_matches_apply_rotary_in_place_on_fused_qkv_slices(device, dtype, scaling):
    heads, kv_heads, d = 4, 2, 32
    rope = RotaryEmbedding(d, 128, 10000.0, scaling, dtype).to(device)
    qkv = torch.randn(7, (heads + 2 * kv_heads) * d, device=device).to(dtype)
    q = qkv[:, : heads * d].view(7, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(7, kv_heads, d)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    positions = torch.tensor([0, 1, 5, 127, 64, 64, 3], device=device)
    want_q, want_k = apply_rotary(q, k, *rope.lookup(positions))
    ref_q, ref_k = rotary_reference(q, k, positions, (rope.cos, rope.sin))
    got_q, got_k = rotary(q, k, positions, (rope.cos, rope.sin))
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _ulp_close(q, ref_q)
    _ulp_close(k, ref_k)
    _ulp_close(q, want_q)
    _ulp_close(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_rows_through_the_fused_kernel_match_the_torch_path(device, interleaved):
    """What a CUDA `RotaryEmbedding.lookup_mrope` hands the attention backends: the per-token
    rows as a table of their own, rotated by the fused kernel (here made on any device)."""
    d, tokens = 32, 9
    rope = RotaryEmbedding(d, 64, 10000.0, None, torch.float32).to(device)
    axes = mrope_axes((4, 6, 6) if not interleaved else (6, 5, 5), d, interleaved).to(device)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 64, (3, tokens), generator=gen).to(device)
    q = torch.randn(tokens, 4, d, generator=gen).to(device)
    k = torch.randn(tokens, 2, d, generator=gen).to(device)
    want_q, want_k = apply_rotary(q, k, *rope.lookup_mrope(positions, axes))
    rope._fused = FusedRotaryTables(rope.cos, rope.sin, rotary)  # as built on CUDA
    order, tables = rope.lookup_mrope(positions, axes)
    assert isinstance(tables, FusedRotaryTables) and order.tolist() == list(range(tokens))
    got_q, got_k = apply_rotary(q, k, order, tables)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    _ulp_close(got_q, want_q)
    _ulp_close(got_k, want_k)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_single_tensor_cache_partial_dim_and_gptj_pairs(device, is_neox):
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32).to(device)
    cache = torch.cat([rope.cos[:, :8], rope.sin[:, :8]], dim=1)  # rot_dim 16 < head_dim 32
    q = torch.randn(5, 3, 32, device=device)
    k = torch.randn(5, 1, 32, device=device)
    positions = torch.tensor([4, 0, 63, 9, 9], device=device, dtype=torch.int32)
    want_q, want_k = rotary_reference(q, k, positions, cache, is_neox)
    q0 = q.clone()
    rotary(q, k, positions, cache, is_neox)
    _ulp_close(q, want_q)
    _ulp_close(k, want_k)
    assert torch.equal(q[..., 16:], q0[..., 16:])  # past rot_dim: untouched


def test_rotary_rejects_bad_arguments(device):
    rope = RotaryEmbedding(16, 8, 10000.0, None, torch.float32).to(device)
    q, k = torch.randn(2, 2, 16, device=device), torch.randn(2, 1, 16, device=device)
    pos = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="positions has 1"):
        rotary(q, k, pos[:1], (rope.cos, rope.sin))
    with pytest.raises(ValueError, match="positions must be one of"):
        rotary(q, k, pos.float(), (rope.cos, rope.sin))
    with pytest.raises(ValueError, match="k shape"):
        rotary(q, torch.randn(3, 1, 16, device=device), pos, (rope.cos, rope.sin))
    with pytest.raises(ValueError, match="rotary dim 32"):
        rotary(q, k, pos, torch.randn(8, 32, device=device))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rot_dim, is_neox", [(32, True), (16, True), (16, False)])
def test_rotary_with_store_writes_the_rotated_k_and_v_into_the_pool(
    device, dtype, rot_dim, is_neox
):
    heads, kv_heads, d, slots = 4, 2, 32, 20
    rope = RotaryEmbedding(rot_dim, 64, 10000.0, None, dtype).to(device)
    cache = (rope.cos, rope.sin)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, device=device).to(dtype)
    q = qkv[:, : heads * d].view(5, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(5, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(5, kv_heads, d)
    positions = torch.tensor([3, 0, 63, 9, 9], device=device)
    loc = torch.tensor([7, 19, 1, 12, 4], device=device)
    want_q, want_k = rotary_reference(q, k, positions, cache, is_neox)
    want_k_cache = torch.zeros(slots, kv_heads, d, device=device, dtype=dtype)
    want_v_cache = torch.zeros_like(want_k_cache)
    store_kv_reference(want_k_cache, want_v_cache, want_k, v, loc)
    k_cache, v_cache = torch.zeros_like(want_k_cache), torch.zeros_like(want_v_cache)
    rotary(q, k, positions, cache, is_neox, store=(v, k_cache, v_cache, loc))
    _ulp_close(q, want_q)
    _ulp_close(k, want_k)
    assert torch.equal(k_cache, k.new_zeros(k_cache.shape).index_copy_(0, loc, k))
    _ulp_close(k_cache, want_k_cache)
    assert torch.equal(v_cache, want_v_cache)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_with_store_into_fp8_pool_quantizes_as_store_kv(device, dtype, rot_dim):
    """The fused kernel writes an fp8 pool bit for bit as `store_kv` (and torch's clamp and
    cast) would after rotating, with the layer's scales."""
    heads, kv_heads, d, slots = 4, 2, 32, 20
    rope = RotaryEmbedding(rot_dim, 64, 10000.0, None, dtype).to(device)
    cache = (rope.cos, rope.sin)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, device=device) * 50
    qkv = qkv.to(dtype)  # some values past 448 / scale: the clamp matters
    q = qkv[:, : heads * d].view(5, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(5, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(5, kv_heads, d)
    positions = torch.tensor([3, 0, 63, 9, 9], device=device)
    loc = torch.tensor([7, 19, 1, 12, 4], device=device)
    fp8 = torch.float8_e4m3fn
    k_cache = torch.zeros(slots, kv_heads, d, device=device, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    rotary(q, k, positions, cache, store=(v, k_cache, v_cache, loc), kv_scales=(0.3, 0.125))
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(want_k, want_v, k, v, loc, k_scale=0.3, v_scale=0.125)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert k_cache.float().abs().max() == 448.0


def test_rotary_store_rejects_bad_pool_arguments(device):
    rope = RotaryEmbedding(16, 8, 10000.0, None, torch.float32).to(device)
    q, k = torch.randn(2, 2, 16, device=device), torch.randn(2, 1, 16, device=device)
    v, pos = torch.randn(2, 1, 16, device=device), torch.tensor([0, 1], device=device)
    pool = torch.zeros(4, 1, 16, device=device)
    with pytest.raises(ValueError, match="loc has 1"):
        rotary(q, k, pos, (rope.cos, rope.sin), store=(v, pool, pool.clone(), pos[:1]))
    with pytest.raises(ValueError, match="v_cache"):
        rotary(q, k, pos, (rope.cos, rope.sin), store=(v, pool, pool[:2], pos))
    with pytest.raises(ValueError, match="store must be"):
        rotary(q, k, pos, (rope.cos, rope.sin), store=(v, pool))


# ---- silu_and_mul -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_and_mul_matches_the_layer(device, dtype):
    x = (3 * torch.randn(3, 4, 2 * 70, device=device)).to(dtype)
    got = silu_and_mul(x)
    assert got.shape == (3, 4, 70)
    _ulp_close(got.cpu(), layer_silu_and_mul(x.cpu()))  # the layer's torch path
    _ulp_close(got, silu_and_mul_reference(x))


def test_silu_and_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7, device=device))


# ---- token bitmask ----------------------------------------------------------------------


def _bitmask_from_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """Pack bool [rows, vocab] into int32 words, token 32 * w + j at bit j of word w."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_bitmask_sets_exactly_the_disallowed_tokens_to_minus_inf(device, dtype):
    vocab = 1000 + 7  # not a multiple of 32: the last word is partial
    allowed = torch.rand(3, vocab) < 0.3
    allowed[:, 1006] = True  # the last token, top of a partial word
    allowed[0, 31] = False  # bit 31: the sign bit of a word
    allowed[1, 31] = True
    logits = torch.randn(3, vocab, device=device).to(dtype)
    before = logits.clone()
    apply_token_bitmask_(logits, _bitmask_from_allowed(allowed).to(device))
    allowed = allowed.to(device)
    assert torch.equal(logits[allowed], before[allowed])
    assert bool((logits[~allowed] == float("-inf")).all())


def test_bitmask_with_indices_touches_only_those_rows(device):
    vocab = 70
    allowed = torch.rand(2, vocab) < 0.5
    bitmask = _bitmask_from_allowed(allowed).to(device)
    logits = torch.randn(5, vocab, device=device)
    want = logits.clone()
    indices = torch.tensor([4, 1], device=device, dtype=torch.int32)
    apply_token_bitmask_reference(want, bitmask, indices)
    apply_token_bitmask_(logits, bitmask, indices)
    assert torch.equal(logits, want)
    assert bool(torch.isfinite(logits[[0, 2, 3]]).all())
    assert bool((logits[4][~allowed[0].to(device)] == float("-inf")).all())


@pytest.mark.parametrize("words", [2, 4])
def test_bitmask_narrower_mask_bans_uncovered_tokens_wider_mask_is_cut(device, words):
    """Logits of 70 tokens (3 words): 2 words ban tokens 64..69; a 4th word is ignored."""
    allowed = torch.ones(1, words * 32, dtype=torch.bool)
    bitmask = _bitmask_from_allowed(allowed).to(device)
    logits = torch.zeros(1, 70, device=device)
    want = logits.clone()
    apply_token_bitmask_reference(want, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, want)
    banned = (logits[0] == float("-inf")).nonzero().flatten().tolist()
    assert banned == (list(range(64, 70)) if words == 2 else [])


def test_bitmask_rejects_bad_layout(device):
    logits = torch.randn(2, 70, device=device)
    with pytest.raises(ValueError, match="bitmask must be one of"):
        apply_token_bitmask_(logits, torch.zeros(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="bitmask has 1 rows, expected logits rows = 2"):
        apply_token_bitmask_(logits, torch.zeros(1, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="len\\(indices\\) = 1"):
        apply_token_bitmask_(
            logits,
            torch.zeros(2, 3, dtype=torch.int32, device=device),
            torch.tensor([0], device=device),
        )


# ---- GPU, real sizes (Llama-3.1-8B shapes) ----------------------------------------------------

GPU_DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rmsnorm_real_sizes_gpu(dtype):
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    out, new_res = rmsnorm(x, w, 1e-5, r)
    want_out, want_res = rmsnorm_reference(x, w, 1e-5, r)
    assert torch.equal(new_res, want_res)
    _ulp_close(out, want_out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rotary_real_sizes_gpu(dtype):
    scaling = dict(LLAMA3, original_max_position_embeddings=8192)
    rope = RotaryEmbedding(128, 131072, 500000.0, scaling, dtype).to("cuda")
    q = torch.randn(4096, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(4096, 8, 128, device="cuda", dtype=dtype)
    positions = torch.randint(0, 131072, (4096,), device="cuda")
    want_q, want_k = rotary_reference(q, k, positions, (rope.cos, rope.sin))
    rotary(q, k, positions, (rope.cos, rope.sin))
    _ulp_close(q, want_q)
    _ulp_close(k, want_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_silu_and_mul_real_sizes_gpu(dtype):
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=dtype)
    _ulp_close(silu_and_mul(x), silu_and_mul_reference(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, *GPU_DTYPES))
def test_bitmask_real_sizes_gpu(dtype):
    vocab = 128256
    allowed = torch.rand(64, vocab) < 0.01
    logits = torch.randn(128, vocab, device="cuda", dtype=dtype)
    want = logits.clone()
    indices = torch.randperm(128, device="cuda")[:64]
    bitmask = _bitmask_from_allowed(allowed).cuda()
    apply_token_bitmask_reference(want, bitmask, indices)
    apply_token_bitmask_(logits, bitmask, indices)
    assert torch.equal(logits, want)


# ---- argmax_rows ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_argmax_rows_matches_torch_with_ties_and_masked_rows(device, dtype):
    v = 2 * CHUNK + 37  # three chunks, the last one partial
    x = torch.randn(5, v, device=device).to(dtype)
    x[1, 5] = x[1, CHUNK + 3] = x[1, 2 * CHUNK + 1] = 40.0  # ties across chunks: the first wins
    x[2, :] = float("-inf")  # every token banned: index 0, as torch
    x[3, :] = float("-inf")
    x[3, v - 1] = 1.0  # the max in the partial last chunk
    x[4, CHUNK + 9] = x[4, CHUNK + 2] = 50.0  # a tie inside one chunk
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, argmax_rows_reference(x))
    assert got.tolist()[1:] == [5, 0, v - 1, CHUNK + 2]


def test_argmax_rows_rejects_bad_arguments(device):
    with pytest.raises(ValueError, match="x"):
        argmax_rows(torch.randn(3, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows(torch.randn(8, 4, device=device).T)
    with pytest.raises(ValueError, match="x"):
        argmax_rows(torch.zeros(2, 5, dtype=torch.int64, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 160])
def test_argmax_rows_real_vocab_gpu(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.randn(rows, 128256, device="cuda")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_counts_nan_as_the_maximum_and_stays_in_range(device):
    x = torch.randn(3, 2 * CHUNK + 5, device=device)
    x[0, :] = float("nan")  # every entry NaN: index 0, as torch
    x[1, CHUNK + 7] = float("nan")  # one NaN among finite values: its index, as torch
    x[2, :] = float("nan")
    x[2, 2 * CHUNK + 1] = 3.0
    got = argmax_rows(x)
    assert got.tolist()[:2] == argmax_rows_reference(x).tolist()[:2] == [0, CHUNK + 7]
    assert 0 <= got[2] < x.shape[1]
