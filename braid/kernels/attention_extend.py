"""Extend (prefill) attention over a ragged batch with cached prefixes.

Request b has `prefix_lens[b]` tokens already in the KV pool (read through the
request-to-token table) and `extend_lens[b]` new tokens, laid end to end in `q`, `k`, `v`
from row `extend_start_loc[b]`. Each new token attends to the whole prefix and causally to the
new tokens up to itself (optionally only the last `window` positions). One program computes
one block of `BLOCK_M` new tokens of one request for one query head, with an online softmax:
first over the prefix, read from the pool, then over the new keys, read from `k` and `v`
directly, so the new tokens need not be in the pool yet.

The packed form (`ExtendConfig.pack`) runs one program per KV head instead: its query tile holds
the `BLOCK_M` new tokens of every one of the GROUP query heads that share the KV head, so each
key and value block is loaded once for GROUP heads and each `tl.dot` is GROUP times taller,
which pays where a program's own work is small (many short extends). `BLOCK_M` counts new tokens
per program in both forms (the grid, the causal split and the rule that BLOCK_N divides BLOCK_M
are the same); a packed tile has `BLOCK_M * GROUP` rows, token-major: row r is token
`m_start + r // GROUP` of query head `kvh * GROUP + r % GROUP`. Token-major because that is the
order of `q` and `out` in memory ([tokens, heads, head_dim]: the GROUP heads of one token are
adjacent, so the tile is `BLOCK_M` contiguous runs of GROUP rows) and because the rows stay
sorted by position, so every mask is a function of the row's token index alone, as in the
unpacked tile. Packing needs GROUP a power of two (the tile's rows are a `tl.arange`) and at most
`MAX_TILE_ROWS` rows; a GROUP of 1 packs to the unpacked kernel. The configurations and how
a launch picks one: `extend_config.py`.

With an fp8 pool (`float8_e4m3fn`, a K and a V scale) the prefix is read as `decode_attention`
reads it (each value converted to q's dtype, the K scale folded into the scores' scale, the V
scale applied to the output), and the new tokens' keys and values are rounded through e4m3
exactly as `store_kv` stores them before they are used: every token attends to the same
quantized K/V whether its prefix came from the cache or from this extend, so chunked prefill
and prefix-cache hits do not change the result. (vLLM attends to the new tokens unquantized;
braid does not, for that reason.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from braid.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2E,
    check_index,
    check_paged_kv,
    check_shape,
    check_tensor,
    check_window,
    dot_precision,
    next_pow2,
)
from braid.kernels.extend_config import ExtendConfig, launch_config
from braid.kernels.kv_store import quantize_e4m3
from braid.kernels.reference import (
    KV_FP8_DTYPE,
    dequantize_kv_reference,
    kv_inverse_scale,
    quantize_kv_reference,
)

_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _softmax_step(
    q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_PREC: tl.constexpr, MASKED: tl.constexpr
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
    if MASKED:  # a block every query of which sees every key needs no mask
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _load_cached(
    KCache,
    VCache,
    table_row,
    offs_n,
    mask_n,
    kvh,
    offs_d,
    mask_d,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    dtype: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Keys and values of prefix positions `offs_n` from the pool, through the table row
    (`mask_n` None: every position is inside the prefix)."""
    if mask_n is None:
        loc = tl.load(table_row + offs_n).to(tl.int64)
        kv_mask = mask_d[None, :]
    else:
        loc = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(
        KCache + loc[:, None] * stride_kcs + kvh * stride_kch + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        VCache + loc[:, None] * stride_vcs + kvh * stride_vch + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if KV_FP8:
        k = k.to(dtype)
        v = v.to(dtype)
    return k, v


@triton.jit
def _load_new(
    K,
    V,
    q_start,
    offs_n,
    mask_n,
    kvh,
    offs_d,
    mask_d,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    k_inv,
    v_inv,
    dtype: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Keys and values of this extend's tokens `offs_n`, read from `k` and `v` (`mask_n` None:
    every one exists); with an fp8 pool, as the pool will hold them (unscaled: the scales
    apply as for the prefix)."""
    if mask_n is None:
        kv_mask = mask_d[None, :]
    else:
        kv_mask = mask_n[:, None] & mask_d[None, :]
    rows_n = q_start + offs_n
    k = tl.load(
        K + rows_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + rows_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if KV_FP8:
        k = quantize_e4m3(k.to(tl.float32), k_inv).to(dtype)
        v = quantize_e4m3(v.to(tl.float32), v_inv).to(dtype)
    return k, v


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    KCache,
    VCache,
    O,
    ReqToToken,
    ReqIdx,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    scale_log2,
    k_inv,
    v_inv,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ot,
    stride_oh,
    stride_rt,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program: `BLOCK_M` new tokens of request b for `HEADS` query heads (1: the head
    `program_id(1)`; GROUP, packed: every head of the KV head `program_id(1)`), one tile row per
    (token, head), token-major."""
    b = tl.program_id(0)
    # The last blocks of queries first: they see the most keys, so a long prompt's slowest
    # programs start first rather than trailing the launch.
    m_start = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    if m_start >= ext_len:
        return
    kvh = tl.program_id(1) * HEADS // GROUP
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(ExtendStart + b).to(tl.int64)
    row = tl.load(ReqIdx + b).to(tl.int64)

    # Each row's token (its index among the request's new tokens) and query head.
    if HEADS == 1:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        head = tl.program_id(1)
    else:
        rows = tl.arange(0, BLOCK_M * HEADS)
        offs_m = m_start + rows // HEADS
        head = tl.program_id(1) * HEADS + rows % HEADS
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m) * stride_qt + head * stride_qh
    q = tl.load(
        Q + q_rows[:, None] + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M * HEADS], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, BLOCK_D], dtype=tl.float32)

    # The cached prefix: every new token sees all of it (within the window).
    q_pos = prefix + offs_m
    table_row = ReqToToken + row * stride_rt
    if USE_WINDOW:
        lo = tl.maximum(prefix + m_start - window + 1, 0)
        for n0 in range(lo, prefix, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix
            k, v = _load_cached(
                KCache,
                VCache,
                table_row,
                offs_n,
                mask_n,
                kvh,
                offs_d,
                mask_d,
                stride_kcs,
                stride_kch,
                stride_vcs,
                stride_vch,
                q.dtype,
                KV_FP8,
            )
            visible = mask_n[None, :] & (q_pos[:, None] - offs_n[None, :] < window)
            m_i, l_i, acc = _softmax_step(
                q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_PREC, True
            )
    else:
        full = prefix - prefix % BLOCK_N
        for n0 in range(0, full, BLOCK_N):  # whole blocks: no mask
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, v = _load_cached(
                KCache,
                VCache,
                table_row,
                offs_n,
                None,
                kvh,
                offs_d,
                mask_d,
                stride_kcs,
                stride_kch,
                stride_vcs,
                stride_vch,
                q.dtype,
                KV_FP8,
            )
            m_i, l_i, acc = _softmax_step(q, k, v, None, m_i, l_i, acc, scale_log2, DOT_PREC, False)
        for n0 in range(full, prefix, BLOCK_N):  # the partial last block, if any
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix
            k, v = _load_cached(
                KCache,
                VCache,
                table_row,
                offs_n,
                mask_n,
                kvh,
                offs_d,
                mask_d,
                stride_kcs,
                stride_kch,
                stride_vcs,
                stride_vch,
                q.dtype,
                KV_FP8,
            )
            m_i, l_i, acc = _softmax_step(
                q, k, v, mask_n[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, True
            )

    # The new tokens, causally: keys up to the last query of this block.
    hi = tl.minimum(ext_len, m_start + BLOCK_M)
    if USE_WINDOW:
        lo = tl.maximum(m_start - window + 1, 0)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            k, v = _load_new(
                K,
                V,
                q_start,
                offs_n,
                mask_n,
                kvh,
                offs_d,
                mask_d,
                stride_kt,
                stride_kh,
                stride_vt,
                stride_vh,
                k_inv,
                v_inv,
                q.dtype,
                KV_FP8,
            )
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            visible = visible & (offs_m[:, None] - offs_n[None, :] < window)
            m_i, l_i, acc = _softmax_step(
                q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_PREC, True
            )
    else:
        # Keys before this block of queries are seen by all of them (BLOCK_N divides BLOCK_M,
        # so these blocks end at m_start); the diagonal blocks are masked.
        for n0 in range(0, m_start, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, v = _load_new(
                K,
                V,
                q_start,
                offs_n,
                None,
                kvh,
                offs_d,
                mask_d,
                stride_kt,
                stride_kh,
                stride_vt,
                stride_vh,
                k_inv,
                v_inv,
                q.dtype,
                KV_FP8,
            )
            m_i, l_i, acc = _softmax_step(q, k, v, None, m_i, l_i, acc, scale_log2, DOT_PREC, False)
        for n0 in range(m_start, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            k, v = _load_new(
                K,
                V,
                q_start,
                offs_n,
                mask_n,
                kvh,
                offs_d,
                mask_d,
                stride_kt,
                stride_kh,
                stride_vt,
                stride_vh,
                k_inv,
                v_inv,
                q.dtype,
                KV_FP8,
            )
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            m_i, l_i, acc = _softmax_step(
                q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_PREC, True
            )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    o_rows = (q_start + offs_m) * stride_ot + head * stride_oh
    tl.store(
        O + o_rows[:, None] + offs_d[None, :],
        out,
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    out: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    config: ExtendConfig | Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix and themselves.

    `q`: [tokens, heads, head_dim]; `k`, `v`: [tokens, kv_heads, head_dim] (the new tokens'
    keys and values; any token stride, unit stride in head_dim), all of the caches' dtype;
    `k_cache`, `v_cache`: contiguous [slots, kv_heads, head_dim]; `req_to_token`: int32/int64
    [rows, max_context]; `req_pool_indices`, `prefix_lens`, `extend_lens`, `extend_start_loc`:
    int32/int64 [batch] on q's device. Request b's new tokens are rows
    `extend_start_loc[b] : extend_start_loc[b] + extend_lens[b]` of q/k/v, at positions
    `prefix_lens[b] + i`; its prefix KV slots are `req_to_token[req_pool_indices[b],
    :prefix_lens[b]]` (the prefix is only read from the pool, the new tokens only from k/v).
    `window`: a key at position p is visible to a query at position t iff t - window < p <= t.

    `max_extend_len` (a host int >= every extend_lens[b]) sizes the grid; when None it is read
    from `extend_lens` (one host synchronisation). Rows of `out` ([tokens, heads, head_dim],
    q's dtype) that belong to no request are left untouched. Returns the output.

    `k_cache` and `v_cache` may instead be float8_e4m3fn (an fp8 KV cache, with `k_scale`
    and `v_scale`; ignored for a float cache): the prefix is dequantized, and the new tokens
    are used as the cache would store them (see the module's docstring).

    `config` replaces the launch configuration tuned for this GPU (or the built-in default): an
    `ExtendConfig` or its fields, (BLOCK_M, BLOCK_N, num_warps, num_stages) for one program per
    query head or (BLOCK_M, BLOCK_N, num_warps, num_stages, 1) for the packed form, one program
    per KV head (benchmarks/tune_extend.py sweeps both). One that breaks `ExtendConfig`'s rules,
    or asks to pack where GROUP (query heads per KV head) is not a power of two or
    `BLOCK_M * GROUP` exceeds `MAX_TILE_ROWS`, raises `ValueError`.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    tokens, num_heads, _ = q.shape
    device = q.device
    kv_heads, head_dim = check_paged_kv(q, k_cache, v_cache, req_to_token, num_heads)
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    k_inv, v_inv = (kv_inverse_scale(k_scale), kv_inverse_scale(v_scale)) if fp8 else (1.0, 1.0)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtypes=(q.dtype,), device=device)
        check_shape(name, t, (tokens, kv_heads, head_dim))
    check_tensor("extend_lens", extend_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    batch = extend_lens.shape[0]
    check_index("req_pool_indices", req_pool_indices, batch, device)
    check_index("prefix_lens", prefix_lens, batch, device)
    check_index("extend_start_loc", extend_start_loc, batch, device)
    win = check_window(window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=device)
        check_shape("out", out, tuple(q.shape))
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max()) if batch > 0 else 0
    elif not isinstance(max_extend_len, int) or max_extend_len < 0:
        raise ValueError(f"max_extend_len must be a non-negative integer, got {max_extend_len!r}")
    group = num_heads // kv_heads
    if config is None:
        config = launch_config(head_dim, q.dtype, device, group)
    elif not isinstance(config, ExtendConfig):
        config = ExtendConfig.from_fields(config)
    unfit = config.unfit(group)
    if unfit is not None:
        raise ValueError(f"extend_attention: {unfit}")
    if batch == 0 or tokens == 0 or max_extend_len == 0:
        return out

    heads_per_program = group if config.pack else 1
    grid = (batch, num_heads // heads_per_program, triton.cdiv(max_extend_len, config.block_m))
    _extend_kernel[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        sm_scale * LOG2E * (k_scale if fp8 else 1.0),
        k_inv,
        v_inv,
        v_scale,
        win,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEADS=heads_per_program,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        USE_WINDOW=win > 0,
        DOT_PREC=dot_precision(q.dtype),
        KV_FP8=fp8,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def extend_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """What `extend_attention` computes, request by request in float32; output in q's dtype
    (rows of no request are zero). With an fp8 cache, every key and value (the prefix's and
    the new tokens', quantized as the cache stores them) is dequantized with its scale."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    if k_cache.dtype == KV_FP8_DTYPE:
        k_cache = dequantize_kv_reference(k_cache, k_scale, torch.float32)
        v_cache = dequantize_kv_reference(v_cache, v_scale, torch.float32)
        k = dequantize_kv_reference(quantize_kv_reference(k, k_scale), k_scale, torch.float32)
        v = dequantize_kv_reference(quantize_kv_reference(v, v_scale), v_scale, torch.float32)
    for b in range(extend_lens.shape[0]):
        prefix, n, s0 = int(prefix_lens[b]), int(extend_lens[b]), int(extend_start_loc[b])
        slots = req_to_token[int(req_pool_indices[b]), :prefix].long()
        kk = torch.cat([k_cache[slots], k[s0 : s0 + n]]).float().repeat_interleave(group, 1)
        vv = torch.cat([v_cache[slots], v[s0 : s0 + n]]).float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,nhd->htn", q[s0 : s0 + n].float(), kk) * sm_scale
        q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        k_pos = torch.arange(prefix + n, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s0 : s0 + n] = torch.einsum("htn,nhd->thd", scores.softmax(-1), vv).to(q.dtype)
    return out
