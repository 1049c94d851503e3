"""`ModelRunner`: owns the model, the KV memory and the attention backend, and runs forwards.

Construction picks the device, dtype and backend once, loads the weights, sizes the KV pool
(from `kv_tokens` or a memory fraction) and logs one line with the sizes it chose; on CUDA, with a
decode backend that supports them, it then captures the decode forward in CUDA graphs
(`cuda_graph.py`). Prefill and decode may run different attention backends
(`prefill_attention_backend`, `decode_attention_backend`) over the one KV pool.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from braid.runtime.attention import create_backend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.config import EngineConfig
from braid.runtime.distributed.group import TPGroup, sharding
from braid.runtime.distributed.plan import PlanSender
from braid.runtime.distributed.split import head_shard
from braid.runtime.executor.cuda_graph import CudaGraphRunner
from braid.runtime.executor.profiler import PROFILER
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from braid.runtime.multimodal.encoder_cache import EncoderCache

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.15}
# Requests decoded together when `max_running_requests` is not given: the device's cap, or
# one per KV_TOKENS_PER_RUNNING tokens of KV when the pool is smaller. The cap bounds the
# request-to-token table (rows x context length x 8 bytes: 1 GB at 1024 x 128k) and the
# host's per-step work; on a GPU, large batches are what offline throughput needs.
DEFAULT_MAX_RUNNING = {"cuda": 1024, "cpu": 64}
KV_TOKENS_PER_RUNNING = {"cuda": 256, "cpu": 16}


def _available_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the memory the KV pool would live in."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError):
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


class ModelRunner:
    """`capture_hidden` / `aux_layers`: what the decode CUDA graphs also leave behind for a
    speculative proposer (see `ForwardBatch.capture_hidden`); eager forwards capture whatever
    a batch asks for.

    `tp`: this rank's tensor-parallel group (None: the whole model here). Each rank holds its
    heads' KV; the pool is sized by the rank with the least room. On rank 0, `plans` sends
    every forward, and the table and KV writes before it, to the other ranks
    (`distributed.plan`); theirs is None."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: Path | None,
        *,
        capture_hidden: bool = False,
        aux_layers: tuple[int, ...] = (),
        tp: TPGroup | None = None,
    ):
        self.config = config
        self.tp = tp
        self.model_config = model_config
        self.model_dir = model_dir  # None: random weights
        self.device = config.torch_device
        self.dtype = config.torch_dtype(model_config.dtype)
        self.kv_dtype = config.kv_torch_dtype(self.dtype)
        model_config.check_engine(config)
        ctx = config.context_length or model_config.max_position_embeddings
        # Start-up phases in seconds (the ready line's): weights, KV cache, graphs.
        self.phases: dict[str, float] = {}
        mark = time.perf_counter()
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.heads = head_shard(model_config.num_heads, model_config.num_kv_heads, rank, size)
        with sharding(tp):
            self.model = build_model(
                model_config,
                model_dir,
                dtype=self.dtype,
                device=self.device,
                max_positions=ctx,
                load_format=config.load_format,
                progress=config.show_progress and rank == 0,
                quantization=config.quantization,
                dequantize_gguf=config.dequantize_gguf,
            )
        self.phases["weights"] = time.perf_counter() - mark
        if tp is not None and self.device.type == "cuda":
            # Every rank takes part, so that all agree (a node may have turned it off).
            allowed = not config.disable_custom_all_reduce and config.nnodes == 1
            tp.enable_one_shot(self.dtype, self.device, allowed)
        mark = time.perf_counter()
        page = config.page_size
        if config.kv_tokens:
            kv_tokens, sized_by = config.kv_tokens, "kv_tokens"
        else:
            kv_tokens, sized_by = self._kv_tokens_from_memory()
        if tp is not None:
            kv_tokens = tp.min_int(kv_tokens)  # every rank holds the same slots
        num_pages = kv_tokens // page + 1  # +1: the padding page
        self.kv_pool = KVPool(
            model_config.num_layers,
            num_pages,
            page,
            self.heads.num_kv_heads,
            model_config.head_dim,
            self.kv_dtype,
            self.device,
            **self._kv_scales(model_config.num_layers),
        )
        capacity = self.kv_pool.allocator.capacity_tokens
        # A sequence longer than the whole pool could never run.
        self.context_length = min(ctx, capacity)
        kind = self.device.type
        self.max_running_requests = config.max_running_requests or min(
            DEFAULT_MAX_RUNNING[kind], max(1, capacity // KV_TOKENS_PER_RUNNING[kind])
        )
        # +1 row: a spare so a retracted or aborted request's row can be reused at once.
        self.req_to_token = ReqToTokenPool(
            self.max_running_requests + 1, self.context_length, self.device
        )
        # One backend per phase, both over the same KV pool and table; the same object when
        # the phases name the same backend. The decode one is what CUDA graphs capture.
        prefill_name = config.effective_prefill_attention_backend
        decode_name = config.effective_decode_attention_backend
        backend_args = dict(
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token,
            num_heads=self.heads.num_heads,
            num_kv_heads=self.heads.num_kv_heads,
            head_dim=model_config.head_dim,
            sliding_window=model_config.sliding_window,
        )
        self.attn_backend = create_backend(decode_name, **backend_args)
        self.prefill_backend = (
            self.attn_backend
            if prefill_name == decode_name
            else create_backend(prefill_name, **backend_args)
        )
        backend = (
            decode_name
            if prefill_name == decode_name
            else f"{prefill_name} (prefill) / {decode_name} (decode)"
        )
        # A speculative verify step is a decode batch of one row per verified token.
        rows = self.max_running_requests
        if config.speculative_algorithm is not None:
            rows *= 1 + max(config.speculative_steps, config.speculative_tree_nodes)
        graph_bs = min(config.effective_cuda_graph_max_bs, rows)
        logger.info(
            "%sKV cache: %d tokens of %s (%.2f GB, page size %d) on %s, sized by %s; "
            "weights %.2f GB; "
            "context length %d; max running requests %d; attention backend %s; CUDA graphs %s",
            f"tensor-parallel rank {rank} of {size}: " if tp is not None else "",
            capacity,
            str(self.kv_dtype).removeprefix("torch."),
            self.kv_pool.nbytes / 1e9,
            page,
            self.device,
            sized_by,
            sum(p.numel() * p.element_size() for p in self.model.parameters()) / 1e9,
            self.context_length,
            self.max_running_requests,
            backend,
            f"for decode batches up to {graph_bs}" if config.use_cuda_graph else "off",
        )
        # Vision-language models: tower outputs kept by image hash (scheduler process only).
        self.encoder_cache: EncoderCache | None = None
        if model_config.is_multimodal:
            self.encoder_cache = EncoderCache(config.encoder_cache_mb * 2**20)
        if config.speculative_tree_nodes:  # draft trees: rows read their branches' slots
            self.attn_backend.enable_tree_tails(config.speculative_steps)
        self.phases["kv cache"] = time.perf_counter() - mark
        # Chosen once: decode batches the runner accepts replay a graph, the rest run eagerly.
        self.graph_runner: CudaGraphRunner | None = None
        if config.use_cuda_graph:
            mark = time.perf_counter()
            depth = config.speculative_steps if config.speculative_tree_nodes else 0
            # Tensor-parallel ranks capture in lockstep (their graphs hold collectives), so
            # only a single rank leaves sizes for idle time.
            lazy = tp is None and not config.cuda_graph_capture_all_at_start
            self.graph_runner = CudaGraphRunner(
                self.model, self.attn_backend, graph_bs, capture_hidden, aux_layers, depth, lazy
            )
            self.phases["graphs"] = time.perf_counter() - mark
        self.capture_hidden = capture_hidden
        self.aux_layers = aux_layers
        self.plans: PlanSender | None = None
        if tp is not None and tp.is_leader:
            self.plans = PlanSender(
                tp, self.req_to_token.table, share_samples=config.use_overlap_schedule
            )
            self.kv_pool.journal = self.req_to_token.journal = self.plans.journal

    def _kv_scales(self, num_layers: int) -> dict[str, list[float]]:
        """An fp8 pool's `k_scales` / `v_scales` from the checkpoint (1.0 for a layer it gives
        none, as vLLM); nothing for a float pool, which has no use for them."""
        found = getattr(self.model, "kv_cache_scales", {})
        if self.kv_dtype != torch.float8_e4m3fn:
            if found:
                logger.info("the checkpoint's KV cache scales are unused: kv_cache_dtype is auto")
            return {}
        if found:
            logger.info("fp8 KV cache scales from the checkpoint for %d layers", len(found))
        return {
            f"{kind}_scales": [found.get(i, {}).get(kind, 1.0) for i in range(num_layers)]
            for kind in ("k", "v")
        }

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of this rank's KV pool per token: K and V of every layer, for this rank's KV
        heads, at the pool's element size (an fp8 cache: one byte, so twice the tokens of a
        16-bit cache and four times a float32 one's in the same memory)."""
        whole = self.model_config.kv_bytes_per_token(torch.finfo(self.kv_dtype).bits // 8)
        return whole * self.heads.num_kv_heads // self.model_config.num_kv_heads

    def _kv_tokens_from_memory(self) -> tuple[int, str]:
        """KV tokens that fit the memory budget, and how the budget was set (for the log)."""
        frac = self.config.mem_fraction_static or DEFAULT_MEM_FRACTION[self.device.type]
        free, total = _available_bytes(self.device)
        if self.device.type == "cuda":
            # As SGLang: the fraction covers weights and KV together; the rest of the GPU is
            # for activations and CUDA graphs.
            budget = total * frac - (total - free)
            how = (
                f"mem_fraction_static {frac} of {total / 1e9:.1f} GB total, "
                f"{(total - free) / 1e9:.1f} GB already in use"
            )
        else:
            budget = free * frac
            how = f"mem_fraction_static {frac} of {free / 1e9:.1f} GB available"
        tokens = int(budget // self.kv_bytes_per_token)
        if tokens < 16 * self.config.page_size:
            raise ValueError(
                f"not enough memory for a KV cache ({budget / 1e6:.0f} MB available); "
                "raise mem_fraction_static or pass kv_tokens"
            )
        return tokens, how

    def share_samples(self, next_ids: torch.Tensor) -> None:
        """Rank 0 of a tensor-parallel group: a decode's samples to the other ranks, which
        feed a decode queued before they are read back (`PlanSender.share`)."""
        if self.plans is not None:
            self.plans.share(next_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32. From a CUDA graph they are a
        view of the graph's static output, overwritten by the next forward: read them first.
        On rank 0 of a tensor-parallel group the other ranks are sent the plan first."""
        if self.plans is not None:
            self.plans.forward(batch)
        decode = batch.mode is ForwardMode.DECODE
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(batch):
            with PROFILER.range("braid.decode.graph"):
                return graphs.run(batch)
        with PROFILER.range("braid.decode" if decode else "braid.prefill"):
            backend = self.attn_backend if decode else self.prefill_backend
            backend.init_forward_metadata(batch)
            if batch.images:
                embeds, deepstack = embed_with_images(self.model, batch, self.encoder_cache)
                extra = {} if deepstack is None else {"deepstack": deepstack}
                return self.model(batch, backend, input_embeds=embeds, **extra)
            return self.model(batch, backend)


def embed_with_images(
    model: nn.Module, batch: ForwardBatch, cache: EncoderCache
) -> tuple[torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]] | None]:
    """The extend's input embeddings: the model's token embeddings, with the rows of every
    `batch.images` slice replaced by that part of its image's tower output. Images not in
    `cache` are encoded in one batched call of `model.encode_images`.

    A tower output wider than the embeddings (Qwen3-VL's DeepStack levels side by side after
    them) also gives `(rows, levels)`: the batch rows that hold image tokens and, per level,
    their [len(rows), hidden] features; otherwise None."""
    embeds = model.embed_tokens(batch.input_ids)
    outputs: dict[int, torch.Tensor] = {}
    missing = {}
    for s in batch.images:
        key = s.image.hash
        if key in outputs or key in missing:
            continue
        cached = cache.get(key)
        if cached is None:
            missing[key] = s.image
        else:
            outputs[key] = cached
            cache.hits += 1
    if missing:
        images = list(missing.values())
        with PROFILER.range("braid.vision_tower"):
            encoded = cache.timed(embeds.device, lambda: model.encode_images(images))
        cache.images_encoded += len(images)
        for key, image, out in zip(missing, images, encoded):
            if out.shape[0] != image.num_tokens:
                raise RuntimeError(
                    f"the vision tower gave {out.shape[0]} embeddings for an image of "
                    f"{image.num_tokens} tokens"
                )
            # Its own storage: a view would keep the whole batch's output alive after the
            # other images' entries are dropped, outside the cache's byte budget.
            out = out.clone()
            cache.put(key, out)
            outputs[key] = out
    hidden = embeds.shape[1]
    rows, extra = [], []
    for s in batch.images:
        part = outputs[s.image.hash][s.start : s.start + s.length]
        embeds[s.row : s.row + s.length] = part[:, :hidden].to(embeds.dtype)
        if part.shape[1] > hidden:
            rows.append(torch.arange(s.row, s.row + s.length, device=embeds.device))
            extra.append(part[:, hidden:])
    if not extra:
        return embeds, None
    return embeds, (torch.cat(rows), list(torch.cat(extra).split(hidden, dim=1)))
