"""`ModelRunner`: owns the model, the KV memory and the attention backend, and runs forwards.

Construction picks the device, dtype and backend once, loads the weights, and sizes the KV pool
(from `kv_tokens` or a memory fraction). It logs one line with the capacity it chose.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from braid.runtime.attention import create_backend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.config import EngineConfig
from braid.runtime.executor.forward_batch import ForwardBatch
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.15}
DEFAULT_MAX_RUNNING = {"cuda": 256, "cpu": 64}


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
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path | None):
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype(model_config.dtype)
        ctx = config.context_length or model_config.max_position_embeddings
        if config.context_length and config.context_length > model_config.max_position_embeddings:
            raise ValueError(
                f"context_length {config.context_length} exceeds the model's "
                f"max_position_embeddings ({model_config.max_position_embeddings})"
            )
        self.model = build_model(
            model_config,
            model_dir,
            dtype=self.dtype,
            device=self.device,
            max_positions=ctx,
            load_format=config.load_format,
            progress=config.show_progress,
        )
        page = config.page_size
        kv_tokens = config.kv_tokens or self._kv_tokens_from_memory()
        num_pages = kv_tokens // page + 1  # +1: the padding page
        self.kv_pool = KVPool(
            model_config.num_layers,
            num_pages,
            page,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        capacity = self.kv_pool.allocator.capacity_tokens
        # A sequence longer than the whole pool could never run.
        self.context_length = min(ctx, capacity)
        self.max_running_requests = config.max_running_requests or min(
            DEFAULT_MAX_RUNNING[self.device.type], max(1, capacity // 16)
        )
        # +1 row: a spare so a retracted or aborted request's row can be reused at once.
        self.req_to_token = ReqToTokenPool(
            self.max_running_requests + 1, self.context_length, self.device
        )
        backend = config.attention_backend or "torch_native"
        self.attn_backend = create_backend(
            backend,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token,
            num_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            sliding_window=model_config.sliding_window,
        )
        logger.info(
            "KV cache: %d tokens (%.1f MB, page size %d) on %s; context length %d; "
            "max running requests %d; attention backend %s",
            capacity,
            self.kv_pool.nbytes / 1e6,
            page,
            self.device,
            self.context_length,
            self.max_running_requests,
            backend,
        )

    def _kv_tokens_from_memory(self) -> int:
        frac = self.config.mem_fraction_static or DEFAULT_MEM_FRACTION[self.device.type]
        free, total = _available_bytes(self.device)
        if self.device.type == "cuda":
            # As SGLang: the fraction covers weights and KV together.
            budget = total * frac - (total - free)
        else:
            budget = free * frac
        per_token = self.model_config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)
        tokens = int(budget // per_token)
        if tokens < 16 * self.config.page_size:
            raise ValueError(
                f"not enough memory for a KV cache ({budget / 1e6:.0f} MB available); "
                "raise mem_fraction_static or pass kv_tokens"
            )
        return tokens

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32."""
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend)
