"""`EngineConfig`: every knob of the runtime, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings. `None` means "size it from the model and the machine".

    - `kv_tokens`: KV pool capacity in tokens; else `mem_fraction_static` of memory (on CUDA:
      of total GPU memory, weights included, as SGLang; on CPU: of available RAM).
    - `context_length`: longest sequence (prompt + output); defaults to the model's, capped
      by the KV capacity.
    - `max_running_requests`: requests decoded together; `max_prefill_tokens`: new tokens one
      prefill batch may hold.
    - `chunked_prefill_size`: a prompt with more new tokens than this is prefilled in chunks
      across steps (None: 8192 on CUDA, 4096 on CPU; -1: off, a long prompt runs alone).
    - `schedule_policy`: "lpm" (longest cached prefix first, shared prefixes computed once)
      or "fcfs". `disable_radix_cache`: no prefix caching (for A/B measurement).
    - `generation_config`: "auto" takes default sampling values from the model's
      generation_config.json (as vLLM does); "braid" uses braid's own defaults.
    - `grammar_compile_timeout_s`: a constrained request whose grammar takes longer to compile
      fails with an error saying so. `disable_jump_forward`: sample every token a grammar
      forces instead of appending it (for A/B measurement).
    - `attention_backend`: a name from `braid.runtime.attention.backend_names()`; None picks by
      device: "triton" on CUDA, "torch_native" elsewhere.
    - `cuda_graph_max_bs`: decode batches of up to this many requests (and at most
      `max_running_requests`) replay CUDA graphs, padded to the next captured size; larger ones
      run eagerly. `disable_cuda_graph`: always eager. Graphs are used only with the "triton"
      backend on CUDA (`use_cuda_graph`).
    - `overlap_schedule`: queue each decode step on the device before reading back the one
      before it, so the host's per-step work overlaps the GPU's (`scheduler/overlap.py`). None:
      on with CUDA, off elsewhere (CPU forwards are synchronous: nothing to overlap). False is
      `--disable-overlap-schedule`; True forces it on (tests exercise it on CPU).
    - `max_session_pins`, `session_ttl_s`: at most this many program sessions keep their state
      pinned in the cache (the least recently used is released first), each until this long
      after its last request (`scheduler/sessions.py`).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    kv_tokens: int | None = None
    mem_fraction_static: float | None = None
    page_size: int = 1
    max_running_requests: int | None = None
    max_prefill_tokens: int | None = None
    context_length: int | None = None
    chunked_prefill_size: int | None = None
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    seed: int = 0
    generation_config: str = "auto"
    attention_backend: str | None = None
    load_format: str = "auto"
    show_progress: bool = True
    grammar_compile_timeout_s: float = 30.0
    disable_jump_forward: bool = False
    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    overlap_schedule: bool | None = None
    max_session_pins: int = 64
    session_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        for name in ("kv_tokens", "max_running_requests", "max_prefill_tokens", "context_length"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        cps = self.chunked_prefill_size
        if cps is not None and (not isinstance(cps, int) or (cps < 1 and cps != -1)):
            raise ValueError(f"chunked_prefill_size must be a positive integer or -1, got {cps!r}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(
                f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}"
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        frac = self.mem_fraction_static
        if frac is not None and not 0 < frac < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {frac!r}")
        if self.generation_config not in ("auto", "braid"):
            raise ValueError(
                f"generation_config must be 'auto' or 'braid', got {self.generation_config!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.max_session_pins, int) or self.max_session_pins < 1:
            raise ValueError(f"max_session_pins must be >= 1, got {self.max_session_pins!r}")
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s!r}")
        t = self.grammar_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"grammar_compile_timeout_s must be a positive number, got {t!r}")
        if self.attention_backend is not None:
            from braid.runtime.attention import backend_names

            if self.attention_backend not in backend_names():
                raise ValueError(
                    f"attention_backend must be None or one of {backend_names()}, "
                    f"got {self.attention_backend!r}"
                )
        bs = self.cuda_graph_max_bs
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be a positive integer, got {bs!r}")
        if not isinstance(self.disable_cuda_graph, bool):
            raise ValueError(
                f"disable_cuda_graph must be true or false, got {self.disable_cuda_graph!r}"
            )
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise ValueError(
                f"overlap_schedule must be None, true or false, got {self.overlap_schedule!r}"
            )

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def effective_attention_backend(self) -> str:
        """`attention_backend`, or when None: "triton" on CUDA, "torch_native" elsewhere."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch_native"

    @property
    def use_cuda_graph(self) -> bool:
        """Whether decode batches replay CUDA graphs: the "triton" backend on CUDA, not
        disabled."""
        return (
            not self.disable_cuda_graph
            and self.torch_device.type == "cuda"
            and self.effective_attention_backend == "triton"
        )

    @property
    def use_overlap_schedule(self) -> bool:
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.torch_device.type == "cuda"

    @property
    def effective_chunked_prefill_size(self) -> int | None:
        if self.chunked_prefill_size == -1:
            return None
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 8192 if self.torch_device.type == "cuda" else 4096

    def torch_dtype(self, model_dtype: str | None) -> torch.dtype:
        """float32 on CPU for "auto" (CPU half-precision matmuls are slow and less exact);
        on CUDA the model's 16-bit dtype, or bfloat16."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        if model_dtype in ("bfloat16", "float16"):
            return _DTYPES[model_dtype]
        return torch.bfloat16
