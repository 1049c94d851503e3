"""Shared fixtures: tiny random models of every supported architecture (built from a
transformers config and saved with save_pretrained, so transformers is the reference), and the
embedded SmolLM2 model."""

from __future__ import annotations

import os
import time
from pathlib import Path

# In pytest-xdist's workers (`make test` runs two) the cores are divided between the workers
# before torch loads, for this process and the runtime processes it starts (they inherit the
# variable). Each worker's torch on every core waits at each parallel region for threads the
# other worker's have descheduled: the agent-traffic script's test took 23 s alone on 2 cores,
# 124 s beside two busy processes, and 36 s there with one thread.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ["OMP_NUM_THREADS"] = str(max(1, (_CORES or 1) // _WORKERS))

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from braid.runtime.models.source import resolve_model  # noqa: E402

# The tests' HTTP calls share 2 cores with the runtime processes they drive: httpx's 5 s
# default read timeout fails a healthy but busy server (seen once in CI-like conditions).
for _fn in (httpx.request, httpx.get, httpx.post, httpx.stream):
    if _fn.__kwdefaults__ and "timeout" in _fn.__kwdefaults__:
        _fn.__kwdefaults__["timeout"] = httpx.Timeout(120.0)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _tiny_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    if arch == "llama3":
        return tf.LlamaConfig(
            **TINY,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
    if arch == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=24, head_dim=16)
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    raise ValueError(arch)


ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def build_tiny_model(arch: str, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: build_tiny_model(a, root / a) for a in ARCHS}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    # The float model transformers loads (the default runs the GGUF kept quantized).
    return resolve_model(None, dequantize_gguf=True)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    import braid

    llm = braid.LLM(smollm2_dir, kv_tokens=8192, show_progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    """Transformers' greedy continuation of one prompt (the fidelity reference)."""
    x = torch.tensor([ids])
    kwargs = {}
    if not eos:
        kwargs = dict(eos_token_id=None, min_new_tokens=max_new_tokens)
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def local_scheduler(path: Path, eos_token_ids: frozenset[int] = frozenset(), **config):
    """A scheduler with its model in this process, for white-box tests of its logic (the
    `LLM` runs the same class in its scheduler process)."""
    from braid.runtime.config import EngineConfig
    from braid.runtime.scheduler.process import build_scheduler

    cfg = EngineConfig(model=str(path), show_progress=False, **config)
    return build_scheduler(cfg, Path(path), eos_token_ids)


def run_to_end(sched, check: bool = True) -> dict[str, list[int]]:
    """Step a local scheduler until idle; returns each request's tokens."""
    tokens: dict[str, list[int]] = {}
    while sched.has_work:
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        if check:
            sched.check_invariants()
    return tokens


def assert_kv_all_free_or_cached(llm, timeout: float = 10.0) -> None:
    """Nothing runs (within `timeout`: a request its stop string ended reaches the client
    before the detokenizer's abort reaches the scheduler), the scheduler's accounting holds,
    and every KV token is free or cached."""
    deadline = time.monotonic() + timeout
    s = llm.stats()
    while (s["running_requests"] or s["queued_requests"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        s = llm.stats()
    assert s["running_requests"] == 0 and s["queued_requests"] == 0, s
    llm.check_invariants()
    s = llm.stats()
    assert s["kv_free_tokens"] + s["kv_cached_tokens"] == s["kv_capacity_tokens"]


def same_launch_shapes(monkeypatch) -> None:
    """The GEMVs over inputs made ahead take their form's launch shapes (`config_for`'s
    "fp8_ahead" -> "fp8"): another shape sums in another order (fp8's tensor-core form rounds
    its partial sums), so bit-for-bit checks of the inputs pin the shape."""
    from braid.kernels import quant_gemv

    real = quant_gemv.config_for
    monkeypatch.setattr(
        quant_gemv, "config_for",
        lambda kind, n, k, device=None: real(kind.removesuffix("_ahead"), n, k, device),
    )  # fmt: skip
