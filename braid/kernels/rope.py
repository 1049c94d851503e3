"""Rotary position embedding applied to q and k in place.

The cos/sin cache is the one braid builds (`RotaryEmbedding.cos`, `.sin`: [max_positions,
rot_dim], the halves duplicated, any frequency scaling such as Llama 3's already folded in), or
the single-tensor layout vLLM and SGLang use ([max_positions, rot_dim] = cos half | sin half).
One program rotates every head of one token: cos/sin are read once per token.

With `store=(v, k_cache, v_cache, loc)` the same program also writes the token's rotated K and
its V into the KV pool at slot `loc[t]` (what `store_kv` does), so a layer's attention needs no
separate store kernel: at batch-1 decode of an 8B model each of those is a launch whose cost is
its latency, not its work, 32 per step (measured: docs/benchmarks.md, Figures behind design
choices). An fp8 pool gets the rotated K and the V quantized as `store_kv` quantizes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, next_pow2
from braid.kernels.kv_store import check_store_kv_args, quantize_e4m3
from braid.kernels.reference import KV_FP8_DTYPE, kv_inverse_scale


@triton.jit
def _rotary_kernel(
    Q,
    K,
    Positions,
    Cos,
    Sin,
    V,
    KCache,
    VCache,
    Loc,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    stride_vt,
    stride_vh,
    k_inv,
    v_inv,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NEOX: tl.constexpr,
    STORE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    c = tl.load(Cos + pos * stride_cos + offs, mask=mask_d, other=0.0).to(tl.float32)
    s = tl.load(Sin + pos * stride_sin + offs, mask=mask_d, other=0.0).to(tl.float32)
    if NEOX:
        o1 = offs
        o2 = offs + HALF
    else:
        o1 = 2 * offs
        o2 = 2 * offs + 1

    hq = tl.arange(0, BLOCK_HQ)
    mq = (hq < NUM_Q)[:, None] & mask_d[None, :]
    pq = Q + t * stride_qt + hq[:, None] * stride_qh
    x1 = tl.load(pq + o1[None, :], mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(pq + o2[None, :], mask=mq, other=0.0).to(tl.float32)
    tl.store(pq + o1[None, :], x1 * c[None, :] - x2 * s[None, :], mask=mq)
    tl.store(pq + o2[None, :], x2 * c[None, :] + x1 * s[None, :], mask=mq)

    hk = tl.arange(0, BLOCK_HK)
    mk = (hk < NUM_K)[:, None] & mask_d[None, :]
    pk = K + t * stride_kt + hk[:, None] * stride_kh
    y1 = tl.load(pk + o1[None, :], mask=mk, other=0.0).to(tl.float32)
    y2 = tl.load(pk + o2[None, :], mask=mk, other=0.0).to(tl.float32)
    r1 = (y1 * c[None, :] - y2 * s[None, :]).to(K.dtype.element_ty)
    r2 = (y2 * c[None, :] + y1 * s[None, :]).to(K.dtype.element_ty)
    tl.store(pk + o1[None, :], r1, mask=mk)
    tl.store(pk + o2[None, :], r2, mask=mk)
    if STORE:
        # The pool row of this token: [kv_heads, head_dim], contiguous.
        slot = tl.load(Loc + t).to(tl.int64)
        row = hk[:, None] * HEAD_DIM
        pck = KCache + slot * (NUM_K * HEAD_DIM) + row
        if FP8:
            fp8 = KCache.dtype.element_ty
            tl.store(pck + o1[None, :], quantize_e4m3(r1.to(tl.float32), k_inv).to(fp8), mask=mk)
            tl.store(pck + o2[None, :], quantize_e4m3(r2.to(tl.float32), k_inv).to(fp8), mask=mk)
        else:
            tl.store(pck + o1[None, :], r1, mask=mk)
            tl.store(pck + o2[None, :], r2, mask=mk)
        if BLOCK_REST > 0:
            # Dimensions past the rotary dims pass through unrotated.
            rest = 2 * HALF + tl.arange(0, BLOCK_REST)
            mr = (hk < NUM_K)[:, None] & (rest < HEAD_DIM)[None, :]
            kr = tl.load(pk + rest[None, :], mask=mr)
            if FP8:
                kr = quantize_e4m3(kr.to(tl.float32), k_inv).to(KCache.dtype.element_ty)
            tl.store(pck + rest[None, :], kr, mask=mr)
        offs_d = tl.arange(0, BLOCK_D)
        mv = (hk < NUM_K)[:, None] & (offs_d < HEAD_DIM)[None, :]
        pv = V + t * stride_vt + hk[:, None] * stride_vh + offs_d[None, :]
        pcv = VCache + slot * (NUM_K * HEAD_DIM) + row + offs_d[None, :]
        vr = tl.load(pv, mask=mv)
        if FP8:
            vr = quantize_e4m3(vr.to(tl.float32), v_inv).to(VCache.dtype.element_ty)
        tl.store(pcv, vr, mask=mv)


def _cos_sin(
    cos_sin_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, rot_dim): cos and sin are views whose first rot_dim // 2 columns are used."""
    if isinstance(cos_sin_cache, tuple):
        if len(cos_sin_cache) != 2:
            raise ValueError("cos_sin_cache as a tuple must be (cos, sin)")
        cos, sin = cos_sin_cache
        check_tensor("cos_sin_cache[0]", cos, ndim=2, dtypes=FLOAT_DTYPES, device=device)
        check_tensor("cos_sin_cache[1]", sin, ndim=2, dtypes=FLOAT_DTYPES, device=device)
        if cos.shape != sin.shape:
            raise ValueError(f"cos shape {tuple(cos.shape)} != sin shape {tuple(sin.shape)}")
        return cos, sin, cos.shape[1]
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    rot_dim = cos_sin_cache.shape[1]
    return cos_sin_cache, cos_sin_cache[:, rot_dim // 2 :], rot_dim


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    is_neox: bool = True,
    *,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q` [tokens, heads, head_dim] and `k` [tokens, kv_heads, head_dim] in place by
    `positions` (int32/int64 [tokens]); returns `(q, k)`.

    `cos_sin_cache`: `(cos, sin)` as `RotaryEmbedding` holds them, each [max_positions,
    rot_dim], or one [max_positions, rot_dim] tensor = cat(cos half, sin half). The first
    rot_dim (even, <= head_dim) dimensions of each head are rotated, the rest left alone.
    `is_neox`: rotate-half pairing (i, i + rot_dim/2) as Llama and `apply_rotary` do; False:
    adjacent pairs (2i, 2i + 1), GPT-J style. Math runs in float32 and rounds once to q's
    dtype. Every position must be < max_positions. q and k need unit stride in head_dim; their
    token and head strides may be anything (slices of a fused QKV output work).

    `store=(v, k_cache, v_cache, loc)` also writes each token's rotated k and its v into the
    pool, as `store_kv(k_cache, v_cache, k, v, loc, k_scale=, v_scale=)` would after
    rotating (same arguments, same checks); `kv_scales` = (k_scale, v_scale) of an fp8 pool.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    tokens, num_q, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"k shape {tuple(k.shape)} must be [{tokens}, kv_heads, {head_dim}] (q's tokens "
            "and head_dim)"
        )
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if positions.shape[0] != tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries, q has {tokens} tokens")
    cos, sin, rot_dim = _cos_sin(cos_sin_cache, device)
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(f"rotary dim {rot_dim} must be even and in [2, head_dim={head_dim}]")
    if store is not None:
        if len(store) != 4:
            raise ValueError("store must be (v, k_cache, v_cache, loc)")
        v, k_cache, v_cache, loc = store
        check_store_kv_args(k_cache, v_cache, k, v, loc)
        fp8 = k_cache.dtype == KV_FP8_DTYPE
    else:
        v = k_cache = v_cache = loc = k
        fp8 = False
    k_inv, v_inv = (1.0, 1.0)
    if fp8:
        k_inv, v_inv = kv_inverse_scale(kv_scales[0]), kv_inverse_scale(kv_scales[1])
    if tokens == 0:
        return q, k
    half = rot_dim // 2
    _rotary_kernel[(tokens,)](
        q,
        k,
        positions,
        cos,
        sin,
        v,
        k_cache,
        v_cache,
        loc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        v.stride(0),
        v.stride(1),
        k_inv,
        v_inv,
        NUM_Q=num_q,
        NUM_K=k.shape[1],
        BLOCK_HQ=next_pow2(num_q),
        BLOCK_HK=next_pow2(k.shape[1]),
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        NEOX=bool(is_neox),
        STORE=store is not None,
        HEAD_DIM=head_dim,
        BLOCK_REST=0 if rot_dim == head_dim else next_pow2(head_dim - rot_dim),
        BLOCK_D=next_pow2(head_dim),
        FP8=fp8,
        num_warps=4,
    )
    return q, k


def rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `rotary` computes, out of place, in float32 then q's / k's dtype."""
    if isinstance(cos_sin_cache, tuple):
        cos_t, sin_t = cos_sin_cache
        half = cos_t.shape[1] // 2
    else:
        half = cos_sin_cache.shape[1] // 2
        cos_t, sin_t = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
    cos = cos_t[positions.long(), :half].float()[:, None, :]
    sin = sin_t[positions.long(), :half].float()[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        y = x.float().clone()
        if is_neox:
            x1, x2 = y[..., :half], y[..., half : 2 * half]
        else:
            x1, x2 = y[..., 0 : 2 * half : 2], y[..., 1 : 2 * half : 2]
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if is_neox:
            y[..., :half], y[..., half : 2 * half] = r1, r2
        else:
            y[..., 0 : 2 * half : 2], y[..., 1 : 2 * half : 2] = r1, r2
        return y.to(x.dtype)

    return rot(q), rot(k)
