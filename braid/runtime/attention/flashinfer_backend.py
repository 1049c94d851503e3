"""Attention through FlashInfer's paged kernels (the optional `flashinfer-python` package).

FlashInfer reads a paged KV cache described in CSR form: request i's pages are
`indices[indptr[i]:indptr[i + 1]]`, in order, and its last page holds `last_page_len[i]` tokens.
braid's KV pool is already paged: slot s lives in page `s // page_size` at offset
`s % page_size`, and a request's table row maps position p to a slot at offset
`p % page_size` of its `p // page_size`-th page (`assign_slots`; radix-cache edges are whole
pages). So each layer's [slots, kv_heads, head_dim] buffer, viewed as
[pages, page_size, kv_heads, head_dim], is FlashInfer's NHD layout with no copy, and a request's
pages are the slots at positions 0, page_size, 2 * page_size, ... of its row, divided by the
page size (`plan_paged_kv`).

Prefill runs `BatchPrefillWithPagedKVCacheWrapper` alone: each layer first writes the new
tokens' K/V into the pool (as every braid backend does), then one causal kernel reads prefix
and new tokens through the same page list, queries aligned to the end of the KV. (SGLang's
alternative, a ragged kernel over the new tokens plus a paged one over the prefix merged by
their log-sum-exps, saves re-reading the new K/V from the pool on long cold prompts but is two
kernels and a merge per layer; one kernel keeps prefix hits, chunks and cold prompts on one
path and one softmax.) Decode runs `BatchDecodeWithPagedKVCacheWrapper`, with tensor cores
(FlashInfer's prefill kernel) when four or more query heads share a KV head: the group then
fills an MMA tile instead of repeating a KV read per head.

Plans are built once per forward, before the first layer, on the host (lengths, indptr) and on
the device (page indices gathered from the table, no host synchronisation); every layer reuses
them. The planning is plain torch (`plan_paged_kv`, and `attention_through_plan`, the torch
reference that attends through a plan), importable and tested without FlashInfer; `flashinfer`
itself is imported only when a backend is built.

Supported: CUDA, float16 / bfloat16 KV (FlashInfer has no float32 kernels), head dims 64, 128
and 256, any page size, sliding windows (`window_left = sliding_window - 1`: braid's window
counts the query's own key), decode CUDA graphs, and draft-tree tails (speculative decoding
with trees) at page size 1: a tree row's keys are its table row's first `tree_prefix` slots,
then the slots of its branch (`ForwardBatch.tree_tail`), and at page size 1 a slot is a page,
so the row's page list is just those slots (`plan_paged_kv(tree=...)`), read by the plain
decode kernel. At larger pages a branch's slots are not whole pages, and trees never go with a
sliding window (`AttentionBackend.enable_tree_tails`): both refused, as `EngineConfig` refuses
them at construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from braid.runtime.attention import BACKENDS
from braid.runtime.attention.base import AttentionBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.layers.rotary import FusedRotaryTables, apply_rotary

PACKAGE = "flashinfer-python"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer's recommended float workspace (split-KV partial results), shared by the wrappers:
# one forward runs at a time on the stream.
WORKSPACE_BYTES = 128 * 2**20
# Padding rows of a captured decode batch read one key: slot 0 of page 0, the KV pool's
# padding page (never handed out, zeroed at start).
PAD_PAGE = 0
# Decode groups at least this large run FlashInfer's tensor-core (prefill) kernel.
TENSOR_CORE_MIN_GROUP = 4
# FlashInfer's prefill implementation: "fa2" (its FlashAttention-2 kernels), not "auto", which
# picks "fa3" on Hopper. fa3 is the faster prefill on the H200 (prefill 8k MFU 0.750 against
# fa2's 0.699, one machine, 2026-12-04; Triton's 0.757 there: docs/benchmarks.md, "FlashInfer"),
# but its build takes 97-133 s for one shape against fa2's 64 s for four, fa2's module also
# serves the tensor-core decode, and fa3 has not run the backend's GPU tests at every shape
# they cover. BRAID_FLASHINFER_PREFILL (`PREFILL_KERNELS_ENV`) picks another for measuring.
PREFILL_KERNELS = "fa2"
PREFILL_KERNELS_ENV = "BRAID_FLASHINFER_PREFILL"
PREFILL_KERNEL_CHOICES = ("fa2", "fa3", "auto")


def prefill_kernels() -> str:
    """FlashInfer's prefill implementation: `PREFILL_KERNELS`, or BRAID_FLASHINFER_PREFILL when
    set (`ValueError` naming the variable for a value FlashInfer has no kernels for)."""
    value = os.environ.get(PREFILL_KERNELS_ENV, "").strip() or PREFILL_KERNELS
    if value not in PREFILL_KERNEL_CHOICES:
        raise ValueError(
            f"{PREFILL_KERNELS_ENV}={value!r}: FlashInfer's prefill kernels are one of "
            f"{', '.join(PREFILL_KERNEL_CHOICES)}"
        )
    return value


def import_flashinfer() -> Any:
    """The `flashinfer` module; `ValueError` naming the package to install when it is absent."""
    try:
        import flashinfer
    except ImportError as e:
        raise ValueError(
            f"attention backend 'flashinfer' needs the {PACKAGE} package, which is not "
            f"installed (pip install {PACKAGE}, or braid[flashinfer]); or choose 'triton' or "
            "'torch_native' (--attention-backend, --prefill-attention-backend, "
            "--decode-attention-backend)"
        ) from e
    return flashinfer


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's `window_left` for braid's `sliding_window`: a query at position p sees keys
    p - window_left .. p, braid's window of w keys includes the query's own (-1: no window)."""
    return -1 if sliding_window is None else sliding_window - 1


def _host_int32(values: list[int], pin: bool) -> torch.Tensor:
    # Pinned when the device is CUDA, so that FlashInfer's non-blocking copies of it are.
    return torch.tensor(values, dtype=torch.int32, pin_memory=pin)


@dataclass(frozen=True)
class PagedKVPlan:
    """A batch's KV in FlashInfer's CSR form. Request i's pages are
    `indices[indptr[i]:indptr[i + 1]]` in position order, its last page holding
    `last_page_len[i]` (1..page_size) tokens. `indptr` and `last_page_len` are int32 on the
    host (FlashInfer plans on the host), `indices` int32 on the table's device. `kv_lens`: the
    keys each row reads (padding rows: 1)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: list[int]


def plan_paged_kv(
    table: ReqToTokenPool,
    req_pool_indices: torch.Tensor,
    kv_lens: list[int],
    page_size: int,
    *,
    pad_rows: int = 0,
    out: torch.Tensor | None = None,
    tree: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PagedKVPlan:
    """The pages of each request: row `req_pool_indices[i]` of `table`, positions
    0..kv_lens[i]-1. Then `pad_rows` padding rows of one key each (`PAD_PAGE`, length 1).
    `tree`: a draft-tree decode's (`tree_prefix`, `tree_tail`), device tensors: row i's
    positions from `tree_prefix[i]` on are the slots `tree_tail[i]` lists (page size 1 only).

    The indices are gathered on the device without a host synchronisation (the lengths are
    host values); `out`, an int32 device buffer, receives them in its first entries (a CUDA
    graph's static buffer) instead of a new tensor. `ValueError` for a length < 1, a batch
    whose row count differs from `kv_lens`, or an `out` too small."""
    n = len(kv_lens)
    if req_pool_indices.shape[0] != n:
        raise ValueError(f"{req_pool_indices.shape[0]} table rows for {n} lengths")
    if any(k < 1 for k in kv_lens):
        raise ValueError(f"every row attends at least one key, got lengths {kv_lens}")
    if pad_rows < 0:
        raise ValueError(f"pad_rows must be >= 0, got {pad_rows}")
    if tree is not None and page_size != 1:
        raise ValueError(f"draft-tree tails are read at page size 1, not {page_size}")
    if tree is not None and not tree[0].shape[0] == tree[1].shape[0] == n:
        raise ValueError(
            f"draft-tree prefixes and tails of {tree[0].shape[0]} and {tree[1].shape[0]} rows "
            f"for {n} lengths"
        )
    counts = [-(-k // page_size) for k in kv_lens]
    indptr = [0]
    for c in counts + [1] * pad_rows:
        indptr.append(indptr[-1] + c)
    last = [k - (c - 1) * page_size for k, c in zip(kv_lens, counts)] + [1] * pad_rows
    device = table.table.device
    total, real = indptr[-1], indptr[n]
    if out is None:
        indices = torch.empty(total, dtype=torch.int32, device=device)
    else:
        if out.dtype != torch.int32 or out.device != device or out.numel() < total:
            raise ValueError(
                f"out must be an int32 tensor on {device} of at least {total} entries, got "
                f"{out.dtype} on {out.device} of {out.numel()}"
            )
        indices = out[:total]
    pin = device.type == "cuda"
    if real:
        counts_t = torch.tensor(counts, dtype=torch.int64, pin_memory=pin).to(
            device, non_blocking=True
        )
        row_of = torch.repeat_interleave(torch.arange(n, device=device), counts_t, output_size=real)
        first = torch.cumsum(counts_t, 0) - counts_t  # each row's first entry
        page_no = torch.arange(real, device=device) - first[row_of]
        slots = table.table[req_pool_indices[row_of], page_no * page_size]
        if tree is not None:  # past a row's prefix, its branch's slots
            prefix, tail = tree[0][row_of], tree[1]
            depth = tail.shape[1]
            at = row_of * depth + (page_no - prefix).clamp(0, depth - 1)
            slots = torch.where(page_no < prefix, slots, tail.reshape(-1)[at])
        indices[:real] = torch.div(slots, page_size, rounding_mode="floor")
    indices[real:] = PAD_PAGE
    return PagedKVPlan(
        indptr=_host_int32(indptr, pin),
        indices=indices,
        last_page_len=_host_int32(last, pin),
        kv_lens=list(kv_lens) + [1] * pad_rows,
    )


def attention_through_plan(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    plan: PagedKVPlan,
    qo_lens: list[int],
    page_size: int,
    sm_scale: float,
    window_left: int = -1,
) -> torch.Tensor:
    """Plain-torch attention that reads the KV only as FlashInfer is told to (the reference its
    tests compare against): the pages `plan` names, of `k_buf` / `v_buf` ([slots, kv_heads,
    head_dim]) viewed as NHD pages [pages, page_size, kv_heads, head_dim], the last cut at
    `last_page_len`. Row i's `qo_lens[i]` queries are its last positions, causal, each seeing
    keys back to `window_left` before it (-1: all). `q`: [sum(qo_lens), heads, head_dim];
    returns the same shape, in q's dtype."""
    kv_heads, dim = k_buf.shape[1], k_buf.shape[2]
    k_pages = k_buf.view(-1, page_size, kv_heads, dim)
    v_pages = v_buf.view(-1, page_size, kv_heads, dim)
    indptr = plan.indptr.tolist()
    last = plan.last_page_len.tolist()
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(qo_lens):
        pages = plan.indices[indptr[i] : indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + last[i]
        k = k_pages[pages].reshape(-1, kv_heads, dim)[:kv_len]
        v = v_pages[pages].reshape(-1, kv_heads, dim)[:kv_len]
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window_left >= 0:
            mask &= q_pos - k_pos <= window_left
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            attn_mask=mask,
            scale=sm_scale,
            enable_gqa=True,
        )
        out[start : start + n] = o.transpose(0, 1).to(q.dtype)
        start += n
    return out


@dataclass(frozen=True)
class _Meta:
    wrapper: Any  # the FlashInfer wrapper planned for this forward
    plan: PagedKVPlan


@dataclass
class _GraphState:
    max_bs: int
    indptr: torch.Tensor  # int32 [max_bs + 1]: each captured size's wrapper reads a prefix
    last_page_len: torch.Tensor  # int32 [max_bs]
    indices: torch.Tensor  # int32: a full table row's pages for every row
    wrappers: dict[int, Any] = field(default_factory=dict)  # batch size -> its wrapper


@BACKENDS.register
class FlashInferBackend(AttentionBackend):
    """Attention through FlashInfer's paged prefill and decode kernels over braid's KV pool
    (module docstring: the layout, the choices, what is supported).

    CUDA graphs (decode), as `AttentionBackend` describes them: `init_cuda_graph_state(max_bs)`
    allocates static int32 indptr / last-page-length / page-index buffers (the index buffer
    holds a whole table row's pages for each of max_bs rows: rows may share pages through the
    prefix cache, so the pool's size is no bound). A captured size bs gets its own
    `use_cuda_graph=True` decode wrapper over the first bs + 1 / bs entries of those buffers.
    Capture plans it for bs padding rows; replay fills the buffers with the real rows
    (`plan_paged_kv` into the static index buffer, indptr and lengths copied by FlashInfer's
    `plan`), padding rows n..bs-1 reading slot 0 of the padding page, and re-plans the wrapper
    on the host: the plan runs outside the graph, the kernels inside read what it wrote.
    """

    supports_cuda_graph = True

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        # What the model and the pool ask is checked before the package is imported.
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if head_dim not in HEAD_DIMS:
            raise ValueError(
                f"attention backend 'flashinfer' supports head dims {list(HEAD_DIMS)}, the model "
                f"has {head_dim}; use 'triton'"
            )
        dtype = kv_pool.k[0].dtype
        if dtype not in DTYPES:
            raise ValueError(
                f"attention backend 'flashinfer' runs float16 or bfloat16, not {dtype} (dtype="
                "'bfloat16' or 'float16'; float32 runs on 'triton' or 'torch_native')"
            )
        device = req_to_token.table.device
        if device.type != "cuda":
            raise ValueError(
                f"attention backend 'flashinfer' runs on CUDA, not {device.type}; use "
                "'torch_native' (or 'triton' under TRITON_INTERPRET=1)"
            )
        flashinfer = import_flashinfer()
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.window_left = window_left(sliding_window)
        self.page_size = kv_pool.page_size
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self._fi = flashinfer
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_kernels()
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        # Each layer's K and V as NHD pages: views of the pool, no copy.
        ps = self.page_size
        self._pages = [
            (k.view(-1, ps, num_kv_heads, head_dim), v.view(-1, ps, num_kv_heads, head_dim))
            for k, v in zip(kv_pool.k, kv_pool.v)
        ]
        self._graph: _GraphState | None = None
        self._planned: dict[int, torch.cuda.Event] = {}  # wrapper id -> after its last plan

    @property
    def device(self) -> torch.device:
        return self.req_to_token.table.device

    def enable_tree_tails(self, depth: int) -> None:
        """Draft-tree tails are read as page lists (module docstring): at page size 1 only,
        and not with a sliding window (`AttentionBackend`'s refusal)."""
        super().enable_tree_tails(depth)
        if self.page_size != 1:
            raise ValueError(
                "attention backend 'flashinfer' reads draft-tree tails (speculative decoding "
                f"with speculative_eagle_topk > 1) at page_size 1, not {self.page_size}: a "
                "branch's slots are not whole pages (or use 'triton' for decode)"
            )

    def _kv_lens(self, batch: ForwardBatch) -> list[int]:
        return [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]

    def _tree(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        if batch.tree_prefix is None:
            return None
        self.enable_tree_tails(0)  # refuses what cannot be read
        return batch.tree_prefix, batch.tree_tail

    def _planning(self, wrapper: Any) -> None:
        """Before re-planning `wrapper`: wait until the device has taken its last plan.
        FlashInfer's `plan` writes a pinned host buffer and queues its copy to the device
        without waiting; with the overlap schedule the next plan can come before that copy has
        run, and would overwrite what it reads. The wait ends once the stream reaches the
        copy, which follows the step the host has already read back: in practice at once."""
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()

    def _planned_now(self, wrapper: Any) -> None:
        done = torch.cuda.Event()
        done.record()
        self._planned[id(wrapper)] = done

    def _plan_decode(self, wrapper: Any, plan: PagedKVPlan) -> None:
        self._planning(wrapper)
        wrapper.plan(
            plan.indptr,
            plan.indices,
            plan.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            window_left=self.window_left,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=self.scale,
        )
        self._planned_now(wrapper)

    # ---- eager ----------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        kv_lens = self._kv_lens(batch)
        table = self.req_to_token
        plan = plan_paged_kv(
            table, batch.req_pool_indices, kv_lens, self.page_size, tree=self._tree(batch)
        )
        if batch.mode is ForwardMode.DECODE:
            self._plan_decode(self._decode, plan)
            batch.attn_metadata = _Meta(self._decode, plan)
            return
        qo_indptr = [0]
        for n in batch.extend_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        self._planning(self._prefill)
        self._prefill.plan(
            _host_int32(qo_indptr, self.device.type == "cuda"),
            plan.indptr,
            plan.indices,
            plan.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            sm_scale=self.scale,
            window_left=self.window_left,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self._planned_now(self._prefill)
        batch.attn_metadata = _Meta(self._prefill, plan)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        rotary: tuple[Any, Any] | None = None,
    ) -> torch.Tensor:
        if q.dtype != self.dtype:
            raise ValueError(f"queries are {q.dtype} but the KV pool is {self.dtype}")
        k_buf = self.kv_pool.k[layer_id]
        v_buf = self.kv_pool.v[layer_id]
        if rotary is not None and isinstance(rotary[1], FusedRotaryTables):
            positions, tables = rotary
            tables.rotate(q, k, positions, store=(v, k_buf, v_buf, batch.out_cache_loc))
        else:
            if rotary is not None:
                q, k = apply_rotary(q, k, *rotary)
            self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        # q may be a strided view of the fused QKV output: FlashInfer reads its strides.
        o = batch.attn_metadata.wrapper.run(q, self._pages[layer_id])
        return o.reshape(q.shape[0], -1)

    # ---- CUDA-graph decode ----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static decode buffers for captured batches of up to `max_bs` rows."""
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        row_pages = -(-self.req_to_token.table.shape[1] // self.page_size)
        dev = self.device
        self._graph = _GraphState(
            max_bs=max_bs,
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=dev),
            indices=torch.zeros(max_bs * row_pages, dtype=torch.int32, device=dev),
        )

    def _graph_wrapper(self, batch: ForwardBatch, bs: int) -> tuple[_GraphState, Any]:
        g = self._graph
        if g is None:
            raise ValueError("init_cuda_graph_state(max_bs) must be called first")
        if batch.mode is not ForwardMode.DECODE:
            raise ValueError("only decode batches are captured in CUDA graphs")
        if not 1 <= bs <= g.max_bs:
            raise ValueError(f"batch size {bs} is outside [1, max_bs={g.max_bs}]")
        wrapper = g.wrappers.get(bs)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=g.indptr[: bs + 1],
                paged_kv_indices_buffer=g.indices,
                paged_kv_last_page_len_buffer=g.last_page_len[:bs],
            )
            g.wrappers[bs] = wrapper
        return g, wrapper

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Plan the size-`batch.batch_size` graph wrapper for padding rows only (what the
        warm-up and the capture run), and point `batch.attn_metadata` at it."""
        bs = batch.batch_size
        g, wrapper = self._graph_wrapper(batch, bs)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        plan = plan_paged_kv(
            self.req_to_token, empty, [], self.page_size, pad_rows=bs, out=g.indices
        )
        self._plan_decode(wrapper, plan)
        batch.attn_metadata = _Meta(wrapper, plan)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        """Fill the static buffers with the real decode `batch` (n <= bs rows) and padding
        rows n..bs-1, re-plan the size-bs wrapper, and set `batch.attn_metadata`."""
        g, wrapper = self._graph_wrapper(batch, bs)
        n = batch.batch_size
        if n > bs:
            raise ValueError(f"batch of {n} requests does not fit a graph of size {bs}")
        plan = plan_paged_kv(
            self.req_to_token,
            batch.req_pool_indices,
            self._kv_lens(batch),
            self.page_size,
            pad_rows=bs - n,
            out=g.indices,
            tree=self._tree(batch),
        )
        self._plan_decode(wrapper, plan)
        batch.attn_metadata = _Meta(wrapper, plan)
