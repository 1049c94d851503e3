"""The shortcuts a CPU decode step takes, each against the path it replaces: torch's fused
`rms_norm` for a float32 RMSNorm, the unmasked attention of a batch of one sequence, and the
GGUF int4 layer's one-call kernel (docs/benchmarks.md, Quantization: the CPU step)."""

from __future__ import annotations

import pytest
import torch

from braid.kernels.gguf_reference import decode, random_blocks
from braid.kernels.reference import rmsnorm_reference
from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.layers.norm import RMSNorm, rmsnorm_cpu_float32
from braid.runtime.quantization.gguf_cpu import to_cpu_int4


@pytest.mark.parametrize("size", [3, 64, 576, 960, 2048, 4096])
def test_float32_rmsnorm_on_the_cpu_equals_the_plain_form_bit_for_bit(size):
    g = torch.Generator().manual_seed(size)
    x = torch.randn(5, size, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    residual = torch.randn(5, size, generator=g)
    w = torch.randn(size, generator=g)
    assert torch.equal(rmsnorm_cpu_float32(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6))
    got, got_res = rmsnorm_cpu_float32(x, w, 1e-5, residual)
    want, want_res = rmsnorm_reference(x, w, 1e-5, residual)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)


def test_rmsnorm_module_takes_the_fused_form_only_for_float32_on_the_cpu():
    assert RMSNorm(8, 1e-6, torch.float32)._norm is rmsnorm_cpu_float32
    # bfloat16 rounds the normed row to bfloat16 before the weight's product: the plain form.
    assert RMSNorm(8, 1e-6, torch.bfloat16)._norm is rmsnorm_reference


def _decode_batch(rows: list[int], seqs: list[int], table: ReqToTokenPool) -> ForwardBatch:
    seq_lens = torch.tensor(seqs)
    locs = torch.stack([table.table[r, s - 1] for r, s in zip(rows, seqs)])
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(rows), dtype=torch.int64),
        positions=seq_lens - 1,
        out_cache_loc=locs,
        req_pool_indices=torch.tensor(rows),
        seq_lens=seq_lens,
        prefix_lens=[s - 1 for s in seqs],
        extend_lens=[1] * len(rows),
        logits_indices=torch.arange(len(rows)),
    )


@pytest.mark.parametrize("window", [None, 4, 8, 9])
def test_one_sequence_decodes_unmasked_as_it_does_beside_another(window):
    heads, kv_heads, d = 6, 2, 16
    pool = KVPool(1, 64, 1, kv_heads, d, torch.float32, torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    table = ReqToTokenPool(4, 32, torch.device("cpu"))
    table.table[1, :9] = torch.randperm(30)[:9] + 1
    table.table[2, :13] = torch.randperm(30)[:13] + 33
    backend = TorchNativeBackend(pool, table, heads, kv_heads, d, sliding_window=window)
    q = torch.randn(2, heads, d)
    k, v = torch.randn(2, kv_heads, d), torch.randn(2, kv_heads, d)

    both = _decode_batch([1, 2], [9, 13], table)
    backend.init_forward_metadata(both)
    assert both.attn_metadata.mask is not None
    want = backend.forward(q, k, v, 0, both)

    alone = _decode_batch([1], [9], table)
    backend.init_forward_metadata(alone)
    # Unmasked only where the sequence sees every key: a window of 4 hides 5 of its 9, one of
    # 8 the first; one of 9 hides none.
    assert (alone.attn_metadata.mask is None) == (window is None or window >= 9)
    got = backend.forward(q[:1], k[:1], v[:1], 0, alone)
    torch.testing.assert_close(got, want[:1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("first", [1, 17])
def test_one_sequence_on_one_run_of_slots_reads_its_keys_in_place(first):
    """A lone sequence whose slots ascend without a gap attends to a view of the pool's rows:
    the same result, bit for bit, as gathering them; a gap, a descending run or an fp8 pool
    gathers."""
    heads, kv_heads, d = 6, 2, 16
    pool = KVPool(1, 64, 1, kv_heads, d, torch.float32, torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    table = ReqToTokenPool(4, 32, torch.device("cpu"))
    table.table[1, :11] = torch.arange(first, first + 11)
    backend = TorchNativeBackend(pool, table, heads, kv_heads, d)
    q = torch.randn(1, heads, d)
    k, v = torch.randn(1, kv_heads, d), torch.randn(1, kv_heads, d)
    batch = _decode_batch([1], [11], table)
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.span == (first, 11)
    got = backend.forward(q, k, v, 0, batch)
    batch.attn_metadata.span = None  # the gathered path
    assert torch.equal(got, backend.forward(q, k, v, 0, batch))
    run = list(range(first, first + 11))
    gap = [first, *range(first + 2, first + 12)]
    swapped = [run[0], run[2], run[1], *run[3:]]  # same first and last: the full check
    for slots in (gap, run[::-1], swapped):
        table.table[1, :11] = torch.tensor(slots[:11])
        batch = _decode_batch([1], [11], table)
        backend.init_forward_metadata(batch)
        assert batch.attn_metadata.span is None


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_gguf_cpu_layer_kernel_equals_the_weights_own_call(qtype):
    n, k = 48, 256
    blocks = random_blocks(qtype, n, k, torch.Generator().manual_seed(3))
    weight = to_cpu_int4(decode(blocks, qtype), qtype)
    run = weight.linear_fn()
    x = torch.randn(3, k)
    bias = torch.randn(n)
    plain = weight(x).to(x.dtype)
    got = run(x, None)
    # The 4-bit types run the kernel directly (Q8_0 and Q6_K through the weight's own call,
    # which widens x first): the same numbers as the weight's call, and the file's weights.
    assert got.dtype == torch.float32 and torch.equal(got, plain)
    assert torch.equal(run(x, bias), plain + bias)
    want = x.to(torch.bfloat16).float() @ weight.dequantize().T
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
