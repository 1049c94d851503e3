"""The page allocator and request-to-token table."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.cache.memory_pool import KVPool, PageAllocator, ReqToTokenPool


def test_allocator_never_hands_out_the_padding_page_and_conserves_pages():
    a = PageAllocator(num_pages=9, page_size=4)
    assert a.capacity_pages == 8 and a.capacity_tokens == 32
    got = a.alloc(8)
    assert got == list(range(1, 9))  # ascending: a fresh pool's sequence is one run of slots
    assert a.alloc(1) is None and a.free_pages == 0
    a.free(got[:3])
    assert a.free_pages == 3 and a.alloc(4) is None
    assert (
        a.pages_for(0) == 0 and a.pages_for(1) == 1 and a.pages_for(4) == 1 and a.pages_for(5) == 2
    )


def test_kv_pool_padding_page_is_zero_and_store_writes_slots():
    pool = KVPool(
        2,
        num_pages=5,
        page_size=2,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert torch.count_nonzero(pool.k[0][:2]) == 0 and torch.count_nonzero(pool.v[1][:2]) == 0
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    loc = torch.tensor([2, 5, 7])
    pool.store(1, loc, k, v)
    assert torch.equal(pool.k[1][loc], k) and torch.equal(pool.v[1][loc], v)


def test_req_to_token_rows_are_reused():
    t = ReqToTokenPool(2, 8, torch.device("cpu"))
    a, b = t.alloc(), t.alloc()
    assert {a, b} == {0, 1} and t.alloc() is None
    t.free(a)
    assert t.alloc() == a


def _fp8_pool(**scales) -> KVPool:
    return KVPool(2, 5, 2, 2, 4, torch.float8_e4m3fn, torch.device("cpu"), **scales)


def test_fp8_pool_stores_clamped_e4m3_and_reads_back_scaled_values():
    pool = _fp8_pool(k_scales=[1.0, 0.5], v_scales=[1.0, 4.0])
    assert pool.quantized and pool.k[0].element_size() == 1
    # The padding page holds finite values (zeros) in e4m3 too.
    assert pool.k[1][:2].float().eq(0).all() and pool.v[0][:2].float().eq(0).all()
    k = torch.tensor([0.3, -1000.0, 224.5, 1e-6] * 6).view(3, 2, 4)
    v = torch.tensor([0.3, 5000.0, -2.0, 17.0] * 6).view(3, 2, 4)
    loc = torch.tensor([2, 5, 7])
    pool.store(1, loc, k, v)
    assert pool.k[1].dtype == torch.float8_e4m3fn and not pool.k[1][loc].float().isnan().any()
    got_k, got_v = pool.read(1, loc, torch.float32)
    # k / 0.5 clamped at 448 then times 0.5: -1000 reads -224; 224.5 -> 449 -> 448 -> 224.
    assert got_k[0, 0].tolist() == [0.3125, -224.0, 224.0, 0.0]
    assert got_v[0, 0].tolist() == [0.3125, 1792.0, -2.0, 16.0]
    assert pool.scales(1) == (0.5, 4.0) and pool.scales(0) == (1.0, 1.0)
    # A bf16 read rounds the dequantized float32 once.
    assert pool.read(1, loc, torch.bfloat16)[0].dtype == torch.bfloat16


def test_fp8_pool_copy_slots_copies_the_stored_bytes():
    pool = _fp8_pool()
    pool.store(0, torch.tensor([2, 3]), torch.randn(2, 2, 4) * 100, torch.randn(2, 2, 4))
    pool.copy_slots([2, 3], [8, 9])
    for buf in (pool.k[0], pool.v[0]):
        assert torch.equal(buf[8:10].view(torch.uint8), buf[2:4].view(torch.uint8))


def test_kv_scales_are_checked():
    with pytest.raises(ValueError, match="k_scales has 1 entries"):
        _fp8_pool(k_scales=[1.0])
    with pytest.raises(ValueError, match="positive finite"):
        _fp8_pool(v_scales=[1.0, -2.0])
    with pytest.raises(ValueError, match="fp8 KV cache"):
        KVPool(1, 3, 1, 1, 4, torch.float32, torch.device("cpu"), k_scales=[1.0])


def test_allocator_hands_pages_back_in_the_order_they_were_freed():
    a = PageAllocator(num_pages=9, page_size=1)
    first, second = a.alloc(3), a.alloc(2)
    assert (first, second) == ([1, 2, 3], [4, 5])
    a.free(first)
    assert a.alloc(3) == [1, 2, 3]  # last freed, first reused (hot pages), in their order
    assert a.alloc(1) == [6]
