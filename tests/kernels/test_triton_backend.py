"""The `triton` attention backend: same outputs as `torch_native` on the same KV pool, the
CUDA-graph metadata path, and greedy tokens equal to transformers through `braid.LLM`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

import braid
from braid.kernels.reference import quantize_kv_reference
from braid.runtime.attention import create_backend
from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.attention.triton_backend import TritonBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from tests.conftest import hf_greedy

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class _Setup:
    """A one-layer pool with three requests' pages, their prefixes' KV already written."""

    def __init__(self, device, dtype, page_size, window, prefix, extend, kv_dtype=None, **scales):
        self.device, self.dtype = device, dtype
        self.pool = KVPool(
            1, 160 // page_size, page_size, KV_HEADS, HEAD_DIM, kv_dtype or dtype, device, **scales
        )
        self.table = ReqToTokenPool(8, 64, device)
        for buf in self.pool.k + self.pool.v:
            buf.zero_()  # the pool starts as torch.empty; zeros make whole-pool compares exact
        kw = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, sliding_window=window)
        self.native = TorchNativeBackend(self.pool, self.table, **kw)
        self.triton = create_backend("triton", kv_pool=self.pool, req_to_token=self.table, **kw)
        self.prefix, self.extend = prefix, extend
        self.rows, self.slots = [], []
        alloc = self.pool.allocator
        for p, n in zip(prefix, extend):
            self.table.alloc()  # leave a row unused so rows differ from batch positions
            row = self.table.alloc()
            pages = alloc.alloc(alloc.pages_for(p + n + 1))  # +1: one decode step
            slots = torch.tensor(
                [pg * page_size + i for pg in pages for i in range(page_size)], device=device
            )[: p + n + 1]
            self.table.table[row, : len(slots)] = slots
            self.rows.append(row)
            self.slots.append(slots)
            k = torch.randn(p, KV_HEADS, HEAD_DIM, device=device).to(dtype)
            self.pool.store(0, slots[:p], k, torch.randn(p, KV_HEADS, HEAD_DIM).to(k))

    def batch(self, mode: ForwardMode) -> ForwardBatch:
        dev = self.device
        if mode is ForwardMode.EXTEND:
            pos = [torch.arange(p, p + n) for p, n in zip(self.prefix, self.extend)]
            locs = [s[p : p + n] for s, p, n in zip(self.slots, self.prefix, self.extend)]
            seq = [p + n for p, n in zip(self.prefix, self.extend)]
            prefix_lens, extend_lens = list(self.prefix), list(self.extend)
        else:
            seq0 = [p + n for p, n in zip(self.prefix, self.extend)]
            pos = [torch.tensor([s]) for s in seq0]
            locs = [s[n : n + 1] for s, n in zip(self.slots, seq0)]
            seq = [s + 1 for s in seq0]
            prefix_lens, extend_lens = seq0, [1] * len(seq0)
        positions = torch.cat(pos).to(dev)
        return ForwardBatch(
            mode=mode,
            input_ids=torch.zeros_like(positions),
            positions=positions,
            out_cache_loc=torch.cat(locs).to(dev),
            req_pool_indices=torch.tensor(self.rows, device=dev),
            seq_lens=torch.tensor(seq, device=dev),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            logits_indices=torch.arange(len(seq), device=dev),
        )

    def qkv(self, tokens: int):
        def r(h):
            return torch.randn(tokens, h, HEAD_DIM, device=self.device).to(self.dtype)

        return r(HEADS), r(KV_HEADS), r(KV_HEADS)


def decode_as_extend(batch: ForwardBatch) -> ForwardBatch:
    return dataclasses.replace(batch, mode=ForwardMode.EXTEND)


def _run(backend, batch, q, k, v) -> torch.Tensor:
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch)


@pytest.mark.parametrize(
    "dtype,page_size,window",
    [(torch.float32, 1, None), (torch.float32, 4, 6), (torch.float16, 2, None)],
)
def test_extend_then_decode_match_torch_native(device, dtype, page_size, window):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    s = _Setup(device, dtype, page_size, window, prefix=[0, 5, 12], extend=[7, 1, 20])
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        batch = s.batch(mode)
        q, k, v = s.qkv(batch.num_tokens)
        want = _run(s.native, batch, q, k, v)
        k_after, v_after = s.pool.k[0].clone(), s.pool.v[0].clone()
        got = _run(s.triton, batch, q, k, v)
        assert got.shape == (batch.num_tokens, HEADS * HEAD_DIM)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        # Both backends wrote the same K/V rows at out_cache_loc.
        assert torch.equal(s.pool.k[0], k_after) and torch.equal(s.pool.v[0], v_after)
        assert torch.equal(s.pool.k[0][batch.out_cache_loc], k)


@pytest.mark.parametrize(
    "dtype,page_size,window", [(torch.float32, 1, None), (torch.float16, 4, 6)]
)
def test_fp8_pool_extend_then_decode_match_torch_native(device, dtype, page_size, window):
    """On an fp8 pool the two backends store the same bytes and attend alike (torch_native
    reads everything back from the pool, triton's extend rounds the new tokens in-kernel)."""
    # float16: torch_native rounds each dequantized value (x * scale) to float16, triton folds
    # the scales into float32 sums: one more float16 rounding apart.
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    scales = dict(k_scales=[0.4], v_scales=[1.7])
    s = _Setup(
        device, dtype, page_size, window, [0, 5, 12], [7, 1, 20], torch.float8_e4m3fn, **scales
    )
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        batch = s.batch(mode)
        q, k, v = s.qkv(batch.num_tokens)
        k, v = k * 3, v * 3
        want = _run(s.native, batch, q, k, v)
        k_after, v_after = s.pool.k[0].clone(), s.pool.v[0].clone()
        got = _run(s.triton, batch, q, k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert torch.equal(s.pool.k[0].view(torch.uint8), k_after.view(torch.uint8))
        assert torch.equal(s.pool.v[0].view(torch.uint8), v_after.view(torch.uint8))
        stored = s.pool.k[0][batch.out_cache_loc]
        assert torch.equal(
            stored.view(torch.uint8), quantize_kv_reference(k, 0.4).view(torch.uint8)
        )
        # Not the float answer: the pool really is one byte a value.
        assert not torch.equal(stored.float() * 0.4, k.float())


def test_cuda_graph_metadata_pads_rows_and_matches_eager_decode(device):
    s = _Setup(device, torch.float32, 1, None, prefix=[3, 9, 0], extend=[4, 2, 5])
    ext = s.batch(ForwardMode.EXTEND)
    _run(s.triton, ext, *s.qkv(ext.num_tokens))
    dec = s.batch(ForwardMode.DECODE)
    q, k, v = s.qkv(3)
    eager = _run(s.triton, dec, q, k, v)

    backend: TritonBackend = s.triton
    backend.init_cuda_graph_state(max_bs=8)
    bs = 4
    # What the runner captures: a decode batch of bs rows over its static buffers.
    padded = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
        positions=torch.zeros(bs, dtype=torch.int64, device=device),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=device),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=device),
        seq_lens=torch.ones(bs, dtype=torch.int64, device=device),
        prefix_lens=[0] * bs,
        extend_lens=[1] * bs,
        logits_indices=torch.arange(bs, device=device),
    )
    backend.init_forward_metadata_capture_cuda_graph(padded)
    captured = padded.attn_metadata
    assert captured.seq_lens.tolist() == [1] * bs
    # Replay with the real batch of 3: its rows go into the same static buffers, in place.
    backend.init_forward_metadata_replay_cuda_graph(dec, bs)
    assert dec.attn_metadata.seq_lens.data_ptr() == captured.seq_lens.data_ptr()
    assert captured.seq_lens.tolist() == dec.seq_lens.tolist() + [1]
    assert captured.req_pool_indices.tolist() == s.rows + [0]
    padded.out_cache_loc[:3] = dec.out_cache_loc
    pad = torch.zeros(1, HEADS, HEAD_DIM, device=device)
    pad_kv = torch.zeros(1, KV_HEADS, HEAD_DIM, device=device)
    out = backend.forward(
        torch.cat([q, pad]),
        torch.cat([k, pad_kv]),
        torch.cat([v, pad_kv]),
        0,
        padded,
    )
    torch.testing.assert_close(out[:3], eager, atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(out[3]).all())
    with pytest.raises(ValueError, match="batch size 9"):
        backend.init_forward_metadata_replay_cuda_graph(dec, 9)


def test_backend_rejects_bad_configuration(device, monkeypatch):
    pool = KVPool(1, 4, 1, 2, 16, torch.float32, device)
    table = ReqToTokenPool(2, 8, device)
    if device.type == "cpu":
        with monkeypatch.context() as m:
            m.delenv("TRITON_INTERPRET")
            with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
                TritonBackend(pool, table, 4, 2, 16)
    with pytest.raises(ValueError, match="num_heads"):
        TritonBackend(pool, table, 3, 2, 16)
    with pytest.raises(ValueError, match="num_kv_splits"):
        TritonBackend(pool, table, 4, 2, 16, num_kv_splits=17)
    backend = TritonBackend(pool, table, 4, 2, 16)
    assert backend.supports_cuda_graph and backend.device.type == device.type
    assert all(1 <= backend.kv_splits_for(bs) <= 16 for bs in (1, 7, 256))
    decode = _Setup(device, torch.float32, 1, None, [2], [1]).batch(ForwardMode.DECODE)
    with pytest.raises(ValueError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_replay_cuda_graph(decode, 1)
    backend.init_cuda_graph_state(4)
    with pytest.raises(ValueError, match="only decode"):
        backend.init_forward_metadata_replay_cuda_graph(decode_as_extend(decode), 1)


def test_llm_with_triton_backend_gives_transformers_greedy_tokens(tiny_model_dirs):
    """Through the runtime processes (the scheduler inherits TRITON_INTERPRET on CPU): a cold
    prompt, then a batch with a full and a partial prefix-cache hit. (The sliding window is
    covered against torch_native above; a second model here would double the interpreted
    run time.)"""
    path = tiny_model_dirs["llama"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, 512, (30,), generator=g).tolist()
    second = first[:20] + torch.randint(0, 512, (6,), generator=g).tolist()
    new_tokens = 4
    expected = [hf_greedy(hf, p, new_tokens, eos=False) for p in (first, second)]
    sp = braid.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with braid.LLM(
        path,
        dtype="float32",
        kv_tokens=256,
        page_size=2,
        attention_backend="triton",
        show_progress=False,
    ) as llm:
        alone = llm.generate([first], sp, use_tqdm=False)[0].outputs[0].token_ids
        batched = [
            o.outputs[0].token_ids for o in llm.generate([first, second], sp, use_tqdm=False)
        ]
        llm.check_invariants()
    assert alone == expected[0]
    assert batched == expected


def test_fp8_kv_engine_tokens_are_the_same_on_triton_and_torch_native(tiny_model_dirs):
    """An fp8 cache end to end in one process (the Triton kernels interpreted on CPU): chunked
    prefills over an fp8 prefix, a prefix-cache hit, decode; both backends give the same
    greedy tokens and keep their accounting."""
    from braid.runtime.ipc.to_scheduler import GenerateReq
    from tests.conftest import local_scheduler, run_to_end

    path = tiny_model_dirs["llama"]
    g = torch.Generator().manual_seed(7)
    first = torch.randint(0, 512, (30,), generator=g).tolist()
    second = first[:20] + torch.randint(0, 512, (6,), generator=g).tolist()
    sp = braid.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = {}
    for backend in ("triton", "torch_native"):
        sched = local_scheduler(
            path,
            kv_tokens=256,
            page_size=2,
            chunked_prefill_size=8,
            attention_backend=backend,
            kv_cache_dtype="fp8_e4m3",
        )
        sched.handle(GenerateReq("a", first, sp, 0))
        tokens = run_to_end(sched)
        sched.handle(GenerateReq("b", second, sp, 0))
        tokens |= run_to_end(sched)
        assert sched.stats.cached_prompt_tokens >= 20
        got[backend] = tokens
    assert got["triton"] == got["torch_native"]


@pytest.mark.parametrize(
    "dtype,page_size,window", [(torch.float32, 1, None), (torch.float16, 4, 6)]
)
def test_mixed_extend_runs_its_decode_tail_and_matches_torch_native(
    device, dtype, page_size, window
):
    """An extend whose last two requests decode one token after their cached KV
    (`decode_tail`): the Triton backend (extend kernel for the head, decode kernel for the
    tail) gives torch_native's output; the tail really goes through the decode path."""
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    s = _Setup(device, dtype, page_size, window, prefix=[0, 9, 30], extend=[7, 1, 1])
    batch = dataclasses.replace(s.batch(ForwardMode.EXTEND), decode_tail=2)
    q, k, v = s.qkv(batch.num_tokens)
    want = _run(s.native, batch, q, k, v)
    got = _run(s.triton, batch, q, k, v)
    meta = batch.attn_metadata
    assert type(meta).__name__ == "_MixedMeta" and meta.tokens == 7
    assert meta.decode.req_pool_indices.tolist() == s.rows[1:]
    assert meta.decode.seq_lens.tolist() == [10, 31]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_mixed_steps_through_triton_give_transformers_greedy_tokens(tiny_model_dirs):
    """Mixed prefill + decode steps on the Triton backend (decode tails through the decode
    kernel), chunked prompts arriving while others decode: transformers' greedy tokens."""
    from tests.conftest import local_scheduler
    from tests.runtime.test_mixed_chunk import _run, _workload

    work = _workload(seed=1)[:5]
    sched = local_scheduler(
        tiny_model_dirs["llama"],
        attention_backend="triton",
        kv_tokens=2048,
        chunked_prefill_size=32,
        enable_mixed_chunk=True,
    )
    got, _ = _run(sched, work)
    assert sched.stats.mixed_decode_rows > 0
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    for i, (_, prompt, n) in enumerate(work):
        assert got[f"r{i}"] == hf_greedy(hf.eval(), prompt, n, eos=False), i
