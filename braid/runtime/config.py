"""`EngineConfig`: every knob of the runtime, declared once and validated at construction.

Each field is declared with `setting(default, doc, ...)` (`config_fields.py`): its default, its
doc, SGLang's names for it and, where it has one, its set of values. `LLM(**overrides)` resolves
its keywords against these fields (`resolve_overrides`), `braid serve` generates its flags from
them (`braid.runtime.server.cli`), and the scheduler reads the config object itself.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from braid.runtime.config_fields import check_choices, check_positive, setting

if TYPE_CHECKING:  # torch is imported where a device or dtype is needed: the server's front
    import torch  # end starts the runtime's processes without paying for its import first

# `dtype` values -> torch dtype names
_DTYPES = {
    "float": "float32",
    "half": "float16",
    **{d: d for d in ("float32", "bfloat16", "float16")},
}
# `kv_cache_dtype` values (vLLM's names; "fp8" is e4m3, as vLLM's default on CUDA).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# The grammar backend when `grammar_backend` is unset, per device (docs/benchmarks.md): on the
# H200 machine xgrammar fills a JSON-schema row's mask in 10-21 us against llguidance's 115-125
# (llguidance missed the <= 3% overhead target there, xgrammar met it); on the CPU a decode
# step is long enough to hide either fill, and llguidance compiles faster (SmolLM2's vocabulary:
# 11 ms against 281 ms for SGLang's character regex) and enforces more of JSON Schema.
DEFAULT_GRAMMAR_BACKENDS = {"cuda": "xgrammar", "cpu": "llguidance"}
_DEFAULT_MAX_PREFILL_TOKENS = {"cuda": 16384, "cpu": 8192}


def _registry(module: str, names: str) -> Callable[[], list[str]]:
    """A registry's names for a setting's choices, imported when asked: the registries are
    cheap, but config must not import them at load."""
    return lambda: getattr(importlib.import_module(module), names)()


_grammar_backends = _registry("braid.runtime.constrained", "grammar_backend_names")
_quantization_methods = _registry("braid.runtime.quantization", "quantization_method_names")
_attention_backends = _registry("braid.runtime.attention", "backend_names")
_schedule_policies = _registry("braid.runtime.scheduler.policies", "policy_names")


# Speculative decoding: SGLang's algorithm names (`--speculative-algorithm`); vLLM's
# `speculative_config["method"]` names map onto them (`SPECULATIVE_METHODS`).
SPECULATIVE_ALGORITHMS = ("NGRAM", "DRAFT", "MEDUSA", "EAGLE", "EAGLE3")
SPECULATIVE_METHODS = {
    "draft_model": "DRAFT",
    **{a.lower(): a for a in SPECULATIVE_ALGORITHMS if a != "DRAFT"},
}


@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings; each field's doc is its `setting(...)` below (and `braid serve
    --help`). None means "size it from the model and the machine"; the sized values are the
    properties (`torch_device`, `effective_*`, `use_*`)."""

    model: str | None = setting(
        None,
        "a Hugging Face directory, a .gguf file, a hub model id (org/name, org/name@revision, "
        "org/name:Q4_K_M for a GGUF repository's file; fetched through the Hugging Face cache), "
        "or 'smollm2-135m'; unset: the embedded SmolLM2-135M-Instruct",
        aliases=("--model-path",),
    )
    revision: str | None = setting(
        None, "a hub model's branch, tag or commit; unset: the id's @revision, else main"
    )
    gguf_file: str | None = setting(
        None,
        "the GGUF file to load from a hub repository or a local directory holding several; "
        "unset: the one the id's :QUANT tag names, else the repository's only one",
    )
    dtype: str = setting(
        "auto",
        "weights and activations; auto: float32 on CPU, the model's 16-bit type or bf16 on CUDA",
        choices=("auto", *_DTYPES),
    )
    device: str | None = setting(None, "cpu, cuda or cuda:N; unset: cuda when there is one")
    kv_cache_dtype: str = setting(
        "auto",
        "how the KV cache stores keys and values; auto: the model's dtype; fp8 or fp8_e4m3: "
        "float8 e4m3, one byte a value (twice the tokens of a 16-bit cache in the same "
        "memory), with a K and a V scale per layer (the checkpoint's self_attn.k_scale / "
        "v_scale, else 1.0)",
        choices=KV_CACHE_DTYPES,
    )
    kv_tokens: int | None = setting(
        None,
        "KV pool capacity in tokens; unset: mem_fraction_static of memory",
        aliases=("--max-total-tokens",),
    )
    mem_fraction_static: float | None = setting(
        None,
        "fraction of memory, in (0, 1), for the KV pool: on CUDA of total GPU memory, weights "
        "included (as SGLang); on CPU of available RAM; unset: 0.85 on CUDA, 0.15 on CPU",
    )
    page_size: int = setting(1, "tokens per KV page", aliases=("--block-size",))  # vLLM's name
    max_running_requests: int | None = setting(
        None,
        "requests decoded together; unset: sized from the KV capacity",
        aliases=("--max-num-seqs",),
    )
    max_prefill_tokens: int | None = setting(
        None, "new tokens one prefill batch may hold; unset: 16384 on CUDA, 8192 on CPU"
    )
    context_length: int | None = setting(
        None,
        "longest sequence (prompt + output); unset: the model's; always capped by the KV capacity",
        aliases=("--max-model-len",),  # vLLM's
    )
    chunked_prefill_size: int | None = setting(
        None,
        "a prompt with more new tokens than this is prefilled in chunks across steps; -1 turns "
        "it off (a long prompt runs alone); unset: 8192 on CUDA, 4096 on CPU",
    )
    enable_mixed_chunk: bool = setting(
        False,
        "each prefill step also carries the running requests' decode rows (one extend batch; "
        "they count against its token budget), as SGLang's --enable-mixed-chunk: the decode "
        "rides on the prefill's weight reads instead of a step of its own",
    )
    avoid_partial_chunks: bool = setting(
        True,
        "a prompt that fits a prefill step of its own but not what this step's budget leaves "
        "waits (once) for the next step instead of being cut; off: it is cut to fill the "
        "budget, as in SGLang and vLLM",
    )
    schedule_policy: str = setting(
        "lpm",
        "lpm: longest cached prefix first; fcfs: arrival order; program: the program with the "
        "least service so far first, with aging (braid programs and sessions); program-srpt: "
        "the program predicted to ask for the least work yet first, with aging; priority: each "
        "request's priority, lower first, also choosing what KV running short retracts (vLLM's)",
        choices=_schedule_policies,
    )
    disable_radix_cache: bool = setting(False, "no prefix caching, for A/B measurement")
    seed: int = setting(
        0, "seeds the sampling of requests that give no seed", aliases=("--random-seed",)
    )
    generation_config: str = setting(
        "auto",
        "default sampling values; auto: from the model's generation_config.json (as vLLM); "
        "braid: braid's own",
        choices=("auto", "braid"),
    )
    attention_backend: str | None = setting(
        None,
        "attention implementation; unset: triton on CUDA, torch_native elsewhere",
        choices=_attention_backends,
    )
    prefill_attention_backend: str | None = setting(
        None,
        "attention implementation for prefill (extend) forwards; unset: attention_backend's",
        choices=_attention_backends,
    )
    decode_attention_backend: str | None = setting(
        None,
        "attention implementation for decode forwards (the one CUDA graphs capture); unset: "
        "attention_backend's",
        choices=_attention_backends,
    )
    load_format: str = setting(
        "auto",
        "auto: the checkpoint's weights; dummy: random weights from config.json, for benchmarks",
        choices=("auto", "dummy"),
    )
    show_progress: bool = setting(True, "a progress bar while the weights load")
    grammar_backend: str | None = setting(
        None,
        "the library that compiles json_schema/regex/choice/ebnf/lark/structural_tag "
        "constraints; a constraint it cannot enforce (a kind it lacks, a JSON Schema keyword it "
        "would ignore) goes to another backend that can, or is refused; unset: xgrammar on "
        "CUDA, llguidance elsewhere",
        choices=_grammar_backends,
    )
    grammar_compile_timeout_s: float = setting(
        30.0,
        "seconds a json_schema/regex/choice grammar may take to compile; a request whose "
        "grammar takes longer fails with an error saying so",
        aliases=("--grammar-compile-timeout",),
    )
    disable_jump_forward: bool | None = setting(
        None,
        "sample every token a grammar forces instead of appending it (jump-forward); unset: "
        "appended on the CPU, sampled on CUDA, where appending gained nothing at batch 1 and "
        "made batches of JSON requests several times slower on the H200 (each jump is an "
        "extend step of its own, and the overlap schedule waits for it)",
    )
    disable_grammar_mask_thread: bool = setting(
        False,
        "fill the masks of a decode step run ahead on the scheduler's thread once the step "
        "before is applied, instead of in a thread beside it, for A/B measurement",
    )
    cuda_graph_max_bs: int | None = setting(
        None,
        "decode batches of up to this many rows (requests, or with speculative decoding the "
        "tokens they verify; at most what max_running_requests can hold) replay CUDA graphs, "
        "padded to the next captured size; larger ones run eagerly. Graphs are used on CUDA "
        "with a decode attention backend that has them (triton, flashinfer). Unset: 1024 "
        "with the triton decode backend, 256 with flashinfer (its wrappers keep 16 MB of "
        "buffers per captured size)",
    )
    disable_cuda_graph: bool = setting(
        False, "run every decode step eagerly", aliases=("--enforce-eager",)
    )
    cuda_graph_capture_all_at_start: bool = setting(
        False,
        "capture every decode batch size's graph before the runtime reports ready; by default "
        "the powers of two and the largest are captured then and the others while the "
        "scheduler is idle (a batch pads to the next captured size meanwhile). Tensor "
        "parallelism always captures all at start",
    )
    disable_custom_all_reduce: bool = setting(
        False,
        "tensor parallelism on CUDA: run every all-reduce through NCCL; by default those of a "
        "decode step (up to 1 MiB) run as torch's symmetric-memory one-shot all-reduce",
    )
    overlap_schedule: bool | None = setting(
        None,
        "queue each decode step on the device before reading back the one before it, so the "
        "host's per-step work overlaps the GPU's; unset: on with CUDA, off elsewhere (CPU "
        "forwards are synchronous: nothing to overlap)",
        off_flag="--disable-overlap-schedule",
    )
    max_session_pins: int = setting(
        64,
        "most program sessions whose state stays pinned in the cache; the least recently used "
        "is released first",
    )
    session_ttl_s: float = setting(
        600.0, "seconds a session pin lasts after its last request", aliases=("--session-ttl",)
    )
    watchdog_timeout: float = setting(
        300.0,
        "seconds the scheduler may go silent or stay in one step before the runtime is failed "
        "(its requests end with an error; braid serve exits), as SGLang's --watchdog-timeout",
    )
    limit_mm_per_prompt: int = setting(8, "images one prompt may hold (vision-language models)")
    max_image_pixels: int = setting(
        32 * 2**20, "pixels (width x height) one image may have; checked before it is decoded"
    )
    max_image_bytes: int = setting(20 * 2**20, "bytes of one encoded image (inline or fetched)")
    media_fetch_timeout_s: float = setting(10.0, "seconds to fetch an image from an http(s) URL")
    allowed_local_media_path: str | None = setting(
        None,
        "a directory whose files prompts may name as images (paths or file:// URLs); "
        "unset: none for the server, the caller's own for the offline LLM",
    )
    encoder_cache_mb: int = setting(
        256, "MB of vision-tower outputs kept by image content hash (scheduler process)"
    )
    quantization: str | None = setting(
        None,
        "how the linear layers' weights are stored and multiplied; unset: from the checkpoint's "
        "quantization_config (none: the model's dtype)",
        choices=_quantization_methods,
    )
    dequantize_gguf: bool = setting(
        False, "load a GGUF file's quantized tensors as floats (the slower float path)"
    )
    speculative_algorithm: str | None = setting(
        None,
        "speculative decoding: NGRAM (drafts from the prompt and output so far), DRAFT (a "
        "smaller model), MEDUSA (heads on the target's last hidden state), EAGLE / EAGLE3 (a "
        "draft layer over the target's hidden states); output is identical in distribution "
        "(greedy: token for token); unset: off",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model_path: str | None = setting(
        None, "DRAFT: the draft model's directory; MEDUSA / EAGLE: the heads' checkpoint"
    )
    speculative_num_steps: int | None = setting(
        None, "draft tokens proposed in a row per step (the tree's depth); unset: 4"
    )
    speculative_eagle_topk: int | None = setting(
        None, "EAGLE / MEDUSA: branches kept per draft position (1: a chain); unset: 1"
    )
    speculative_num_draft_tokens: int | None = setting(
        None,
        "draft tokens verified per request per step (a tree's nodes); unset: "
        "speculative_num_steps for a chain",
    )
    speculative_ngram_min_match_window_size: int = setting(
        1, "NGRAM: the shortest suffix of the text so far that is looked up"
    )
    speculative_ngram_max_match_window_size: int = setting(
        4, "NGRAM: the longest suffix looked up (the longest one that matches wins)"
    )
    pooling: str | None = setting(
        None,
        "embeddings: how a prompt's final hidden states become one vector (last token, mean "
        "over the prompt, or first token); unset: the model's sentence-transformers pooling "
        "(modules.json, 1_Pooling/config.json), else last",
        choices=("last", "mean", "cls"),
    )
    tp_size: int = setting(
        1,
        "tensor parallelism: split the model by heads and MLP columns over this many devices "
        "(one process each; gloo on CPU, NCCL on CUDA)",
        aliases=("--tensor-parallel-size",),
    )
    nnodes: int = setting(1, "machines the tensor-parallel group spans (tp_size ranks in all)")
    node_rank: int = setting(
        0, "this machine's index among --nnodes (0 serves; the others run their ranks only)"
    )
    dist_init_addr: str | None = setting(
        None, "host:port where the tensor-parallel ranks meet (rank 0's); unset: 127.0.0.1:free"
    )

    def __post_init__(self) -> None:
        algo = self.speculative_algorithm
        if isinstance(algo, str):  # SGLang's upper case, or vLLM's method names
            object.__setattr__(
                self, "speculative_algorithm", SPECULATIVE_METHODS.get(algo.lower(), algo.upper())
            )
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ValueError(
                "kv_cache_dtype 'fp8_e5m2' is not supported: use 'fp8_e4m3' (or 'fp8'), "
                "which keeps more mantissa in the same byte, or 'auto'"
            )
        check_choices(self)
        limits = ("kv_tokens", "max_running_requests", "max_prefill_tokens", "context_length")
        check_positive(self, *limits, integer=True, optional=True)
        cps = self.chunked_prefill_size
        if cps is not None and (not isinstance(cps, int) or (cps < 1 and cps != -1)):
            raise ValueError(f"chunked_prefill_size must be a positive integer or -1, got {cps!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        frac = self.mem_fraction_static
        if frac is not None and not 0 < frac < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {frac!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.max_session_pins, int) or self.max_session_pins < 1:
            raise ValueError(f"max_session_pins must be >= 1, got {self.max_session_pins!r}")
        check_positive(
            self, "limit_mm_per_prompt", "max_image_pixels", "max_image_bytes", integer=True
        )
        v = self.encoder_cache_mb
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"encoder_cache_mb must be an integer >= 0, got {v!r}")
        seconds = ("media_fetch_timeout_s", "watchdog_timeout", "session_ttl_s")
        check_positive(self, *seconds, "grammar_compile_timeout_s")
        check_positive(self, "cuda_graph_max_bs", integer=True, optional=True)
        for name in (
            "cuda_graph_capture_all_at_start",
            "disable_cuda_graph",
            "disable_custom_all_reduce",
            "enable_mixed_chunk",
            "avoid_partial_chunks",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.enable_mixed_chunk and self.speculative_algorithm is not None:
            raise ValueError(
                "enable_mixed_chunk does not go with speculative decoding yet (a verify step "
                "is not an extend row); turn one of them off"
            )
        self._check_speculative()
        self._check_parallel()
        self._check_attention_backends()
        for name in ("disable_jump_forward", "overlap_schedule"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be None, true or false, got {v!r}")

    def _check_parallel(self) -> None:
        check_positive(self, "tp_size", "nnodes", integer=True)
        r = self.node_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {r!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): "
                "every machine runs the same number of ranks"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.tp_size == 1:
            return
        # What a tensor-parallel forward does not carry yet: refused, never half-done.
        if self.speculative_algorithm is not None:
            raise ValueError("speculative decoding with tp_size > 1 is not supported yet")
        if self.quantization is not None:
            raise ValueError(
                f"quantization ({self.quantization}) with tp_size > 1 is not supported yet"
            )

    def _check_attention_backends(self) -> None:
        # Refused here, before any process starts, rather than when the model runner builds
        # the backend: a missing optional package and a feature the backend cannot serve.
        # (The defaults are never 'flashinfer', so the fields as given are what to check.)
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(self, name) != "flashinfer":
                continue
            # The decode backend verifies draft trees; the EAGLE drafter runs attention_backend.
            # An explicit other decode backend takes the trees off attention_backend's.
            decodes = name == "decode_attention_backend" or (
                name == "attention_backend" and self.decode_attention_backend is None
            )
            drafts = name == "attention_backend" and self.speculative_algorithm in (
                "EAGLE",
                "EAGLE3",
            )
            if (decodes or drafts) and self.speculative_tree_nodes and self.page_size != 1:
                raise ValueError(
                    f"{name} 'flashinfer' reads draft-tree tails (speculative_eagle_topk > 1) "
                    f"at page_size 1, not {self.page_size}: use page_size 1, or 'triton' or "
                    "'torch_native'"
                )
            if self.kv_cache_dtype != "auto":
                raise ValueError(
                    f"{name} 'flashinfer' with kv_cache_dtype {self.kv_cache_dtype!r} is not "
                    "supported yet (braid's flashinfer backend reads a 16-bit cache): use "
                    "'triton' or 'torch_native' with an fp8 KV cache"
                )
            wrong = None
            if _DTYPES.get(self.dtype) == "float32":
                wrong = f"float16 or bfloat16, not dtype {self.dtype!r} (float32: 'triton')"
            elif self.device is not None and self.device.split(":")[0] != "cuda":
                wrong = f"on CUDA, not device {self.device!r} (the CPU: 'torch_native')"
            if wrong:
                raise ValueError(f"{name} 'flashinfer' runs {wrong}")
            if importlib.util.find_spec("flashinfer") is None:
                raise ValueError(
                    f"{name} 'flashinfer' needs the flashinfer-python package, which is not "
                    "installed (pip install flashinfer-python, or braid[flashinfer])"
                )

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def _check_speculative(self) -> None:
        ints = (
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
            "speculative_ngram_min_match_window_size",
            "speculative_ngram_max_match_window_size",
        )
        check_positive(self, *ints, integer=True, optional=True)
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if lo > hi:
            raise ValueError(
                f"speculative_ngram_min_match_window_size ({lo}) must be at most "
                f"speculative_ngram_max_match_window_size ({hi})"
            )
        algo = self.speculative_algorithm
        needs_path = algo in ("DRAFT", "MEDUSA", "EAGLE", "EAGLE3")
        if needs_path and not self.speculative_draft_model_path:
            raise ValueError(f"speculative_algorithm {algo} needs speculative_draft_model_path")
        if algo is None:
            defaults = {f.name: f.default for f in fields(self)}
            given = [
                n
                for n in ("speculative_draft_model_path", *ints)
                if getattr(self, n) != defaults[n]
            ]
            if given:  # as vLLM refuses a speculative_config without a method or a model
                raise ValueError(f"{given[0]} is set but speculative_algorithm is not")
        if algo == "NGRAM" and self.speculative_draft_model_path:
            raise ValueError(
                "speculative_draft_model_path does not go with speculative_algorithm NGRAM "
                "(its drafts come from the text so far)"
            )

    @property
    def speculative_steps(self) -> int:
        """Draft tokens proposed in a row per step: `speculative_num_steps`, or 4."""
        return self.speculative_num_steps or 4

    @property
    def speculative_tree_nodes(self) -> int:
        """Nodes of the draft trees MEDUSA / EAGLE propose (`speculative_eagle_topk` > 1):
        `speculative_num_draft_tokens`, or topk x steps; 0 when they propose chains."""
        topk = self.speculative_eagle_topk or 1
        if self.speculative_algorithm not in ("MEDUSA", "EAGLE", "EAGLE3") or topk == 1:
            return 0
        return self.speculative_num_draft_tokens or topk * self.speculative_steps

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def effective_grammar_backend(self) -> str:
        """`grammar_backend`, or when None: the device's in DEFAULT_GRAMMAR_BACKENDS."""
        if self.grammar_backend is not None:
            return self.grammar_backend
        return DEFAULT_GRAMMAR_BACKENDS.get(self.torch_device.type, "llguidance")

    @property
    def effective_attention_backend(self) -> str:
        """`attention_backend`, or when None: "triton" on CUDA, "torch_native" elsewhere."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch_native"

    @property
    def effective_prefill_attention_backend(self) -> str:
        """`prefill_attention_backend`, or when None: `effective_attention_backend`."""
        return self.prefill_attention_backend or self.effective_attention_backend

    @property
    def effective_decode_attention_backend(self) -> str:
        """`decode_attention_backend`, or when None: `effective_attention_backend`."""
        return self.decode_attention_backend or self.effective_attention_backend

    @property
    def effective_cuda_graph_max_bs(self) -> int:
        """`cuda_graph_max_bs`, or when None: 1024 rows, 256 with the flashinfer decode
        backend. Past 256 rows an eager decode step can wait on the host's launches (fp8 layers
        launch more kernels); graphs to 1024 rows made offline 1024 x (512 in, 256 out)
        faster on the H200, bf16 and fp8 alike (measured: docs/benchmarks.md, Figures behind
        design choices)."""
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        return 256 if self.effective_decode_attention_backend == "flashinfer" else 1024

    @property
    def use_cuda_graph(self) -> bool:
        """Whether decode batches replay CUDA graphs: on CUDA, not disabled, with a decode
        backend that supports them ("triton", "flashinfer")."""
        if self.disable_cuda_graph or self.torch_device.type != "cuda":
            return False
        from braid.runtime.attention import BACKENDS

        return BACKENDS.get(self.effective_decode_attention_backend).supports_cuda_graph

    @property
    def use_jump_forward(self) -> bool:
        """Not `disable_jump_forward`, or when it is None: on everywhere but CUDA."""
        if self.disable_jump_forward is not None:
            return not self.disable_jump_forward
        return self.torch_device.type != "cuda"

    @property
    def use_overlap_schedule(self) -> bool:
        """`overlap_schedule`, or when None: on with CUDA."""
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

    @property
    def effective_max_prefill_tokens(self) -> int:
        """`max_prefill_tokens`, or when None: 16384 on CUDA, 8192 elsewhere."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return _DEFAULT_MAX_PREFILL_TOKENS.get(self.torch_device.type, 8192)

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model computing in `model_dtype`: that dtype for "auto",
        float8_e4m3fn for "fp8" and "fp8_e4m3"."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        import torch

        return torch.float8_e4m3fn

    def torch_dtype(self, model_dtype: str | None) -> torch.dtype:
        """float32 on CPU for "auto" (CPU half-precision matmuls are slow and less exact);
        on CUDA the model's 16-bit dtype, or bfloat16."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        if self.torch_device.type == "cpu":
            return torch.float32
        if model_dtype in ("bfloat16", "float16"):
            return getattr(torch, model_dtype)
        return torch.bfloat16
