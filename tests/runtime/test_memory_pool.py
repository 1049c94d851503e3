"""The page allocator and request-to-token table."""

from __future__ import annotations

import torch

from braid.runtime.cache.memory_pool import KVPool, PageAllocator, ReqToTokenPool


def test_allocator_never_hands_out_the_padding_page_and_conserves_pages():
    a = PageAllocator(num_pages=9, page_size=4)
    assert a.capacity_pages == 8 and a.capacity_tokens == 32
    got = a.alloc(8)
    assert sorted(got) == list(range(1, 9))
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
