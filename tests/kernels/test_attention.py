"""store_kv, decode_attention and extend_attention against their torch references."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from braid.kernels import decode_attention, extend_attention, store_kv
from braid.kernels.attention_decode import decode_attention_reference, workspace_numel
from braid.kernels.attention_extend import extend_attention_reference
from braid.kernels.extend_config import ExtendConfig
from braid.kernels.kv_store import store_kv_reference
from braid.kernels.reference import dequantize_kv_reference, quantize_kv_reference
from tests.kernels.conftest import CPU_DTYPES

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _paged(rows, max_ctx, slots, kv_heads, head_dim, dtype, device, table_dtype=torch.int64):
    """A random KV pool and a table whose rows hold distinct random slots (never slot 0)."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype).to(device)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype).to(device)
    table = torch.stack([torch.randperm(slots - 1, generator=g)[:max_ctx] + 1 for _ in range(rows)])
    return k_cache, v_cache, table.to(table_dtype).to(device)


# ---- store_kv ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_store_kv_writes_rows_at_slots_from_strided_views(device, dtype):
    slots, kvh, d = 40, 2, 16
    k_cache = torch.zeros(slots, kvh, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    # k and v as column slices of one fused buffer, as the model produces them.
    kv = torch.randn(5, 2 * kvh * d, device=device).to(dtype)
    k = kv[:, : kvh * d].view(5, kvh, d)
    v = kv[:, kvh * d :].view(5, kvh, d)
    loc = torch.tensor([7, 3, 39, 0, 12], device=device)
    store_kv(k_cache, v_cache, k, v, loc)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(want_k, want_v, k, v, loc)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert k_cache[[1, 2, 4]].abs().sum() == 0  # untouched slots stay zero


def test_store_kv_rejects_bad_arguments(device):
    kc = torch.zeros(8, 2, 16, device=device)
    k = torch.zeros(3, 2, 16, device=device)
    loc = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(ValueError, match="loc"):
        store_kv(kc, kc.clone(), k, k, loc.int())
    with pytest.raises(ValueError, match="loc has 2"):
        store_kv(kc, kc.clone(), k, k, loc[:2])
    with pytest.raises(ValueError, match="k must have shape"):
        store_kv(kc, kc.clone(), torch.zeros(3, 1, 16, device=device), k, loc)
    with pytest.raises(ValueError, match="k dtype"):
        store_kv(kc, kc.clone(), k.half(), k, loc)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        store_kv(kc.transpose(0, 1).contiguous().transpose(0, 1), kc.clone(), k, k, loc)


# ---- decode -----------------------------------------------------------------------------


# GQA groups of 2, 8, 1 and 32 (more query heads than one 16-row block), a non-power-of-two
# head_dim, a sliding window.
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,dtype",
    [
        (4, 2, 16, None, torch.float32),
        (8, 1, 32, 7, torch.float16),
        (2, 2, 64, None, torch.float16),
        (4, 4, 24, None, torch.float32),
        (32, 1, 16, None, torch.float32),
    ],
)
def test_decode_matches_reference(device, heads, kv_heads, head_dim, window, dtype):
    k_cache, v_cache, table = _paged(5, 60, 128, kv_heads, head_dim, dtype, device)
    rows = torch.tensor([4, 0, 2], device=device)
    seq_lens = torch.tensor([1, 17, 60], device=device)
    q = torch.randn(3, heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    got = decode_attention(
        q, k_cache, v_cache, table, rows, seq_lens, scale, num_kv_splits=3, window=window
    )
    want = decode_attention_reference(
        q, k_cache, v_cache, table, rows, seq_lens, scale, window=window
    )
    assert got.shape == q.shape and got.dtype == dtype
    _close(got, want, dtype)


def test_decode_split_count_does_not_change_the_result(device):
    k_cache, v_cache, table = _paged(2, 40, 100, 2, 32, torch.float32, device)
    rows = torch.tensor([1, 0], device=device)
    seq_lens = torch.tensor([40, 2], device=device)
    q = torch.randn(2, 4, 32, device=device)
    outs = [
        decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.2, num_kv_splits=s)
        for s in (1, 8)  # 8 splits of a 2-token sequence: most splits are empty
    ]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_decode_stage1_config_does_not_change_the_result(device):
    """The tuning override (block size, warps, stages) only changes speed."""
    k_cache, v_cache, table = _paged(2, 70, 160, 2, 32, torch.float32, device)
    rows = torch.tensor([1, 0], device=device)
    seq_lens = torch.tensor([70, 33], device=device)
    q = torch.randn(2, 4, 32, device=device)
    outs = [
        decode_attention(
            q, k_cache, v_cache, table, rows, seq_lens, 0.2, num_kv_splits=2, stage1_config=cfg
        )
        for cfg in (None, (16, 4, 3), (128, 8, 1))
    ]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_decode_kv_evict_first_marks_the_kv_loads_in_the_machine_code():
    """The flag reaches the loads: compiled for sm_90 (here, no GPU needed), the kernel's K/V
    loads carry an L2 evict-first policy with it and none without (the interpreter ignores
    policies, so the test below could not tell)."""
    code = (
        "from benchmarks.sass_counts import decode_ptx; "
        "print(int('L2::evict_first' in decode_ptx('evict_first')), "
        "int('evict_first' in decode_ptx('')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["1", "0"]


def test_decode_kv_evict_first_gives_the_same_bits(device):
    """`kv_evict_first` only marks the K/V loads' L2 policy: the same output, for a float
    cache and for an fp8 one read as words."""
    k_cache, v_cache, table = _paged(2, 70, 160, 2, 32, torch.float32, device)
    rows = torch.tensor([1, 0], device=device)
    seq_lens = torch.tensor([70, 33], device=device)
    q = torch.randn(2, 4, 32, device=device)
    for kc, vc, cfg, qq in (
        (k_cache, v_cache, None, q),
        (k_cache.to(FP8), v_cache.to(FP8), (16, 4, 1, 2), q.to(torch.bfloat16)),
    ):
        args = (qq, kc, vc, table, rows, seq_lens, 0.2)
        plain = decode_attention(*args, num_kv_splits=2, stage1_config=cfg)
        evict = decode_attention(*args, num_kv_splits=2, stage1_config=cfg, kv_evict_first=True)
        assert torch.equal(plain, evict)


def test_decode_takes_its_tuned_config_per_gpu_head_size_and_kv_dtype(tmp_path, monkeypatch):
    """`launch_config`: the entry written for this GPU, head size and KV dtype
    (`tune_attention.py --write-config`), the built-in choice elsewhere; a malformed entry is
    refused naming its key."""
    from braid.kernels import attention_decode as ad

    table = tmp_path / "decode_attention.json"
    entries = {"128/float8_e4m3fn": [128, 4, 4, 1], "64/float8_e4m3fn": [32, 8, 3]}
    table.write_text(json.dumps({"GPU X": entries}))
    monkeypatch.setattr(ad, "TUNED_CONFIGS", table)
    monkeypatch.setattr(ad, "cuda_device_name", lambda index: "GPU X")
    ad._tuned.cache_clear()
    cuda = torch.device("cuda", 0)  # only its name is asked (patched): no GPU needed
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    try:
        assert ad.tuned_key(128, fp8) == "128/float8_e4m3fn"
        assert ad.tuned_key(48, fp8) == "64/float8_e4m3fn"
        assert ad.launch_config(128, fp8, cuda, bf16) == (128, 4, 4, 1)
        assert ad.launch_config(64, fp8, cuda, torch.float16) == (32, 8, 3)
        assert ad.launch_config(128, bf16, cuda, bf16) == ad._stage1_config(128)
        # Swept with a 16-bit q: a float32 q (twice the tile) keeps the built-in config.
        assert ad.launch_config(128, fp8, cuda, torch.float32) == (64, 4, 3)
        assert ad.launch_config(128, fp8, torch.device("cpu"), bf16) == (64, 4, 3)
        for bad in ([48, 4, 3], [64, 3, 3], [64, 4, 3, 3], [64, 4], [64.0, 4, 3], [64, 4, 0]):
            table.write_text(json.dumps({"GPU X": {"128/bfloat16": bad}}))
            ad._tuned.cache_clear()
            with pytest.raises(ValueError, match=r"128/bfloat16.*power of two"):
                ad.launch_config(128, bf16, cuda, bf16)
    finally:
        ad._tuned.cache_clear()


def test_decode_reads_strided_q_int32_indices_and_uses_given_buffers(device):
    k_cache, v_cache, table = _paged(3, 30, 64, 2, 16, torch.float32, device, torch.int32)
    qkv = torch.randn(2, 4 * 16 + 2 * 2 * 16, device=device)
    q = qkv[:, : 4 * 16].view(2, 4, 16)
    rows = torch.tensor([2, 1], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([30, 9], dtype=torch.int32, device=device)
    out = torch.full((2, 4, 16), float("nan"), device=device)
    ws = torch.empty(workspace_numel(2, 4, 16, 2) + 5, device=device)
    got = decode_attention(
        q, k_cache, v_cache, table, rows, seq_lens, 0.25, num_kv_splits=2, out=out, workspace=ws
    )
    assert got is out
    want = decode_attention_reference(q, k_cache, v_cache, table, rows, seq_lens, 0.25)
    _close(out, want, torch.float32)


def test_decode_rejects_bad_arguments(device):
    k_cache, v_cache, table = _paged(2, 8, 16, 2, 16, torch.float32, device)
    q = torch.randn(2, 4, 16, device=device)
    rows = torch.tensor([0, 1], device=device)
    lens = torch.tensor([3, 4], device=device)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(
            torch.randn(2, 3, 16, device=device), k_cache, v_cache, table, rows, lens, 1.0
        )
    with pytest.raises(ValueError, match="seq_lens has 1"):
        decode_attention(q, k_cache, v_cache, table, rows, lens[:1], 1.0)
    with pytest.raises(ValueError, match="seq_lens must be one of"):
        decode_attention(q, k_cache, v_cache, table, rows, lens.float(), 1.0)
    with pytest.raises(ValueError, match="k_cache dtype"):
        decode_attention(q.half(), k_cache, v_cache, table, rows, lens, 1.0)
    with pytest.raises(ValueError, match="workspace has"):
        decode_attention(
            q, k_cache, v_cache, table, rows, lens, 1.0, workspace=torch.empty(10, device=device)
        )
    with pytest.raises(ValueError, match="num_kv_splits"):
        decode_attention(q, k_cache, v_cache, table, rows, lens, 1.0, num_kv_splits=0)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k_cache, v_cache, table, rows, lens, 1.0, window=0)
    with pytest.raises(ValueError, match="q must have unit stride"):
        decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, table, rows, lens, 1.0
        )


# ---- extend -----------------------------------------------------------------------------


def _extend_case(prefix, extend, heads, kv_heads, head_dim, dtype, device, **paged):
    ctx = max(prefix) + 1
    k_cache, v_cache, table = _paged(
        len(prefix) + 1, ctx, 2 * ctx + 1, kv_heads, head_dim, dtype, device, **paged
    )
    idx_dtype = table.dtype
    rows = torch.arange(len(prefix), 0, -1, device=device, dtype=idx_dtype)
    ext = torch.tensor(extend, device=device, dtype=idx_dtype)
    starts = torch.cumsum(ext, 0) - ext
    tokens = int(ext.sum())
    q = torch.randn(tokens, heads, head_dim, device=device).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
    pre = torch.tensor(prefix, device=device, dtype=idx_dtype)
    return (q, k, v, k_cache, v_cache, table, rows, pre, ext, starts)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,dtype",
    [
        (4, 2, 16, None, torch.float32),
        (8, 1, 32, 5, torch.float16),
        (2, 2, 64, None, torch.float16),
        (4, 2, 24, 7, torch.float32),
    ],
)
def test_extend_matches_reference_on_ragged_batch_with_prefixes(
    device, heads, kv_heads, head_dim, window, dtype
):
    # No prefix; a one-token extend; a prefix longer than a block; an extend over two blocks.
    args = _extend_case([0, 13, 70, 3], [5, 1, 9, 70], heads, kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    got = extend_attention(*args, scale, window=window)
    want = extend_attention_reference(*args, scale, window=window)
    assert got.shape == args[0].shape and got.dtype == dtype
    _close(got, want, dtype)


@pytest.mark.parametrize(
    "config",
    [(32, 16, 4, 1), (16, 16, 4, 2), (64, 32, 8, 3), (32, 16, 4, 1, 1), (64, 32, 8, 3, 1)],
)
@pytest.mark.parametrize("window", [None, 9])
def test_extend_launch_configs_give_the_same_result(device, config, window):
    """Every launch configuration the tuning sweep tries, packed (a fifth field 1) or not:
    whole key blocks (prefix and causal) run unmasked, partial and diagonal ones masked, the
    last query blocks launch first."""
    args = _extend_case([70, 0, 33], [70, 45, 1], 4, 2, 16, torch.float32, device)
    got = extend_attention(*args, 0.25, window=window, config=config)
    _close(got, extend_attention_reference(*args, 0.25, window=window), torch.float32)
    with pytest.raises(ValueError, match="BLOCK_N 32 must divide BLOCK_M 16"):
        extend_attention(*args, 0.25, config=(16, 32, 4, 1))


# Packed (one program per KV head, its GROUP query heads in one tile) against the unpacked
# kernel: the same keys in the same order, so equal but for the rounding of a taller tl.dot.
PACKED_TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.mark.parametrize(
    "heads,kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)], ids=["g1", "g2", "g4", "g8"]
)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_packed_extend_matches_reference_and_the_unpacked_kernel(
    device, heads, kv_heads, window, dtype
):
    # No prefix and extends of 5 and 37 (not multiples of BLOCK_M 16), a one-token extend
    # after a 13-token prefix, 32 new tokens (two whole blocks) after a 40-token prefix.
    args = _extend_case([0, 13, 40, 0], [5, 1, 32, 37], heads, kv_heads, 16, dtype, device)
    got = extend_attention(*args, 0.25, window=window, config=(16, 16, 4, 1, 1))
    _close(got, extend_attention_reference(*args, 0.25, window=window), dtype)
    unpacked = extend_attention(*args, 0.25, window=window, config=(16, 16, 4, 1))
    tol = PACKED_TOL[dtype]
    torch.testing.assert_close(got, unpacked, atol=tol, rtol=tol)


def test_packed_extend_leaves_rows_of_no_request_untouched(device):
    """A packed tile's rows past its request's last token are not stored: the 3-token request
    fills 12 of its tile's 64 rows (the rest would land on the next request's rows), the
    20-token one 16 of its second tile's (the rest on rows of no request)."""
    q, k, v, *rest = _extend_case([7, 0], [3, 20], 8, 2, 16, torch.float32, device)
    pad = torch.full((5, 8, 16), 7.0, device=device)
    q, k, v = (torch.cat([x, pad[:, : x.shape[1]]]) for x in (q, k, v))
    out = torch.full_like(q, 7.0)
    extend_attention(q, k, v, *rest, 0.3, out=out, config=(16, 16, 4, 1, 1))
    assert torch.equal(out[-5:], pad)
    _close(out[:-5], extend_attention_reference(q, k, v, *rest, 0.3)[:-5], torch.float32)


@pytest.mark.parametrize(
    "heads,config,message",
    [
        (8, (16, 16, 4, 1, 2), "pack must be 0 or 1, got 2"),
        (8, (128, 16, 4, 1, 1), "BLOCK_M 128 and GROUP 4 makes 512 tile rows, more than 256"),
        (6, (16, 16, 4, 1, 1), "power of two, got GROUP 3"),
        (8, (16, 32, 4, 1, 1), "BLOCK_N 32 must divide BLOCK_M 16"),
        (8, (48, 16, 4, 1, 1), "BLOCK_M must be a power of two >= 16, got 48"),
        (8, (16, 8, 4, 1), "BLOCK_N must be a power of two >= 16, got 8"),
        (8, (512, 16, 4, 1), "BLOCK_M 512 exceeds 256 tile rows"),
        (8, (16, 16, 3, 1), "num_warps must be a power of two, got 3"),
        (8, (16, 16, 4, 0), "num_stages must be >= 1, got 0"),
        (8, (16, 16, 4), "got (16, 16, 4)"),
        (8, (16.0, 16, 4, 1), "block_m must be an int, got 16.0"),
    ],
)
def test_extend_rejects_configs_it_cannot_run(device, heads, config, message):
    args = _extend_case([2, 0], [3, 4], heads, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match=re.escape(message)):
        extend_attention(*args, 1.0, config=config)


def test_packed_extend_runs_at_the_tile_row_limit(device):
    args = _extend_case([5, 0], [40, 7], 16, 2, 16, torch.float32, device)  # GROUP 8
    got = extend_attention(*args, 0.25, config=(32, 16, 4, 1, 1))  # 256 rows
    _close(got, extend_attention_reference(*args, 0.25), torch.float32)


def test_extend_with_a_group_of_three_runs_unpacked(device):
    args = _extend_case([2, 17], [3, 20], 6, 2, 16, torch.float16, device)
    got = extend_attention(*args, 0.25, config=(16, 16, 4, 1))
    _close(got, extend_attention_reference(*args, 0.25), torch.float16)


def test_extend_with_int32_lengths_strided_kv_and_given_out(device):
    q, k, v, *rest = _extend_case(
        [4, 0], [6, 3], 4, 2, 16, torch.float32, device, table_dtype=torch.int32
    )
    # k and v as slices of one fused buffer (token stride != kv_heads * head_dim).
    kv = torch.randn(q.shape[0], 2 * 2 * 16, device=device)
    k, v = kv[:, :32].view(-1, 2, 16), kv[:, 32:].view(-1, 2, 16)
    out = torch.zeros_like(q)
    got = extend_attention(q, k, v, *rest, 0.3, out=out, max_extend_len=6)
    assert got is out
    _close(out, extend_attention_reference(q, k, v, *rest, 0.3), torch.float32)


def test_extend_rejects_bad_arguments(device):
    args = _extend_case([2, 0], [3, 4], 4, 2, 16, torch.float32, device)
    q, k, v, kc, vc, table, rows, pre, ext, starts = args
    with pytest.raises(ValueError, match="prefix_lens has 1"):
        extend_attention(q, k, v, kc, vc, table, rows, pre[:1], ext, starts, 1.0)
    with pytest.raises(ValueError, match="k must have shape"):
        extend_attention(q, k[:2], v, kc, vc, table, rows, pre, ext, starts, 1.0)
    with pytest.raises(ValueError, match="req_to_token"):
        extend_attention(q, k, v, kc, vc, table.float(), rows, pre, ext, starts, 1.0)
    with pytest.raises(ValueError, match="max_extend_len"):
        extend_attention(q, k, v, kc, vc, table, rows, pre, ext, starts, 1.0, max_extend_len=-1)


# ---- GPU, real sizes ----------------------------------------------------------------------

GPU_DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_real_sizes_gpu(dtype, head_dim):
    batch, heads, kv_heads, max_len = 32, 32, 8, 4096
    dev = torch.device("cuda")
    slots = batch * max_len + 1
    k_cache = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dtype)
    table = (torch.randperm(slots - 1, device=dev) + 1).view(batch, max_len)
    seq_lens = torch.randint(1, max_len + 1, (batch,), device=dev)
    seq_lens[0] = max_len
    rows = torch.randperm(batch, device=dev)
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    scale = head_dim**-0.5
    for window in (None, 1024):
        got = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, scale, window=window)
        want = decode_attention_reference(
            q, k_cache, v_cache, table, rows, seq_lens, scale, window=window
        )
        _close(got, want, dtype)


# Packed configurations at GROUP 4 (32 query heads, 8 KV heads): 64, 128 and 256 tile rows;
# at head dim 256 only the smallest (a 128 x 256 float32 accumulator spills).
GPU_PACKED = [(16, 16, 4, 2, 1), (32, 32, 4, 3, 1), (64, 32, 8, 2, 1)]
GPU_EXTEND_CONFIGS = [(d, None) for d in (64, 128, 256)]
GPU_EXTEND_CONFIGS += [(d, c) for d in (64, 128) for c in GPU_PACKED] + [(256, GPU_PACKED[0])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim,config", GPU_EXTEND_CONFIGS, ids=str)
def test_extend_real_sizes_gpu(dtype, head_dim, config):
    dev = torch.device("cuda")
    args = _extend_case([0, 1000, 3000, 17], [1024, 333, 1000, 2048], 32, 8, head_dim, dtype, dev)
    scale = head_dim**-0.5
    for window in (None, 512):
        got = extend_attention(*args, scale, window=window, config=config)
        _close(got, extend_attention_reference(*args, scale, window=window), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_store_kv_real_sizes_gpu(dtype):
    dev = torch.device("cuda")
    k_cache = torch.zeros(100_000, 8, 128, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(4096, 8, 128, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    loc = torch.randperm(100_000, device=dev)[:4096]
    store_kv(k_cache, v_cache, k, v, loc)
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)


def test_decode_with_a_tree_tail_reads_the_tail_after_the_table_prefix(device):
    """Rows of one table row with their own tails (a draft tree's branches) attend exactly as
    a row whose table lists the prefix and then the tail would."""
    k_cache, v_cache, table = _paged(6, 50, 160, 2, 32, torch.float32, device)
    # Rows 0-2 share table row 1 with prefix 20 and different tails; row 3 has no tail (its
    # prefix is its whole length); row 4: table row 3, prefix 35, a tail of 3.
    rows = torch.tensor([1, 1, 1, 0, 3], device=device)
    prefix = torch.tensor([20, 20, 20, 30, 35], device=device)
    tail = torch.tensor(
        [[140, 0, 0], [141, 142, 0], [141, 143, 144], [0, 0, 0], [150, 151, 152]], device=device
    )
    seq_lens = prefix + torch.tensor([1, 2, 3, 0, 3], device=device)
    q = torch.randn(5, 4, 32, device=device)
    got = decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        seq_lens,
        0.2,
        num_kv_splits=3,
        tree_prefix=prefix,
        tree_tail=tail,
    )
    # The same rows written out as plain table rows.
    flat = table.clone()
    spare = [2, 4, 5, 0, 3]
    for i, (r, p, n) in enumerate(zip(rows.tolist(), prefix.tolist(), seq_lens.tolist())):
        flat[spare[i], :n] = torch.cat([table[r, :p], tail[i, : n - p].to(table.dtype)])
    plain = decode_attention(
        q, k_cache, v_cache, flat, torch.tensor(spare, device=device), seq_lens, 0.2
    )
    want = decode_attention_reference(
        q, k_cache, v_cache, table, rows, seq_lens, 0.2, tree_prefix=prefix, tree_tail=tail
    )
    _close(got, plain, torch.float32)
    _close(got, want, torch.float32)
    with pytest.raises(ValueError, match="go together"):
        decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.2, tree_prefix=prefix)


# ---- fp8 KV cache -------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
# (k_scale, v_scale): the default, and scales that are not powers of two.
FP8_SCALES = [(1.0, 1.0), (0.37, 2.5)]


def _awkward_rows(n: int, kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    """Rows spanning e4m3's range and past it: subnormals, halfway cases, values over 448."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, kv_heads, head_dim, generator=g) * torch.logspace(-4, 3, head_dim)
    flat = x.view(-1)
    flat[:8] = torch.tensor([0.0, -0.0, 1e-9, 448.0, 449.0, -1e4, 0.0029296875, 2.0**-10])
    return x.to(dtype).to(device)


def _fp8_paged(rows, max_ctx, slots, kv_heads, head_dim, device, k_scale, v_scale):
    k_cache, v_cache, table = _paged(
        rows, max_ctx, slots, kv_heads, head_dim, torch.float32, device
    )
    return (
        quantize_kv_reference(k_cache * k_scale, k_scale),
        quantize_kv_reference(v_cache * v_scale, v_scale),
        table,
    )


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
def test_store_kv_into_fp8_quantizes_bit_for_bit_as_torch_clamp_and_cast(
    device, dtype, k_scale, v_scale
):
    slots, kvh, d = 40, 2, 64
    k = _awkward_rows(6, kvh, d, dtype, device)
    v = -_awkward_rows(6, kvh, d, dtype, device).flip(0)
    loc = torch.tensor([7, 3, 39, 0, 12, 25], device=device)
    k_cache = torch.zeros(slots, kvh, d, dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    store_kv(k_cache, v_cache, k, v, loc, k_scale=k_scale, v_scale=v_scale)
    want_k = quantize_kv_reference(k, k_scale).view(torch.uint8)
    want_v = quantize_kv_reference(v, v_scale).view(torch.uint8)
    assert torch.equal(k_cache[loc].view(torch.uint8), want_k)
    assert torch.equal(v_cache[loc].view(torch.uint8), want_v)
    # The clamp: nothing stored is NaN, and 449 * (1 / k_scale) past 448 is stored as 448.
    assert not k_cache.float().isnan().any() and not v_cache.float().isnan().any()
    assert k_cache.float().abs().max() == 448.0
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(ref_k, ref_v, k, v, loc, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(ref_k.view(torch.uint8), k_cache.view(torch.uint8))
    assert torch.equal(ref_v.view(torch.uint8), v_cache.view(torch.uint8))
    untouched = [i for i in range(slots) if i not in loc.tolist()]
    assert k_cache[untouched].view(torch.uint8).sum() == 0


def test_fp8_cache_refuses_bad_scales_and_mixed_caches(device):
    kc = torch.zeros(8, 2, 16, dtype=FP8, device=device)
    k = torch.zeros(3, 2, 16, device=device)
    loc = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(ValueError, match="scale"):
        store_kv(kc, kc.clone(), k, k, loc, k_scale=0.0)
    with pytest.raises(ValueError, match="v_cache dtype"):
        store_kv(kc, torch.zeros(8, 2, 16, device=device), k, k, loc)
    q = torch.zeros(2, 4, 16, device=device)
    table = torch.zeros(2, 4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="v_cache dtype"):
        decode_attention(q, kc, kc.float(), table, loc[:2], loc[:2], 0.25)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize("config", [None, (32, 4, 2, 1), (16, 2, 2, 2)], ids=str)
def test_decode_over_fp8_cache_matches_reference_over_dequantized_kv(
    device, dtype, k_scale, v_scale, config
):
    heads, kv_heads, d = 8, 2, 32
    k_cache, v_cache, table = _fp8_paged(5, 60, 128, kv_heads, d, device, k_scale, v_scale)
    rows = torch.tensor([4, 0, 2], device=device)
    seq_lens = torch.tensor([1, 17, 60], device=device)
    q = torch.randn(3, heads, d, device=device).to(dtype)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    got = decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        seq_lens,
        0.2,
        num_kv_splits=3,
        stage1_config=config,
        **scales,
    )
    want = decode_attention_reference(q, k_cache, v_cache, table, rows, seq_lens, 0.2, **scales)
    _close(got, want, dtype)
    with pytest.raises(ValueError, match="4th field"):
        decode_attention(
            q, k_cache, v_cache, table, rows, seq_lens, 0.2, stage1_config=(16, 2, 2, 3)
        )
    # The same attention over float caches holding the dequantized values.
    kf = dequantize_kv_reference(k_cache, k_scale, dtype)
    vf = dequantize_kv_reference(v_cache, v_scale, dtype)
    _close(got, decode_attention(q, kf, vf, table, rows, seq_lens, 0.2, num_kv_splits=3), dtype)
    # And the scales matter: read as 1.0 the answer moves.
    if (k_scale, v_scale) != (1.0, 1.0):
        unscaled = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.2)
        assert not torch.allclose(unscaled.float(), want.float(), atol=1e-2)


def test_decode_over_fp8_cache_with_a_tree_tail(device):
    k_cache, v_cache, table = _fp8_paged(4, 40, 160, 2, 32, device, 0.5, 1.5)
    rows = torch.tensor([1, 1, 3], device=device)
    prefix = torch.tensor([20, 20, 35], device=device)
    tail = torch.tensor([[140, 0], [141, 142], [150, 151]], device=device)
    seq_lens = prefix + torch.tensor([1, 2, 2], device=device)
    q = torch.randn(3, 4, 32, device=device)
    kw = dict(tree_prefix=prefix, tree_tail=tail, k_scale=0.5, v_scale=1.5)
    got = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.2, num_kv_splits=2, **kw)
    want = decode_attention_reference(q, k_cache, v_cache, table, rows, seq_lens, 0.2, **kw)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize(
    "heads,config", [(4, None), (4, (16, 16, 4, 1, 1)), (8, (16, 16, 4, 1, 1))], ids=str
)
def test_extend_over_fp8_cache_reads_new_tokens_as_the_cache_stores_them(
    device, dtype, k_scale, v_scale, heads, config
):
    q, k, v, k_cache, v_cache, *rest = _extend_case(
        [0, 13, 70], [5, 1, 19], heads, 2, 16, torch.float32, device
    )
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kq = quantize_kv_reference(k_cache * k_scale, k_scale)
    vq = quantize_kv_reference(v_cache * v_scale, v_scale)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    got = extend_attention(q, k, v, kq, vq, *rest, 0.25, window=6, config=config, **scales)
    want = extend_attention_reference(q, k, v, kq, vq, *rest, 0.25, window=6, **scales)
    _close(got, want, dtype)

    # Equal to the extend over float caches and new K/V that went through the fp8 round trip:
    # a token sees the same keys whether they came from the cache or from this extend.
    def rt(x, s):
        return dequantize_kv_reference(quantize_kv_reference(x, s), s, dtype)

    plain = extend_attention(
        q,
        rt(k, k_scale),
        rt(v, v_scale),
        dequantize_kv_reference(kq, k_scale, dtype),
        dequantize_kv_reference(vq, v_scale, dtype),
        *rest,
        0.25,
        window=6,
        config=config,
    )
    _close(got, plain, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_fp8_cache_kernels_real_sizes_gpu(dtype):
    dev = torch.device("cuda")
    batch, heads, kv_heads, head_dim, max_len = 32, 32, 8, 128, 2048
    slots = batch * max_len + 1
    k = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dtype) * 3
    v = torch.randn_like(k)
    k_cache = torch.zeros(slots, kv_heads, head_dim, device=dev, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.arange(slots, device=dev)
    store_kv(k_cache, v_cache, k, v, loc, k_scale=0.05, v_scale=0.02)
    assert torch.equal(k_cache.view(torch.uint8), quantize_kv_reference(k, 0.05).view(torch.uint8))
    table = (torch.randperm(slots - 1, device=dev) + 1).view(batch, max_len)
    seq_lens = torch.randint(1, max_len + 1, (batch,), device=dev)
    rows = torch.randperm(batch, device=dev)
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    kw = dict(k_scale=0.05, v_scale=0.02)
    want = decode_attention_reference(
        q, k_cache, v_cache, table, rows, seq_lens, head_dim**-0.5, **kw
    )
    # The tuned config, to q's dtype or through float16 (exact for e4m3; 2: from 32-bit words,
    # by PTX), longer blocks.
    for config in (
        None,
        (64, 4, 3, 0),
        (128, 4, 3, 1),
        (256, 8, 2, 1),
        (128, 4, 4, 2),
        (64, 4, 2, 2),
    ):
        got = decode_attention(
            q, k_cache, v_cache, table, rows, seq_lens, head_dim**-0.5, stage1_config=config, **kw
        )
        _close(got, want, dtype)
    q, k, v, kc, vc, *rest = _extend_case([0, 1000, 17], [1024, 333, 2048], 32, 8, 128, dtype, dev)
    kc, vc = quantize_kv_reference(kc, 0.05), quantize_kv_reference(vc, 0.02)
    want = extend_attention_reference(q, k, v, kc, vc, *rest, 128**-0.5, **kw)
    for config in (None, (32, 32, 4, 3, 1)):
        got = extend_attention(q, k, v, kc, vc, *rest, 128**-0.5, config=config, **kw)
        _close(got, want, dtype)


def test_a_tuned_launch_config_is_read_per_gpu_head_size_and_dtype(tmp_path, monkeypatch):
    """benchmarks/tune_extend.py --write-config records the chosen configuration per GPU;
    `_tuned` finds it by the device's name and `tuned_key`, and nothing for other GPUs."""
    from braid.kernels import extend_config as ae

    path = tmp_path / "extend_attention.json"
    path.write_text('{"NVIDIA H200": {"128/bfloat16": [128, 64, 8, 3]}}')
    monkeypatch.setattr(ae, "TUNED_CONFIGS", path)
    ae._tuned.cache_clear()
    try:
        assert ae.tuned_key(128, torch.bfloat16) == "128/bfloat16"
        assert ae.tuned_key(96, torch.float16) == "128/float16"
        assert ae.tuned_key(128, torch.bfloat16, 4) == "128/bfloat16/g4"
        assert ae._tuned("NVIDIA H200", "128/bfloat16") == ExtendConfig(128, 64, 8, 3, pack=0)
        assert ae._tuned("NVIDIA H200", "128/float16") is None
        assert ae._tuned("NVIDIA A100-SXM4-80GB", "128/bfloat16") is None
    finally:
        ae._tuned.cache_clear()


def test_a_packed_tuned_config_is_used_for_the_group_it_was_measured_at(tmp_path, monkeypatch):
    """A five-field entry is packed. Under a GROUP's key it serves models of that GROUP, the
    key without one every other model; an entry a model's GROUP cannot pack (hand-written)
    gives way to the built-in default, never to a failing launch."""
    from braid.kernels import extend_config as ae

    path = tmp_path / "extend_attention.json"
    entries = {
        "128/bfloat16": [64, 64, 4, 3],
        "128/bfloat16/g4": [64, 32, 8, 3, 1],
        "128/float16": [32, 32, 4, 3, 1],
        "64/bfloat16/g4": [32, 16, 4, 3, 2],
    }
    path.write_text(json.dumps({"NVIDIA H200": entries}))
    monkeypatch.setattr(ae, "TUNED_CONFIGS", path)
    monkeypatch.setattr(ae, "cuda_device_name", lambda index: "NVIDIA H200")
    ae._tuned.cache_clear()
    try:
        packed, unpacked = ExtendConfig(64, 32, 8, 3, pack=1), ExtendConfig(64, 64, 4, 3)
        assert packed.fields() == [64, 32, 8, 3, 1] and unpacked.fields() == [64, 64, 4, 3]
        cuda = torch.device("cuda", 0)
        default = ae.launch_config(128, torch.bfloat16, cuda, 4, tuned=False)
        assert not default.pack and default != unpacked
        assert ae.launch_config(128, torch.bfloat16, cuda, 4) == packed
        for group in (1, 2, 3, 8):
            assert ae.launch_config(128, torch.bfloat16, cuda, group) == unpacked
        half_packed = ExtendConfig(32, 32, 4, 3, pack=1)
        assert ae.launch_config(128, torch.float16, cuda, 8) == half_packed  # 256 rows: the limit
        assert ae.launch_config(128, torch.float16, cuda, 16) == default  # 512 rows
        assert ae.launch_config(128, torch.float16, cuda, 5) == default
        with pytest.raises(ValueError, match=r"extend_attention\.json: 64/bfloat16/g4: .*got 2"):
            ae.launch_config(64, torch.bfloat16, cuda, 4)
    finally:
        ae._tuned.cache_clear()
