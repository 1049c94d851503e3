"""Write new tokens' K and V rows into the KV pool at their slots.

The pool layout is `KVPool`'s: one [slots, kv_heads, head_dim] buffer per layer for K and one
for V. A token's row (kv_heads * head_dim values) is contiguous in the pool, so one program
copies one token's row (in chunks of `BLOCK`) for K and V together.

An fp8 pool (`float8_e4m3fn`) stores each value as clamp(x * (1 / scale), +-448) rounded to
e4m3, bit for bit what torch's clamp and cast give (`quantize_kv_reference`). The rounding is
done on float32 bits (`quantize_e4m3`, with `fp8_quant`'s rounding), not by Triton's cast alone:
the CPU interpreter's cast does not round as a GPU does (it flushes e4m3 subnormals to zero),
and the same bits on every device are worth a few integer operations in a kernel bound by
memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    next_pow2,
)
from braid.kernels.fp8_quant import _round_to_e4m3
from braid.kernels.reference import KV_FP8_DTYPE, kv_inverse_scale, quantize_kv_reference

KV_CACHE_DTYPES = (*FLOAT_DTYPES, KV_FP8_DTYPE)


@triton.jit
def quantize_e4m3(x, inverse_scale):
    """float32 `x` -> clamp(x * inverse_scale, +-448) rounded to the nearest e4m3 value (ties
    to even), as float32: the cast to fp8 that follows is exact."""
    return _round_to_e4m3(tl.minimum(tl.maximum(x * inverse_scale, -448.0), 448.0))


@triton.jit
def _store_kv_kernel(
    KCache,
    VCache,
    K,
    V,
    Loc,
    stride_kt,
    stride_vt,
    k_inv,
    v_inv,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
    if FP8:
        k = quantize_e4m3(k.to(tl.float32), k_inv).to(KCache.dtype.element_ty)
        v = quantize_e4m3(v.to(tl.float32), v_inv).to(VCache.dtype.element_ty)
    tl.store(KCache + slot * ROW + offs, k, mask=mask)
    tl.store(VCache + slot * ROW + offs, v, mask=mask)


def _check_rows(name: str, t: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    check_tensor(name, t, ndim=3, dtypes=FLOAT_DTYPES)
    if tuple(t.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(
            f"{name} must have shape [n, {kv_heads}, {head_dim}] (the pool's), got {tuple(t.shape)}"
        )
    # Each token's [kv_heads, head_dim] block must be one contiguous row (the token stride may
    # be anything: k and v are often column slices of a fused QKV output).
    if t.shape[0] > 0 and t.stride(1) != head_dim and kv_heads > 1:
        raise ValueError(f"{name} must be contiguous within a token, got strides {t.stride()}")


def check_store_kv_args(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
) -> int:
    """Check `store_kv`'s arguments (ValueError naming the bad one); returns the row count."""
    check_tensor("k_cache", k_cache, ndim=3, dtypes=KV_CACHE_DTYPES)
    device = k_cache.device
    check_tensor("v_cache", v_cache, ndim=3, device=device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    _, kv_heads, head_dim = k_cache.shape
    _check_rows("k", k, kv_heads, head_dim)
    _check_rows("v", v, kv_heads, head_dim)
    for name, t in (("k", k), ("v", v)):
        if k_cache.dtype == KV_FP8_DTYPE:  # rows of any float dtype are quantized
            check_same_dtype(name, t, "k", k)
        else:
            check_same_dtype(name, t, "k_cache", k_cache)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
    n = k.shape[0]
    check_tensor("loc", loc, ndim=1, dtypes=(torch.int64,), device=device)
    check_shape("v", v, tuple(k.shape))
    if loc.shape[0] != n:
        raise ValueError(f"loc has {loc.shape[0]} entries, but k has {n} rows")
    return n


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`k_cache[loc[i]] = k[i]` and `v_cache[loc[i]] = v[i]` for every i, in place.

    `k_cache`, `v_cache`: contiguous [slots, kv_heads, head_dim] (one layer of `KVPool`);
    `k`, `v`: [n, kv_heads, head_dim] of the cache's dtype (any float dtype for an fp8 cache),
    contiguous within each token; `loc`: int64 [n] slot indices on the same device, each in
    [0, slots). Slots in `loc` should be distinct (a repeated slot gets one of the writes). No
    host synchronisation. An fp8 cache (`float8_e4m3fn`) gets `quantize_kv_reference(k,
    k_scale)` and `quantize_kv_reference(v, v_scale)`, bit for bit; the scales are ignored
    for a float cache.
    """
    n = check_store_kv_args(k_cache, v_cache, k, v, loc)
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    k_inv, v_inv = (kv_inverse_scale(k_scale), kv_inverse_scale(v_scale)) if fp8 else (1.0, 1.0)
    kv_heads, head_dim = k_cache.shape[1:]
    if n == 0:
        return
    row = kv_heads * head_dim
    block = min(next_pow2(row), 4096)
    grid = (n, triton.cdiv(row, block))
    _store_kv_kernel[grid](
        k_cache,
        v_cache,
        k,
        v,
        loc,
        k.stride(0),
        v.stride(0),
        k_inv,
        v_inv,
        ROW=row,
        BLOCK=block,
        FP8=fp8,
        num_warps=4,
    )


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """What `store_kv` does, in plain torch (`KVPool.store`)."""
    if k_cache.dtype == KV_FP8_DTYPE:
        k, v = quantize_kv_reference(k, k_scale), quantize_kv_reference(v, v_scale)
    k_cache[loc] = k
    v_cache[loc] = v
