"""The host-to-device side of a step: `to_device` (lists through a C array), `packed_to_device`
(one copy, aligned views), and `build_extend`, which writes the request-to-token table from
its packed copy instead of a copy of its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from braid import SamplingParams
from braid.runtime.cache.memory_pool import PageAllocator, ReqToTokenPool
from braid.runtime.distributed.plan import _TENSORS as TP_FIELDS
from braid.runtime.distributed.plan import apply_writes
from braid.runtime.forward_batch import packed_to_device, to_device
from braid.runtime.scheduler.batch import build_extend
from braid.runtime.scheduler.request import Req

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([3, -1, 2**40, 0], torch.int64),
        ([7, -7], torch.int32),
        ([np.int64(5), 6], torch.int64),
        ([True, False, True], torch.bool),
        ([0.5, -2.25], torch.float32),
        ([], torch.int64),
    ],
)
def test_to_device_gives_what_torch_tensor_gives(values, dtype):
    got = to_device(values, CPU, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_to_device_refuses_an_int_past_the_dtype():
    with pytest.raises(OverflowError):
        to_device([2**31], CPU, torch.int32)


def test_packed_vectors_come_back_whole_each_view_16_byte_aligned():
    vectors = [[1, 2, 3], [], [4], [5, 6], list(range(7, 16))]
    views = packed_to_device(vectors, CPU)
    assert [v.tolist() for v in views] == vectors
    base = views[0].data_ptr()
    for v in views:
        assert v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
        assert (v.data_ptr() - base) % 16 == 0  # an even number of int64s apart


def _req(rid: str, prompt: list[int], pool_row: int) -> Req:
    params = SamplingParams(max_tokens=4)
    return Req(rid, prompt, params, 0, frozenset(), 4, pool_row=pool_row)


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_extend_writes_each_requests_table_row_and_its_batch_vectors(page_size):
    allocator = PageAllocator(64, page_size)
    table = ReqToTokenPool(4, 64, CPU)
    table.journal = []  # as under tensor parallelism: every write recorded for the followers
    a, b = _req("a", list(range(100, 111)), 2), _req("b", list(range(200, 206)), 0)
    # `b` holds a cached prefix of one page (admitted with it, as KVManager.admit does).
    b.pages = allocator.alloc(1)
    b.kv_len = page_size
    plan = build_extend([(a, 11), (b, 6)], allocator, table, CPU)
    batch = plan.batch

    def slots(req, start, end):
        return [req.pages[p // page_size] * page_size + p % page_size for p in range(start, end)]

    assert table.table[2, :11].tolist() == slots(a, 0, 11)
    assert table.table[0, page_size:6].tolist() == slots(b, page_size, 6)
    assert table.table[0, :page_size].tolist() == [0] * page_size  # not this step's to write
    assert batch.out_cache_loc.tolist() == slots(a, 0, 11) + slots(b, page_size, 6)
    assert batch.input_ids.tolist() == a.input_ids + b.input_ids[page_size:]
    assert batch.positions.tolist() == list(range(11)) + list(range(page_size, 6))
    assert batch.req_pool_indices.tolist() == [2, 0]
    assert batch.seq_lens.tolist() == [11, 6]
    assert batch.logits_indices.tolist() == [10, 11 + 6 - page_size - 1]
    assert len(set(batch.out_cache_loc.tolist())) == 11 + 6 - page_size  # no slot twice
    # What tensor parallelism sends without reading the device: the tensors' own values.
    assert set(batch.host) == set(TP_FIELDS)
    for name in TP_FIELDS:
        assert batch.host[name] == getattr(batch, name).tolist(), name
    # A follower replaying the journal gets the same table.
    follower = ReqToTokenPool(4, 64, CPU)
    apply_writes(table.journal, follower, None)
    assert torch.equal(follower.table, table.table)


@pytest.mark.parametrize("journaled", [False, True])
def test_a_cached_prefix_row_at_page_size_4_holds_its_pages_slots(journaled):
    """`KVManager.admit` writes a cached prefix's table row: at page size > 1 made on the
    device from the pages, or, when the table journals for tensor parallelism, on the host (so
    the journal needs no read-back from the device); the same slots either way."""
    from braid.runtime.cache.radix_cache import RadixCache
    from braid.runtime.scheduler.kv import KVManager
    from braid.runtime.scheduler.stats import SchedulerStats

    allocator = PageAllocator(64, 4)
    table = ReqToTokenPool(4, 64, CPU)
    if journaled:
        table.journal = []
    kv = KVManager(allocator, table, RadixCache(allocator), SchedulerStats(), 4, 60.0)
    req = _req("r", list(range(300, 313)), 0)
    pages = [7, 2, 11]
    kv.admit(req, None, pages)
    want = [p * 4 + i for p in pages for i in range(4)]
    assert table.table[req.pool_row, :12].tolist() == want
    if journaled:
        assert table.journal == [("row", req.pool_row, 0, want)]
        assert all(type(s) is int for s in table.journal[0][3])
