"""Paged decode attention: one new query token per request over its whole KV, read through
the request-to-token table, split along the sequence (split-K).

Stage 1 runs one program per (request, KV head and block of its query heads, split): the
query heads that share a KV head (GQA) are one [BLOCK_H, head_dim] block, so each K/V row
is read once per group and the scores are one matrix product. Each program writes its split's
normalised partial output and log-sum-exp (base 2) into a float32 workspace. Stage 2 runs one
program per (request, head) and merges the splits. The grid depends only on the batch size,
the head counts and `num_kv_splits`, never on sequence lengths, and nothing is read back to
the host, so a decode step can be captured in a CUDA graph.

Tree verification (speculative decoding) gives a row a tail: its first `prefix[b]` keys come
from its table row and the rest from `tail[b]` (the slots of a draft node's ancestors and its
own), so rows of one request see different branches of a draft tree through one table row.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from braid.kernels import pdl
from braid.kernels._checks import (
    FLOAT_DTYPES,
    LOG2E,
    check_contiguous,
    check_index,
    check_paged_kv,
    check_shape,
    check_tensor,
    check_window,
    cuda_device_name,
    dot_precision,
    next_pow2,
    tuned_configs,
)
from braid.kernels.extend_config import tuned_key
from braid.kernels.reference import KV_FP8_DTYPE, dequantize_kv_reference

# Online-softmax running max starts finite: a block whose keys are all masked for a row then
# gives exp2(-inf - m) = 0, not exp2(-inf + inf) = NaN.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _fp8_words_as_f16(
    Cache,
    loc,
    stride_s,
    head_off,
    mask_n,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PTX: tl.constexpr,
    EVICT: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_D] block of an e4m3 cache as float16 (exact), read as 32-bit words
    (four codes each) and converted in registers before `tl.dot`'s layout change, so the dot
    operand goes through shared memory as float16 (ldmatrix) rather than as bytes read one
    small load at a time. `PTX`: two cvt.rn.f16x2.e4m3x2 per word; else (the interpreter) the
    same values through Triton's own conversion."""
    words = tl.load(
        Cache.to(tl.pointer_type(tl.int32))
        + loc[:, None] * (stride_s // 4)
        + head_off // 4
        + tl.arange(0, BLOCK_D // 4)[None, :],
        mask=mask_n[:, None],
        other=0,
        eviction_policy=EVICT,
    )
    if PTX:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 r0, r1; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 r0, lo; cvt.rn.f16x2.e4m3x2 r1, hi; "
            "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; }",
            "=h,=h,=h,=h,r",
            [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        b0 = _fp8_byte(words, 0)
        b1 = _fp8_byte(words, 8)
        b2 = _fp8_byte(words, 16)
        b3 = _fp8_byte(words, 24)
    # Byte i of word w is element 4w + i: join puts (b0, b2) and (b1, b3) side by side, then
    # each pair again, so the last axis reads b0 b1 b2 b3.
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, BLOCK_D])


@triton.jit
def _fp8_byte(words, SHIFT: tl.constexpr):
    code = ((words >> SHIFT) & 0xFF).to(tl.uint8)
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _kv_block(
    Cache,
    loc,
    stride_s,
    head_off,
    offs_d,
    mask_n,
    mask_d,
    q_dtype: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    FP8_WORDS: tl.constexpr,
    PTX: tl.constexpr,
    EVICT: tl.constexpr,
):
    """The keys or values of slots `loc` for one KV head, as the dot products take them: an
    fp8 cache's codes as float16 (`FP8_AS_F16`; from words with `FP8_WORDS`) or q's dtype.
    `EVICT`: the loads' L2 eviction policy ("" or "evict_first")."""
    if FP8_WORDS:
        return _fp8_words_as_f16(
            Cache, loc, stride_s, head_off, mask_n, BLOCK_N, BLOCK_D, PTX, EVICT
        )
    x = tl.load(
        Cache + loc[:, None] * stride_s + head_off + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
        eviction_policy=EVICT,
    )
    if FP8_AS_F16:
        x = x.to(tl.float16)  # e4m3 pairs convert in one instruction, exactly
    elif KV_FP8:
        x = x.to(q_dtype)
    return x


@triton.jit
def _decode_stage1(
    Q,
    KCache,
    VCache,
    ReqToToken,
    ReqIdx,
    SeqLens,
    Prefix,
    Tail,
    MidO,
    MidLse,
    scale_log2,
    v_scale,
    window,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    stride_tail,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    H_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    FP8_WORDS: tl.constexpr,
    PTX: tl.constexpr,
    EVICT: tl.constexpr,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid_h // H_BLOCKS
    offs_g = (pid_h % H_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    row = tl.load(ReqIdx + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    lo = seq_len * 0
    if USE_WINDOW:
        # The query sits at position seq_len - 1 and sees keys p with (seq_len - 1) - p < window.
        lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(seq_len - lo, NUM_SPLITS)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table_row = ReqToToken + row * stride_rt
    if HAS_TAIL:
        prefix = tl.load(Prefix + b).to(tl.int32)
        tail_row = Tail + b.to(tl.int64) * stride_tail
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if HAS_TAIL:
            in_table = offs_n < prefix
            from_table = tl.load(table_row + offs_n, mask=mask_n & in_table, other=0)
            from_tail = tl.load(tail_row + (offs_n - prefix), mask=mask_n & ~in_table, other=0)
            loc = tl.where(in_table, from_table, from_tail).to(tl.int64)
        else:
            loc = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = _kv_block(
            KCache, loc, stride_ks, kvh * stride_kh, offs_d, mask_n, mask_d, q.dtype,
            BLOCK_N, BLOCK_D, KV_FP8, FP8_AS_F16, FP8_WORDS, PTX, EVICT,
        )  # fmt: skip
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PREC) * scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_block(
            VCache, loc, stride_vs, kvh * stride_vh, offs_d, mask_n, mask_d, q.dtype,
            BLOCK_N, BLOCK_D, KV_FP8, FP8_AS_F16, FP8_WORDS, PTX, EVICT,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptr = MidO + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_ptr + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO,
    MidLse,
    O,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    pdl.trigger(TRIGGER)  # o_proj after may start loading its weights (`braid.kernels.pdl`)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    # Empty splits carry lse = -inf and weigh 0; the floor keeps an all-empty row finite.
    m = tl.maximum(tl.max(lse, 0), _M_INIT)
    w = tl.exp2(lse - m)
    o = tl.load(
        MidO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1.0e-30)
    tl.store(O + b * stride_outb + h * stride_outh + offs_d, out, mask=mask_d)


def _stage1_config(block_d: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel for a head dim block. For head dim
    128 on an H200 (`benchmarks/tune_attention.py`), three stages of 64 keys were as fast as the
    best of 18 configs, within noise, at batch 32 x 4096, 256 x 640 and 1024 x 640 keys, and
    clearly faster than the first choice of two stages (measured: docs/benchmarks.md, Figures
    behind design choices). Head dim 256 keeps 32 keys and two stages (its tiles are twice as
    large; not measured)."""
    if block_d >= 256:
        return 32, 4, 2
    return 64, 4, 3


# (BLOCK_N, num_warps, num_stages) of the split kernel measured per GPU, head size and KV dtype
# (`benchmarks/tune_attention.py --kv-dtype ... --write-config`); the built-in choice where
# there is none. An fp8 block of keys is half a 16-bit one's bytes, so a 16-bit cache's best
# block need not be fp8's. Keyed as the extend kernel's table ("128/float8_e4m3fn": `tuned_key`).
TUNED_CONFIGS = Path(__file__).parent / "configs" / "decode_attention.json"


# An fp8 cache's conversion (a config's optional 4th field): to q's dtype, to float16, or to
# float16 from 32-bit words.
_FP8_MODES = (0, 1, 2)
_FOURTH_FIELDS = ([], *([m] for m in _FP8_MODES))  # a tuned entry's optional fp8 mode


@functools.cache
def _tuned(device_name: str, key: str) -> tuple[int, ...] | None:
    fields = tuned_configs(TUNED_CONFIGS, device_name).get(key)
    if fields is None:
        return None
    ok = isinstance(fields, list) and len(fields) in (3, 4)
    ok = ok and all(type(f) is int for f in fields) and min(fields[:3]) >= 1
    ok = ok and not fields[0] & (fields[0] - 1) and not fields[1] & (fields[1] - 1)
    if not ok or fields[0] < 16 or fields[3:] not in _FOURTH_FIELDS:
        raise ValueError(
            f"tuned kernel configurations {TUNED_CONFIGS}: {key}: expected [BLOCK_N (a power "
            f"of two >= 16), num_warps (a power of two), num_stages] and, for an fp8 cache, 0, "
            f"1 (converted to float16) or 2 (read as words), got {fields!r}"
        )
    return tuple(fields)


def launch_config(
    head_dim: int, kv_dtype: torch.dtype, device: torch.device, q_dtype: torch.dtype
) -> tuple:
    """The split kernel's (BLOCK_N, num_warps, num_stages[, as_f16]): tuned for this GPU, head
    size and KV dtype where measured (`TUNED_CONFIGS`, swept with a 16-bit q), else
    `_stage1_config`'s by head size (a float32 q's tiles are twice as large: it keeps the
    built-in one)."""
    if device.type == "cuda" and q_dtype != torch.float32:
        tuned = _tuned(cuda_device_name(device.index), tuned_key(head_dim, kv_dtype))
        if tuned is not None:
            return tuned
    return _stage1_config(next_pow2(head_dim))


def workspace_numel(batch: int, num_heads: int, head_dim: int, num_kv_splits: int) -> int:
    """float32 elements `decode_attention` needs as `workspace` for these sizes."""
    return batch * num_heads * num_kv_splits * (head_dim + 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    num_kv_splits: int = 8,
    window: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    stage1_config: tuple[int, ...] | None = None,
    tree_prefix: torch.Tensor | None = None,
    tree_tail: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_evict_first: bool = False,
) -> torch.Tensor:
    """Attention of one query token per request over its first `seq_lens[b]` tokens.

    `q`: [batch, heads, head_dim] (unit stride in head_dim); `k_cache`, `v_cache`: contiguous
    [slots, kv_heads, head_dim] of q's dtype, with heads a multiple of kv_heads and
    head_dim >= 16; `req_to_token`: int32/int64 [rows, max_context], row-major with unit
    column stride, mapping (row, position) to a KV slot; `req_pool_indices`, `seq_lens`:
    int32/int64 [batch] on q's device. Request b reads slots
    `req_to_token[req_pool_indices[b], :seq_lens[b]]` (every one must be a valid slot); its
    query is at position seq_lens[b] - 1. With `window`, only the last `window` positions are
    attended (Mistral's sliding window). Each seq_len must be >= 1 (a row with 0 gives zeros).

    `num_kv_splits` (>= 1) is how many pieces each sequence is cut into; `out` ([batch, heads,
    head_dim] of q's dtype, unit stride in head_dim) and `workspace` (contiguous float32 with
    at least `workspace_numel(batch, heads, head_dim, num_kv_splits)` elements) are used when
    given, else allocated. `stage1_config` = (BLOCK_N, num_warps, num_stages[, as_f16]) of the
    split kernel overrides `launch_config`'s (for tuning sweeps: `benchmarks/tune_attention.py`);
    `as_f16` 1 converts an fp8 cache's values to float16 for a 16-bit q's dot products (exact
    for e4m3, and one instruction per pair) instead of to q's dtype; q then goes to float16
    too, which holds a bfloat16 q only within |q| < 65504 (a larger query becomes inf and its
    head's output NaN; attention queries stay far below it); 2 does the same from 32-bit
    words of four codes (fewer instructions per key, faster on an H200). The launch never
    synchronises with the host. Returns the output.

    `tree_prefix` (int32/int64 [batch]) and `tree_tail` (int32/int64 [batch, depth], unit
    column stride) go together: row b reads its first `tree_prefix[b]` slots from its table
    row and the next `seq_lens[b] - tree_prefix[b]` (at most depth) from `tree_tail[b]`. Not
    with `window`.

    `k_cache` and `v_cache` may instead be float8_e4m3fn (an fp8 KV cache, any q dtype): a
    stored value x stands for x * `k_scale` (keys) or x * `v_scale` (values); the scales are
    ignored for a float cache.

    `kv_evict_first` marks the key and value loads evict-first in L2 (each is read once per
    step): what the cache leaves to kernels running beside this one (`benchmarks/
    overlap_probe.py` measures it); the runtime leaves it off.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    batch, num_heads, _ = q.shape
    device = q.device
    kv_heads, head_dim = check_paged_kv(q, k_cache, v_cache, req_to_token, num_heads)
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    check_index("req_pool_indices", req_pool_indices, batch, device)
    check_index("seq_lens", seq_lens, batch, device)
    if not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be a positive integer, got {num_kv_splits!r}")
    win = check_window(window)
    has_tail = tree_prefix is not None or tree_tail is not None
    if has_tail:
        if tree_prefix is None or tree_tail is None:
            raise ValueError("tree_prefix and tree_tail go together")
        if win:
            raise ValueError("a tree tail does not go with a sliding window")
        check_index("tree_prefix", tree_prefix, batch, device)
        check_tensor("tree_tail", tree_tail, ndim=2, dtypes=(torch.int32, torch.int64))
        check_shape("tree_tail", tree_tail, (batch, tree_tail.shape[1]))
        if tree_tail.device != device or tree_tail.stride(1) != 1:
            raise ValueError("tree_tail must be on q's device with unit column stride")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=device)
    else:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=device)
        check_shape("out", out, (batch, num_heads, head_dim))
    need = workspace_numel(batch, num_heads, head_dim, num_kv_splits)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    else:
        check_tensor("workspace", workspace, dtypes=(torch.float32,), device=device)
        check_contiguous("workspace", workspace)
        if workspace.numel() < need:
            raise ValueError(f"workspace has {workspace.numel()} elements, needs {need}")
    if batch == 0:
        return out
    workspace = workspace.reshape(-1)
    n_o = batch * num_heads * num_kv_splits * head_dim
    mid_o = workspace[:n_o].view(batch, num_heads, num_kv_splits, head_dim)
    mid_lse = workspace[n_o : n_o + batch * num_heads * num_kv_splits].view(
        batch, num_heads, num_kv_splits
    )

    group = num_heads // kv_heads
    block_d = next_pow2(head_dim)
    config = stage1_config or launch_config(head_dim, k_cache.dtype, device, q.dtype)
    block_n, warps, stages = config[:3]
    # An fp8 cache's keys and values go to the dot products as float16 where asked (a 4th
    # config field of 1 or 2) and q is 16-bit: exact, and fewer conversions than to bfloat16.
    # 2 reads them as 32-bit words, converted before the layout change (`_fp8_words_as_f16`),
    # where whole words make up a head, else as 1 (measured: docs/benchmarks.md, "The fp8
    # cache's decode kernel in words").
    if len(config) > 3 and config[3] not in _FP8_MODES:
        raise ValueError(f"stage1_config's 4th field must be 0, 1 or 2, got {config[3]!r}")
    mode = config[3] if fp8 and len(config) > 3 and q.dtype != torch.float32 else 0
    words = mode == 2 and head_dim == block_d
    words = words and all(c.stride(i) % 4 == 0 for c in (k_cache, v_cache) for i in (0, 1))
    block_h = max(16, min(64, next_pow2(group)))  # tl.dot's least rows: a group pads to 16
    h_blocks = triton.cdiv(group, block_h)
    _decode_stage1[(batch, kv_heads * h_blocks, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        tree_prefix if has_tail else seq_lens,
        tree_tail if has_tail else req_pool_indices,
        mid_o,
        mid_lse,
        sm_scale * LOG2E * (k_scale if fp8 else 1.0),
        v_scale,
        win,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        tree_tail.stride(0) if has_tail else 0,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        BLOCK_H=block_h,
        H_BLOCKS=h_blocks,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits,
        USE_WINDOW=win > 0,
        HAS_TAIL=has_tail,
        DOT_PREC=dot_precision(q.dtype),
        KV_FP8=fp8,
        FP8_AS_F16=mode > 0,
        FP8_WORDS=words,
        PTX=not triton.knobs.runtime.interpret,
        EVICT="evict_first" if kv_evict_first else "",
        num_warps=warps,
        num_stages=stages,
    )
    _decode_stage2[(batch, num_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=max(2, next_pow2(num_kv_splits)),
        TRIGGER=pdl.enabled(q.device),
        num_warps=4 if block_d <= 128 else 8,
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    tree_prefix: torch.Tensor | None = None,
    tree_tail: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """What `decode_attention` computes, request by request in float32 (an fp8 cache's keys
    and values dequantized with their scales); output in q's dtype."""
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        lo = max(0, n - window) if window is not None else 0
        slots = req_to_token[int(req_pool_indices[b]), lo:n].long()
        if tree_prefix is not None:
            p = int(tree_prefix[b])
            table = req_to_token[int(req_pool_indices[b]), :p].long()
            slots = torch.cat([table, tree_tail[b, : n - p].long().to(table.device)])
        k = dequantize_kv_reference(k_cache[slots], k_scale, torch.float32)
        v = dequantize_kv_reference(v_cache[slots], v_scale, torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
