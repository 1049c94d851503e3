"""The `flashinfer` attention backend and per-phase backends.

On CPU, without FlashInfer: the plan (FlashInfer's page lists) matches the request-to-token
table for random batches (prefix hits sharing pages, chunked extends, page sizes 1 and 16,
CUDA-graph padding rows), and attention computed in torch through the plan equals
`torch_native` on the same pool; a missing package and bad backend names are refused, naming
the package or the field; prefill on torch_native with decode on triton gives transformers'
greedy tokens. On a GPU with FlashInfer (`gpu`): the backend against torch_native at real sizes,
eager and through CUDA graphs, and greedy tokens through the runtime.
"""

from __future__ import annotations

import importlib.util
import logging
import random
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from braid import SamplingParams
from braid.runtime.attention import create_backend
from braid.runtime.attention.flashinfer_backend import (
    PAD_PAGE,
    attention_through_plan,
    import_flashinfer,
    plan_paged_kv,
    prefill_kernels,
    window_left,
)
from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.attention.triton_backend import TritonBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.config import EngineConfig
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.server.cli import build_parser, serve
from tests.conftest import TINY, hf_greedy, local_scheduler, run_to_end

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
without_flashinfer = pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer-python is installed")
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- a pool holding random requests ------------------------------------------------------------


@dataclass
class Pool:
    """A one-layer KV pool and table with requests whose first `prefix` tokens have KV; some
    requests share their first pages with request 0 (prefix-cache hits)."""

    pool: KVPool
    table: ReqToTokenPool
    rows: list[int]
    slots: list[torch.Tensor]  # each request's slots for all its positions
    prefix: list[int]
    extend: list[int]

    def batch(self, mode: ForwardMode) -> ForwardBatch:
        dev = self.table.table.device
        extend = self.extend if mode is ForwardMode.EXTEND else [1] * len(self.rows)
        pos = [torch.arange(p, p + n) for p, n in zip(self.prefix, extend)]
        locs = [s[p : p + n] for s, p, n in zip(self.slots, self.prefix, extend)]
        positions = torch.cat(pos).to(dev)
        return ForwardBatch(
            mode=mode,
            input_ids=torch.zeros_like(positions),
            positions=positions,
            out_cache_loc=torch.cat(locs).to(dev),
            req_pool_indices=torch.tensor(self.rows, device=dev),
            seq_lens=torch.tensor([p + n for p, n in zip(self.prefix, extend)], device=dev),
            prefix_lens=list(self.prefix),
            extend_lens=list(extend),
            logits_indices=torch.arange(len(self.rows), device=dev),
        )


def random_pool(
    rng: random.Random,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_heads: int = 2,
    head_dim: int = 16,
    max_context: int = 96,
) -> Pool:
    n = rng.randint(1, 5)
    prefix = [rng.choice([0, rng.randint(1, 60)]) for _ in range(n)]
    extend = [rng.randint(1, 30) for _ in range(n)]
    pool = KVPool(
        1, 1 + 5 * max_context // page_size + 8, page_size, kv_heads, head_dim, dtype, device
    )
    for buf in pool.k + pool.v:
        buf.normal_()
    table = ReqToTokenPool(2 * n + 1, max_context, device)
    alloc = pool.allocator
    free = alloc.alloc(alloc.free_pages)
    rng.shuffle(free)  # a request's pages are then not consecutive
    alloc.free(free)
    rows, slots, pages_of = [], [], []
    for i in range(n):
        table.alloc()  # every other row unused: rows differ from batch positions
        row = table.alloc()
        total = prefix[i] + extend[i]
        shared: list[int] = []
        if i and pages_of[0] and rng.random() < 0.5:
            # A prefix hit: whole pages of request 0's prefix, as the radix cache shares them.
            full = min(prefix[0], prefix[i]) // page_size
            shared = pages_of[0][: rng.randint(0, full)] if full else []
        own = alloc.alloc(alloc.pages_for(total) - len(shared))
        pages = shared + own
        s = torch.tensor([pg * page_size + j for pg in pages for j in range(page_size)])[:total]
        table.write(row, 0, s.to(device))
        rows.append(row)
        slots.append(s.to(device))
        pages_of.append(pages)
    return Pool(pool, table, rows, slots, prefix, extend)


def _qkv(n: int, heads: int, kv_heads: int, dim: int, dtype, device, g=None):
    def r(h):
        return torch.randn(n, h, dim, device=device, generator=g).to(dtype)

    return r(heads), r(kv_heads), r(kv_heads)


# ---- the plan, on CPU --------------------------------------------------------------------------


def _check_plan_against_table(plan, table, rows, kv_lens, page_size, pad_rows=0):
    indptr = plan.indptr.tolist()
    last = plan.last_page_len.tolist()
    indices = plan.indices.tolist()
    assert plan.indptr.dtype == plan.indices.dtype == plan.last_page_len.dtype == torch.int32
    assert len(indptr) == len(rows) + pad_rows + 1 and len(last) == len(rows) + pad_rows
    assert indptr[0] == 0 and indptr[-1] == len(indices)
    for i, (row, n) in enumerate(zip(rows, kv_lens)):
        pages = indices[indptr[i] : indptr[i + 1]]
        assert len(pages) == -(-n // page_size)
        assert 1 <= last[i] <= page_size
        assert (len(pages) - 1) * page_size + last[i] == n
        for p, slot in enumerate(table.table[row, :n].tolist()):
            assert pages[p // page_size] == slot // page_size, (i, p)
            assert slot % page_size == p % page_size  # the paged layout FlashInfer reads
    for i in range(len(rows), len(rows) + pad_rows):
        assert indices[indptr[i] : indptr[i + 1]] == [PAD_PAGE] and last[i] == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_plan_lists_each_requests_pages_in_order_with_last_page_lengths(page_size):
    rng = random.Random(page_size)
    for _ in range(12):
        s = random_pool(rng, page_size, torch.float32, torch.device("cpu"))
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            batch = s.batch(mode)
            kv_lens = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]
            plan = plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, page_size)
            _check_plan_against_table(plan, s.table, s.rows, kv_lens, page_size)
            assert plan.kv_lens == kv_lens


def test_plan_into_a_graph_buffer_pads_rows_with_the_padding_page():
    rng = random.Random(7)
    s = random_pool(rng, 16, torch.float32, torch.device("cpu"))
    batch = s.batch(ForwardMode.DECODE)
    kv_lens = [p + 1 for p in batch.prefix_lens]
    buf = torch.full((64,), -5, dtype=torch.int32)
    plan = plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, 16, pad_rows=3, out=buf)
    _check_plan_against_table(plan, s.table, s.rows, kv_lens, 16, pad_rows=3)
    assert plan.indices.data_ptr() == buf.data_ptr()  # in the static buffer, in place
    assert buf[: plan.indices.numel()].tolist() == plan.indices.tolist()
    assert (buf[plan.indices.numel() :] == -5).all()
    # A capture: padding rows only.
    empty = torch.empty(0, dtype=torch.int64)
    only_pad = plan_paged_kv(s.table, empty, [], 16, pad_rows=4, out=buf)
    assert only_pad.indptr.tolist() == [0, 1, 2, 3, 4] and only_pad.indices.tolist() == [0] * 4
    with pytest.raises(ValueError, match="at least"):
        plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, 16, out=buf[:1])
    with pytest.raises(ValueError, match="at least one key"):
        plan_paged_kv(s.table, batch.req_pool_indices, [0] * len(kv_lens), 16)
    with pytest.raises(ValueError, match="table rows"):
        plan_paged_kv(s.table, batch.req_pool_indices[:0], kv_lens, 16)


@pytest.mark.parametrize(
    "page_size,window,dtype",
    [
        (1, None, torch.float32),
        (16, None, torch.float32),
        (16, 9, torch.float16),
        (1, 5, torch.float32),
    ],
)
def test_attention_through_the_plan_equals_torch_native(page_size, window, dtype):
    """End to end without FlashInfer: the pages the plan names, viewed as NHD pages, attended
    with FlashInfer's masking (queries at the end of the KV, `window_left`), give torch_native's
    output on the same pool, for extends (hits, chunks) and decodes."""
    heads, kv_heads, dim = 4, 2, 16
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    rng = random.Random(100 + page_size)
    g = torch.Generator().manual_seed(page_size)
    for _ in range(4):
        s = random_pool(rng, page_size, dtype, torch.device("cpu"), kv_heads, dim)
        native = TorchNativeBackend(s.pool, s.table, heads, kv_heads, dim, sliding_window=window)
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            batch = s.batch(mode)
            q, k, v = _qkv(batch.num_tokens, heads, kv_heads, dim, dtype, "cpu", g)
            native.init_forward_metadata(batch)
            want = native.forward(q, k, v, 0, batch).view(-1, heads, dim)  # stores k, v too
            kv_lens = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]
            plan = plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, page_size)
            got = attention_through_plan(
                q,
                s.pool.k[0],
                s.pool.v[0],
                plan,
                batch.extend_lens,
                page_size,
                dim**-0.5,
                window_left(window),
            )
            torch.testing.assert_close(got.float(), want.float(), **tol)


def test_padded_decode_through_the_plan_keeps_real_rows_and_finite_padding():
    heads, kv_heads, dim, ps = 4, 2, 16, 16
    rng = random.Random(3)
    s = random_pool(rng, ps, torch.float32, torch.device("cpu"), kv_heads, dim)
    s.pool.k[0][:ps].zero_()  # the padding page, as KVPool leaves it
    s.pool.v[0][:ps].zero_()
    native = TorchNativeBackend(s.pool, s.table, heads, kv_heads, dim)
    batch = s.batch(ForwardMode.DECODE)
    n = batch.batch_size
    q, k, v = _qkv(n + 3, heads, kv_heads, dim, torch.float32, "cpu")
    native.init_forward_metadata(batch)
    want = native.forward(q[:n], k[:n], v[:n], 0, batch).view(-1, heads, dim)
    kv_lens = [p + 1 for p in batch.prefix_lens]
    plan = plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, ps, pad_rows=3)
    got = attention_through_plan(q, s.pool.k[0], s.pool.v[0], plan, [1] * (n + 3), ps, 0.25)
    torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(got[n:]).all())


def tree_batch(s: Pool, rng: random.Random, depth: int = 3) -> ForwardBatch:
    """A draft-tree decode over `s` (page size 1), as `build_verify` lays one out: two rows a
    request, each reading its table row's first P slots, then a branch of up to `depth` fresh
    slots (the two branches share their first slot: a common ancestor), its own last, which
    the row's forward writes."""
    dev = s.table.table.device
    free = s.pool.allocator.alloc(2 * depth * len(s.rows))
    rows, prefix, tails, lens = [], [], [], []
    for row, p, n in zip(s.rows, s.prefix, s.extend):
        keep = rng.randint(1, p + n)  # the verified prefix
        shared = free.pop()
        for _ in range(2):
            # At least one slot past the shared one: each row writes a slot of its own.
            tail = [shared] + [free.pop() for _ in range(rng.randint(1, depth - 1))]
            rows.append(row)
            prefix.append(keep)
            tails.append(tail + [0] * (depth - len(tail)))
            lens.append(keep + len(tail))
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(rows), dtype=torch.int64, device=dev),
        positions=torch.tensor([n - 1 for n in lens], device=dev),
        out_cache_loc=torch.tensor(
            [t[n - k - 1] for t, n, k in zip(tails, lens, prefix)], device=dev
        ),
        req_pool_indices=torch.tensor(rows, device=dev),
        seq_lens=torch.tensor(lens, device=dev),
        prefix_lens=[n - 1 for n in lens],
        extend_lens=[1] * len(rows),
        logits_indices=torch.arange(len(rows), device=dev),
        tree_prefix=torch.tensor(prefix, device=dev),
        tree_tail=torch.tensor(tails, device=dev),
    )


def test_draft_tree_rows_through_the_plan_equal_torch_native():
    """A tree decode's rows through the plan's pages (page size 1: a branch's slots are its
    pages) give torch_native's output, which reads the same tails; at larger pages the plan
    refuses the tails."""
    heads, kv_heads, dim = 4, 2, 16
    rng = random.Random(21)
    g = torch.Generator().manual_seed(21)
    checked = 0
    for _ in range(4):
        s = random_pool(rng, 1, torch.float32, torch.device("cpu"), kv_heads, dim)
        native = TorchNativeBackend(s.pool, s.table, heads, kv_heads, dim)
        batch = tree_batch(s, rng)
        q, k, v = _qkv(batch.batch_size, heads, kv_heads, dim, torch.float32, "cpu", g)
        native.init_forward_metadata(batch)
        want = native.forward(q, k, v, 0, batch).view(-1, heads, dim)  # stores k, v too
        kv_lens = batch.seq_lens.tolist()
        tree = (batch.tree_prefix, batch.tree_tail)
        plan = plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, 1, tree=tree)
        for i, (p, n) in enumerate(zip(batch.tree_prefix.tolist(), kv_lens)):
            pages = plan.indices[plan.indptr[i] : plan.indptr[i + 1]].tolist()
            row = batch.req_pool_indices[i]
            assert pages == s.table.table[row, :p].tolist() + batch.tree_tail[i, : n - p].tolist()
            checked += n > p
        got = attention_through_plan(
            q, s.pool.k[0], s.pool.v[0], plan, [1] * batch.batch_size, 1, dim**-0.5
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Without the tails, the rows would read their table rows' slots instead: different.
        plain = plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, 1)
        assert not torch.equal(plain.indices, plan.indices)
    assert checked > 0
    with pytest.raises(ValueError, match="at page size 1, not 16"):
        plan_paged_kv(s.table, batch.req_pool_indices, kv_lens, 16, tree=tree)


def test_window_left_counts_the_querys_own_key():
    assert window_left(None) == -1
    assert window_left(1) == 0  # a window of one key: the query's own
    assert window_left(4096) == 4095


def test_prefill_kernels_default_to_fa2_and_an_unknown_choice_names_the_variable(monkeypatch):
    monkeypatch.delenv("BRAID_FLASHINFER_PREFILL", raising=False)
    assert prefill_kernels() == "fa2"
    monkeypatch.setenv("BRAID_FLASHINFER_PREFILL", "fa3")
    assert prefill_kernels() == "fa3"
    monkeypatch.setenv("BRAID_FLASHINFER_PREFILL", "fa4")
    with pytest.raises(ValueError, match=r"BRAID_FLASHINFER_PREFILL='fa4'.*fa2, fa3, auto"):
        prefill_kernels()


# ---- configuration: a missing package, bad names, per-phase choice ----------------------------


@without_flashinfer
@pytest.mark.parametrize(
    "field", ["attention_backend", "prefill_attention_backend", "decode_attention_backend"]
)
def test_flashinfer_without_the_package_is_refused_naming_it(field):
    with pytest.raises(ValueError, match=rf"{field} 'flashinfer' needs the flashinfer-python"):
        EngineConfig(device="cuda", **{field: "flashinfer"})
    with pytest.raises(ValueError, match="needs the flashinfer-python package"):
        import_flashinfer()
    pool = KVPool(1, 4, 1, 2, 64, torch.float16, torch.device("cpu"))
    table = ReqToTokenPool(2, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):  # before the package
        create_backend(
            "flashinfer", kv_pool=pool, req_to_token=table, num_heads=4, num_kv_heads=2, head_dim=64
        )


@pytest.mark.parametrize(
    "field", ["attention_backend", "prefill_attention_backend", "decode_attention_backend"]
)
def test_flashinfer_with_an_fp8_kv_cache_is_refused_naming_both(field):
    with pytest.raises(ValueError, match=rf"{field} 'flashinfer' with kv_cache_dtype 'fp8'"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8", **{field: "flashinfer"})


@pytest.mark.parametrize(
    "field", ["attention_backend", "prefill_attention_backend", "decode_attention_backend"]
)
def test_what_flashinfer_cannot_run_is_refused_before_any_process_starts(field):
    """A float32 model or a CPU device, refused by the config whether or not the package is
    installed; a model's heads and a pool's dtype, by the backend before it imports it."""
    for dtype in ("float32", "float"):
        with pytest.raises(ValueError, match=rf"{field} 'flashinfer' runs float16 or bfloat16"):
            EngineConfig(device="cuda", dtype=dtype, **{field: "flashinfer"})
    with pytest.raises(ValueError, match=rf"{field} 'flashinfer' runs on CUDA, not device 'cpu'"):
        EngineConfig(device="cpu", **{field: "flashinfer"})
    table = ReqToTokenPool(2, 8, torch.device("cpu"))
    cases = [
        (torch.float16, 5, 2, 64, r"num_heads \(5\) must be a multiple of num_kv_heads \(2\)"),
        (torch.float16, 4, 2, 96, r"supports head dims \[64, 128, 256\], the model has 96"),
        (torch.float32, 4, 2, 64, "runs float16 or bfloat16, not torch.float32"),
    ]
    for dtype, heads, kv_heads, head_dim, message in cases:
        pool = KVPool(1, 4, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
        with pytest.raises(ValueError, match=message):
            create_backend(
                "flashinfer",
                kv_pool=pool,
                req_to_token=table,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
            )


@without_flashinfer
def test_serve_with_flashinfer_absent_exits_with_the_package_name(caplog):
    args = build_parser().parse_args(["serve", "--attention-backend", "flashinfer"])
    with caplog.at_level(logging.ERROR):
        assert serve(args) == 2
    assert "flashinfer-python" in caplog.text


@pytest.mark.parametrize("field", ["prefill_attention_backend", "decode_attention_backend"])
def test_bad_per_phase_backend_names_are_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"{field} must be None or one of .*'flashinfer'"):
        EngineConfig(**{field: "flash"})
    assert build_parser().parse_args(["serve", f"--{field.replace('_', '-')}", "triton"])


def test_per_phase_backends_default_to_attention_backend_and_pick_the_graph_backend():
    cpu = EngineConfig(device="cpu")
    assert cpu.effective_prefill_attention_backend == "torch_native"
    assert cpu.effective_decode_attention_backend == "torch_native"
    mixed = EngineConfig(device="cpu", prefill_attention_backend="triton")
    assert mixed.effective_prefill_attention_backend == "triton"
    assert mixed.effective_decode_attention_backend == "torch_native"
    # CUDA graphs follow the decode backend.
    assert EngineConfig(
        device="cuda", attention_backend="torch_native", decode_attention_backend="triton"
    ).use_cuda_graph
    assert not EngineConfig(device="cuda", decode_attention_backend="torch_native").use_cuda_graph


def _generate(sched, prompts, max_tokens):
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(f"r{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY), 0))
    tokens = run_to_end(sched)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_prefill_on_torch_native_and_decode_on_triton_give_transformers_greedy_tokens(
    tiny_model_dirs,
):
    """Two backends over one KV pool (on CUDA where there is one, else on the CPU with triton
    interpreted): a cold prompt, then a batch with a full and a partial prefix-cache hit."""
    path = tiny_model_dirs["llama"]
    sched = local_scheduler(
        path,
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
        disable_cuda_graph=True,  # each decode step through the backend's hooks, counted
        kv_tokens=256,
        page_size=2,
        prefill_attention_backend="torch_native",
        decode_attention_backend="triton",
    )
    runner = sched.runner
    assert isinstance(runner.prefill_backend, TorchNativeBackend)
    assert isinstance(runner.attn_backend, TritonBackend)
    assert runner.attn_backend.kv_pool is runner.prefill_backend.kv_pool
    seen = {ForwardMode.EXTEND: set(), ForwardMode.DECODE: set()}
    for backend in (runner.prefill_backend, runner.attn_backend):
        real = backend.init_forward_metadata

        def record(batch, real=real, backend=backend):
            seen[batch.mode].add(type(backend).__name__)
            return real(batch)

        backend.init_forward_metadata = record
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    first = torch.randint(0, 512, (30,), generator=g).tolist()
    second = first[:20] + torch.randint(0, 512, (6,), generator=g).tolist()
    want = [hf_greedy(hf, p, 4, eos=False) for p in (first, second)]
    assert _generate(sched, [first], 4) == want[:1]
    assert _generate(sched, [first, second], 4) == want
    assert seen == {
        ForwardMode.EXTEND: {"TorchNativeBackend"},
        ForwardMode.DECODE: {"TritonBackend"},
    }


# ---- GPU, with FlashInfer ----------------------------------------------------------------------


def _gpu_pool(page_size, dtype, prefix, extend, kv_heads, head_dim, seed=0):
    """A pool on CUDA with requests of `prefix` cached tokens and `extend` new ones."""
    dev = torch.device("cuda")
    ctx = max(p + n for p, n in zip(prefix, extend)) + 1
    pages = sum(-(-(p + n + 1) // page_size) for p, n in zip(prefix, extend)) + 2
    pool = KVPool(1, pages, page_size, kv_heads, head_dim, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    for buf in pool.k + pool.v:
        buf.normal_(generator=g)
        buf[:page_size].zero_()
    table = ReqToTokenPool(len(prefix) + 1, ctx, dev)
    rows, slots = [], []
    alloc = pool.allocator
    free = alloc.alloc(alloc.free_pages)
    random.Random(seed).shuffle(free)
    alloc.free(free)
    for p, n in zip(prefix, extend):
        row = table.alloc()
        got = alloc.alloc(alloc.pages_for(p + n))
        s = (torch.tensor(got)[:, None] * page_size + torch.arange(page_size)).flatten()[: p + n]
        table.write(row, 0, s.to(dev))
        rows.append(row)
        slots.append(s.to(dev))
    return Pool(pool, table, rows, slots, list(prefix), list(extend))


REAL_SIZES = [
    # (mode, prefix lengths, new tokens): decode at a 4k context, extends with and without hits
    ("decode", [4095], [1]),
    ("decode", [4095] * 32, [1] * 32),
    ("decode", [4095] * 256, [1] * 256),
    ("extend", [0] * 8 + [1024] * 8, [512] * 16),
    ("extend", [0], [4096]),
]


@pytest.mark.parametrize("mode,prefix,extend", REAL_SIZES, ids=lambda x: str(x)[:12])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "dtype,head_dim,heads,kv_heads,window",
    [
        (torch.bfloat16, 128, 32, 8, None),  # Llama-3.1-8B: tensor-core decode (group 4)
        (torch.float16, 64, 8, 8, None),  # MHA: the CUDA-core decode kernel
        (torch.bfloat16, 256, 16, 8, 1024),  # Gemma-like: head dim 256, sliding window
        (torch.bfloat16, 128, 32, 8, 1000),  # Mistral-like: head dim 128, a window < the context
    ],
)
@pytest.mark.gpu
@needs_flashinfer
def test_flashinfer_matches_torch_native_at_real_sizes(
    mode, prefix, extend, page_size, dtype, head_dim, heads, kv_heads, window
):
    s = _gpu_pool(page_size, dtype, prefix, extend, kv_heads, head_dim)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=window)
    fi = create_backend("flashinfer", kv_pool=s.pool, req_to_token=s.table, **kw)
    native = create_backend("torch_native", kv_pool=s.pool, req_to_token=s.table, **kw)
    assert fi.use_tensor_cores == (heads // kv_heads >= 4)
    batch = s.batch(ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = _qkv(batch.num_tokens, heads, kv_heads, head_dim, dtype, "cuda", g)
    native.init_forward_metadata(batch)
    want = native.forward(q.clone(), k, v, 0, batch)
    fi.init_forward_metadata(batch)
    got = fi.forward(q.clone(), k, v, 0, batch)
    assert got.shape == want.shape == (batch.num_tokens, heads * head_dim)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _captured_decode(backend, bs: int, dtype: torch.dtype):
    """A decode of `bs` padding rows captured in a CUDA graph through `backend` (after
    `init_cuda_graph_state`): the graph, its static batch, its static (q, k, v) and output."""
    dev = torch.device("cuda")
    heads, kv_heads, dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    qkv = (
        torch.zeros(bs, heads, dim, dtype=dtype, device=dev),
        torch.zeros(bs, kv_heads, dim, dtype=dtype, device=dev),
        torch.zeros(bs, kv_heads, dim, dtype=dtype, device=dev),
    )
    static = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
        positions=torch.zeros(bs, dtype=torch.int64, device=dev),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=dev),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=dev),
        seq_lens=torch.ones(bs, dtype=torch.int64, device=dev),
        prefix_lens=[0] * bs,
        extend_lens=[1] * bs,
        logits_indices=torch.arange(bs, device=dev),
    )
    backend.init_forward_metadata_capture_cuda_graph(static)
    backend.forward(*qkv, 0, static)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*qkv, 0, static)
    return graph, static, qkv, out


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_decode_through_a_cuda_graph_equals_eager(page_size):
    """Capture at bs=8 over padding rows, replay twice with different real batches (5 and 8
    rows) after the replay hook: the graph's output equals eager FlashInfer's, padding finite."""
    heads, kv_heads, dim, dtype = 32, 8, 128, torch.bfloat16
    lengths = [[300, 7, 1000, 64, 2000], [5, 17, 33, 4000, 90, 1, 256, 1500]]
    s = _gpu_pool(page_size, dtype, [4000] * 8, [1] * 8, kv_heads, dim)  # room for any row
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    eager = create_backend("flashinfer", kv_pool=s.pool, req_to_token=s.table, **kw)
    graphed = create_backend("flashinfer", kv_pool=s.pool, req_to_token=s.table, **kw)
    bs, dev = 8, torch.device("cuda")
    graphed.init_cuda_graph_state(16)
    graph, static, (static_q, static_k, static_v), out = _captured_decode(graphed, bs, dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    for lens in lengths:
        n = len(lens)
        rows = s.rows[:n]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.tensor([x - 1 for x in lens], device=dev),
            out_cache_loc=torch.stack([s.slots[i][x - 1] for i, x in enumerate(lens)]),
            req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=torch.tensor(lens, device=dev),
            prefix_lens=[x - 1 for x in lens],
            extend_lens=[1] * n,
            logits_indices=torch.arange(n, device=dev),
        )
        q, k, v = _qkv(n, heads, kv_heads, dim, dtype, "cuda", g)
        eager.init_forward_metadata(batch)
        want = eager.forward(q, k, v, 0, batch)
        static_q[:n], static_k[:n], static_v[:n] = q, k, v
        static_q[n:] = 0
        static.out_cache_loc[:n] = batch.out_cache_loc
        static.out_cache_loc[n:] = 0
        graphed.init_forward_metadata_replay_cuda_graph(batch, bs)
        graph.replay()
        torch.testing.assert_close(out[:n].float(), want.float(), atol=2e-2, rtol=2e-2)
        assert bool(torch.isfinite(out[n:]).all())


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (8, 8, 64)])
def test_flashinfer_reads_draft_tree_tails_eager_and_through_a_cuda_graph(heads, kv_heads, dim):
    """Tree rows (`tree_batch`) through FlashInfer's decode equal torch_native's on the same
    pool, eager and replayed from a graph captured over padding rows; at page size 16 the
    backend refuses the tails."""
    rng, dev, dtype = random.Random(5), torch.device("cuda"), torch.bfloat16
    s = random_pool(rng, 1, dtype, dev, kv_heads, dim)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    native = TorchNativeBackend(s.pool, s.table, heads, kv_heads, dim)
    eager = create_backend("flashinfer", kv_pool=s.pool, req_to_token=s.table, **kw)
    graphed = create_backend("flashinfer", kv_pool=s.pool, req_to_token=s.table, **kw)
    for b in (eager, graphed):
        b.enable_tree_tails(3)
    bs = 16
    graphed.init_cuda_graph_state(bs)
    graph, static, (static_q, static_k, static_v), out = _captured_decode(graphed, bs, dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    batch = tree_batch(s, rng)
    n = batch.batch_size
    q, k, v = _qkv(n, heads, kv_heads, dim, dtype, "cuda", g)
    native.init_forward_metadata(batch)
    want = native.forward(q, k, v, 0, batch)  # stores k, v
    eager.init_forward_metadata(batch)
    got = eager.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    static_q[:n], static_k[:n], static_v[:n] = q, k, v
    static.out_cache_loc[:n] = batch.out_cache_loc
    graphed.init_forward_metadata_replay_cuda_graph(batch, bs)
    graph.replay()
    torch.testing.assert_close(out[:n].float(), want.float(), atol=2e-2, rtol=2e-2)
    paged = random_pool(rng, 16, dtype, dev, kv_heads, dim)
    fi16 = create_backend("flashinfer", kv_pool=paged.pool, req_to_token=paged.table, **kw)
    with pytest.raises(ValueError, match="at page_size 1, not 16"):
        fi16.enable_tree_tails(3)


def _tiny_llama_head_dim_64(path):
    import transformers as tf

    torch.manual_seed(1234)
    cfg = tf.LlamaConfig(**TINY, head_dim=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(path))
    return model.eval()


# How the runtime runs FlashInfer: both phases, at two page sizes; with decode rows mixed into
# prefill steps (FlashInfer's prefill wrapper takes them); FlashInfer prefill beside Triton
# decode over one pool.
RUNTIME_SETUPS = {
    "page 1": dict(attention_backend="flashinfer", page_size=1),
    "page 16": dict(attention_backend="flashinfer", page_size=16),
    "mixed steps": dict(attention_backend="flashinfer", page_size=1, enable_mixed_chunk=True),
    "prefill flashinfer, decode triton": dict(
        prefill_attention_backend="flashinfer", decode_attention_backend="triton", page_size=1
    ),
}


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("setup", list(RUNTIME_SETUPS))
def test_runtime_through_flashinfer_and_cuda_graphs_gives_transformers_greedy_tokens(
    tmp_path, setup
):
    """A tiny Llama with head dim 64 (FlashInfer has no 16) in float16 (it has no float32):
    greedy tokens through the scheduler, decode replayed from CUDA graphs, equal transformers'
    float32 greedy tokens wherever transformers' top two logits are not a near tie (beyond
    one, float16 rounding may pick either); with hits and chunks. (Calibrated on CPU with
    torch_native in float16 and bfloat16: every token matched, and the rule compares 31 of
    the 48.) `setup`: `RUNTIME_SETUPS`."""
    hf = _tiny_llama_head_dim_64(tmp_path / "m")
    rng = random.Random(5)
    base = [rng.randrange(512) for _ in range(40)]
    prompts = [base, base[:32] + [rng.randrange(512) for _ in range(9)], base[:5], base * 3]
    new = 12
    kw = dict(dtype="float16", kv_tokens=4096, chunked_prefill_size=64, **RUNTIME_SETUPS[setup])
    fi = local_scheduler(tmp_path / "m", **kw)
    phases = (fi.runner.prefill_backend, fi.runner.attn_backend)
    want_phases = (
        "FlashInferBackend",
        "TritonBackend" if "triton" in setup else "FlashInferBackend",
    )
    assert tuple(type(b).__name__ for b in phases) == want_phases
    assert fi.runner.graph_runner is not None
    got = _generate(fi, prompts, new)
    assert sum(fi.runner.graph_runner.replays.values()) > 0
    if setup == "mixed steps":
        assert fi.stats.mixed_steps > 0
    compared = 0
    for p, tokens in zip(prompts, got):
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = out.sequences[0, len(p) :].tolist()
        for step, scores in enumerate(out.scores):
            top2 = scores[0].float().topk(2).values
            if float(top2[0] - top2[1]) < 0.05:
                break
            assert tokens[step] == want[step], (p[:5], step)
            compared += 1
    assert compared >= 2 * new  # the check is not vacuous


@pytest.mark.parametrize(
    "backends, refused",
    [
        (dict(decode_attention_backend="flashinfer"), "decode_attention_backend"),
        (dict(attention_backend="flashinfer"), "attention_backend"),
        # The EAGLE drafter runs attention_backend, and its tree batches carry tails too.
        (
            dict(attention_backend="flashinfer", decode_attention_backend="triton"),
            "attention_backend",
        ),
    ],
)
def test_draft_trees_with_flashinfer_are_refused_at_configuration_past_page_size_1(
    backends, refused
):
    trees = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path="/nonexistent",
        speculative_eagle_topk=2,
    )
    with pytest.raises(
        ValueError, match=rf"{refused} 'flashinfer' reads draft-tree tails .* not 16"
    ):
        EngineConfig(device="cuda", page_size=16, **backends, **trees)
    # At page size 1 the trees are read: only a missing package is refused.
    if HAS_FLASHINFER:
        EngineConfig(device="cuda", page_size=1, **backends, **trees)
    else:
        with pytest.raises(ValueError, match="needs the flashinfer-python package"):
            EngineConfig(device="cuda", page_size=1, **backends, **trees)
