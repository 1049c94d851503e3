"""CUDA graphs for decode and the runtime's CUDA defaults: the attention backend chosen by device,
the capture sizes and padding (pure logic, on CPU), and on a GPU greedy tokens from graphs equal
to eager and to transformers, padded batches and requests finishing at different steps included,
plus an 8B-shaped smoke run."""

from __future__ import annotations

import collections
import random
import time
from pathlib import Path

import pytest
import torch

import braid
from braid import SamplingParams
from braid.kernels.reference import rmsnorm_reference, silu_and_mul_reference
from braid.runtime.attention import create_backend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.config import EngineConfig
from braid.runtime.executor.cuda_graph import (
    PAD_POSITION,
    PAD_SLOT,
    PAD_TOKEN_ID,
    CudaGraphRunner,
    StaticDecodeInputs,
    capture_batch_sizes,
    padded_batch_size,
    start_batch_sizes,
)
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.layers.activation import silu_and_mul
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.rotary import FusedRotaryTables, RotaryEmbedding, apply_rotary
from braid.runtime.server.cli import build_parser, serve
from tests.conftest import hf_greedy, local_scheduler, run_to_end

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = dict(temperature=0.0, ignore_eos=True)
LLAMA_8B = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.1-8b"


# ---- configuration (CPU) ----------------------------------------------------------------------


def test_attention_backend_and_cuda_graphs_default_by_device():
    cpu, cuda = EngineConfig(device="cpu"), EngineConfig(device="cuda")
    assert cpu.effective_attention_backend == "torch_native" and not cpu.use_cuda_graph
    assert cuda.effective_attention_backend == "triton" and cuda.use_cuda_graph
    native = EngineConfig(device="cuda", attention_backend="torch_native")
    assert native.effective_attention_backend == "torch_native" and not native.use_cuda_graph
    assert not EngineConfig(device="cuda", disable_cuda_graph=True).use_cuda_graph
    # The triton backend on CPU (interpreter, for tests) never captures graphs.
    assert not EngineConfig(device="cpu", attention_backend="triton").use_cuda_graph
    # Unset: graphs to 1024 rows, 256 with flashinfer's per-size buffers; a set value wins.
    assert cuda.cuda_graph_max_bs is None and cuda.effective_cuda_graph_max_bs == 1024
    fi = EngineConfig(device="cuda")  # flashinfer is not installed here: set past validation
    object.__setattr__(fi, "decode_attention_backend", "flashinfer")
    assert fi.effective_cuda_graph_max_bs == 256
    assert EngineConfig(device="cuda", cuda_graph_max_bs=48).effective_cuda_graph_max_bs == 48


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(attention_backend="flashinfer2"), "attention_backend"),
        (dict(attention_backend=""), "attention_backend"),
        (dict(cuda_graph_max_bs=0), "cuda_graph_max_bs"),
        (dict(cuda_graph_max_bs=True), "cuda_graph_max_bs"),
        (dict(cuda_graph_max_bs=8.0), "cuda_graph_max_bs"),
        (dict(disable_cuda_graph="yes"), "disable_cuda_graph"),
    ],
)
def test_bad_engine_settings_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)
    # braid.LLM validates before it starts any process.
    with pytest.raises(ValueError, match=field):
        braid.LLM(**kwargs)


def test_serve_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "--attention-backend", "torch_native", "--cuda-graph-max-bs", "32"]
    )
    assert (args.attention_backend, args.cuda_graph_max_bs, args.disable_cuda_graph) == (
        "torch_native",
        32,
        False,
    )
    assert build_parser().parse_args(["serve", "--disable-cuda-graph"]).disable_cuda_graph
    no_overlap = build_parser().parse_args(["serve", "--disable-overlap-schedule"])
    assert no_overlap.overlap_schedule is False
    assert build_parser().parse_args(["serve"]).overlap_schedule is None
    # A bad backend name ends `braid serve` with exit status 2 before anything starts.
    bad = build_parser().parse_args(
        ["serve", "--attention-backend", "nope", "--log-level", "error"]
    )
    assert serve(bad) == 2


# ---- batch sizes and padding (CPU) ------------------------------------------------------------


def test_capture_sizes_are_small_powers_then_multiples_of_eight_up_to_max():
    assert capture_batch_sizes(160) == [1, 2, 4, 8, *range(16, 161, 8)]
    assert capture_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]
    for bad in (0, -4, True):
        with pytest.raises(ValueError, match="max_bs"):
            capture_batch_sizes(bad)


def test_a_batch_runs_in_the_smallest_captured_size_that_holds_it():
    sizes = capture_batch_sizes(160)
    for n in range(1, 161):
        assert padded_batch_size(n, sizes) == min(s for s in sizes if s >= n)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 9, 17, 153)] == [1, 4, 8, 16, 24, 160]
    assert padded_batch_size(161, sizes) is None
    with pytest.raises(ValueError):
        padded_batch_size(0, sizes)


def test_the_start_sizes_are_the_powers_of_two_and_the_largest():
    assert start_batch_sizes(capture_batch_sizes(256)) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert start_batch_sizes(capture_batch_sizes(160)) == [1, 2, 4, 8, 16, 32, 64, 128, 160]
    assert start_batch_sizes(capture_batch_sizes(10)) == [1, 2, 4, 8, 10]
    assert start_batch_sizes([1]) == [1]
    # While sizes wait for idle time a batch pads to at most twice its size.
    start = start_batch_sizes(capture_batch_sizes(256))
    assert all(padded_batch_size(n, start) < 2 * n for n in range(2, 257))


def _decode_batch(ids: list[int], positions: list[int], slots: list[int]) -> ForwardBatch:
    n = len(ids)
    t = torch.tensor
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=t(ids),
        positions=t(positions),
        out_cache_loc=t(slots),
        req_pool_indices=t(list(range(1, n + 1))),
        seq_lens=t([p + 1 for p in positions]),
        prefix_lens=positions,
        extend_lens=[1] * n,
        logits_indices=torch.arange(n),
    )


def test_static_inputs_take_the_real_rows_and_pad_the_rest_in_place():
    inputs = StaticDecodeInputs(8, torch.device("cpu"))
    captured = inputs.batch(4)  # what a graph of size 4 is captured on
    inputs.load(_decode_batch([11, 12, 13], [5, 9, 2], [40, 41, 42]), 4)
    assert captured.input_ids.tolist() == [11, 12, 13, PAD_TOKEN_ID]
    assert captured.positions.tolist() == [5, 9, 2, PAD_POSITION]
    assert captured.out_cache_loc.tolist() == [40, 41, 42, PAD_SLOT]
    assert captured.logits_indices.tolist() == [0, 1, 2, 3]
    assert captured.batch_size == 4 and captured.mode is ForwardMode.DECODE
    # A smaller batch next: the row it no longer fills is padding again, never a stale slot.
    inputs.load(_decode_batch([7, 8], [3, 4], [50, 51]), 4)
    assert captured.input_ids.tolist() == [7, 8, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert captured.out_cache_loc.tolist() == [50, 51, PAD_SLOT, PAD_SLOT]
    assert captured.input_ids.data_ptr() == inputs.batch(2).input_ids.data_ptr()
    with pytest.raises(ValueError, match="does not fit"):
        inputs.load(_decode_batch([1, 2, 3], [1, 2, 3], [4, 5, 6]), 2)
    extend = _decode_batch([1], [0], [4])
    extend.mode = ForwardMode.EXTEND
    with pytest.raises(ValueError, match="decode"):
        inputs.load(extend, 1)
    with pytest.raises(ValueError, match="bs"):
        inputs.batch(9)


def test_a_backend_without_graph_support_says_so_and_the_runner_refuses_it():
    pool = KVPool(1, 4, 1, 2, 16, torch.float32, torch.device("cpu"))
    table = ReqToTokenPool(2, 8, torch.device("cpu"))
    native = create_backend(
        "torch_native", kv_pool=pool, req_to_token=table, num_heads=4, num_kv_heads=2, head_dim=16
    )
    assert not native.supports_cuda_graph and native.device == torch.device("cpu")
    batch = StaticDecodeInputs(2, native.device).batch(2)
    for hook in (
        lambda: native.init_cuda_graph_state(2),
        lambda: native.init_forward_metadata_capture_cuda_graph(batch),
        lambda: native.init_forward_metadata_replay_cuda_graph(batch, 2),
    ):
        with pytest.raises(NotImplementedError, match="TorchNativeBackend does not support CUDA"):
            hook()
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        CudaGraphRunner(torch.nn.Identity(), native, 2)


def test_cpu_runs_eagerly_on_torch_native_with_the_torch_layers(tiny_model_dirs):
    sched = local_scheduler(tiny_model_dirs["llama"], kv_tokens=256, device="cpu")
    assert sched.runner.graph_runner is None
    assert sched.control("stats")["cuda_graph_sizes_pending"] == 0.0  # none to wait for
    assert type(sched.runner.attn_backend).__name__ == "TorchNativeBackend"
    cos, sin = sched.runner.model.model.rotary.lookup(torch.tensor([0, 3]))
    assert isinstance(sin, torch.Tensor) and cos.shape == sin.shape


# ---- CUDA -------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_built_on_cuda_use_the_fused_kernels_and_match_torch(dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    with torch.device("cuda"):
        norm = RMSNorm(64, 1e-5, dtype)
        head_norm = RMSNorm(16, 1e-5, dtype)
        rope = RotaryEmbedding(16, 128, 10000.0, None, dtype)
    norm.weight.data = randn(64)
    head_norm.weight.data = randn(16)
    x, res = randn(5, 64), randn(5, 64)
    torch.testing.assert_close(norm(x), rmsnorm_reference(x, norm.weight, 1e-5), **tol)
    got, got_res = norm(x, res)
    want, want_res = rmsnorm_reference(x, norm.weight, 1e-5, res)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_res, want_res, **tol)
    # Per-head q norm (Qwen3) on heads sliced from a fused QKV output: not row-contiguous.
    qkv = randn(5, 4 * 16 + 2 * 2 * 16)
    q = qkv[:, :64].reshape(5, 4, 16)
    torch.testing.assert_close(head_norm(q), rmsnorm_reference(q, head_norm.weight, 1e-5), **tol)

    # Rotary: the module created on CUDA rotates q and k in place with the kernel; a module
    # created on CPU and moved keeps the torch path, the reference here.
    positions = torch.tensor([0, 7, 3, 100, 127], device="cuda")
    looked_up = rope.lookup(positions)
    assert isinstance(looked_up[1], FusedRotaryTables)
    reference = RotaryEmbedding(16, 128, 10000.0, None, dtype).to("cuda")
    k = qkv[:, 64:96].reshape(5, 2, 16)
    want_q, want_k = apply_rotary(q, k, *reference.lookup(positions))
    got_q, got_k = apply_rotary(q, k, *looked_up)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)

    gate_up = randn(5, 2 * 48)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **tol)


def _generate(sched, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        sched.handle(GenerateReq(f"r{i}", p, SamplingParams(max_tokens=m, **GREEDY), 0))
    tokens = run_to_end(sched)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_gives_eager_and_transformers_greedy_tokens(tiny_model_dirs):
    """float32 tiny Llama on CUDA, default backend (triton) with graphs up to batch 8: ten
    requests finishing one per step (decode batches of 10, 9 eager; 8..1 padded into 8, 4, 2,
    1), then three more (batch 3 padded into 4)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["llama"]
    kw = dict(dtype="float32", kv_tokens=4096, cuda_graph_max_bs=8)
    graphs = local_scheduler(path, **kw)
    eager = local_scheduler(path, disable_cuda_graph=True, **kw)
    runner = graphs.runner.graph_runner
    assert runner is not None and runner.batch_sizes == [1, 2, 4, 8]
    assert eager.runner.graph_runner is None
    assert type(graphs.runner.attn_backend).__name__ == "TritonBackend"

    decode_sizes: list[int] = []
    real_forward = graphs.runner.forward

    def record(batch):
        if batch.mode is ForwardMode.DECODE:
            decode_sizes.append(batch.batch_size)
        return real_forward(batch)

    graphs.runner.forward = record
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rng = random.Random(3)
    rounds = [
        (
            [[rng.randrange(512) for _ in range(3 + 5 * i)] for i in range(10)],
            [3 + i for i in range(10)],
        ),
        ([[rng.randrange(512) for _ in range(n)] for n in (4, 30, 11)], [7, 4, 9]),
    ]
    for prompts, max_tokens in rounds:
        want = [hf_greedy(hf, p, m, eos=False) for p, m in zip(prompts, max_tokens)]
        got_eager = _generate(eager, prompts, max_tokens)
        got_graphs = _generate(graphs, prompts, max_tokens)
        assert [len(t) for t in got_graphs] == max_tokens
        assert got_graphs == got_eager
        assert got_graphs == want
    assert {9, 10, 5, 3}.issubset(decode_sizes)
    expected = collections.Counter(
        padded_batch_size(n, [1, 2, 4, 8]) for n in decode_sizes if n <= 8
    )
    assert runner.replays == expected
    assert set(runner.replays) == {1, 2, 4, 8}


@pytest.mark.gpu
@needs_cuda
def test_sizes_captured_while_idle_leave_the_cached_kv_alone(tiny_model_dirs):
    """Graphs up to batch 40 with the sizes between the powers of two left for idle time: a
    batch of 20 pads to 32 until 24 is captured, then runs in 24. The capture comes after
    decode steps left real rows in the static inputs; its warm-up run must write to the padding
    slot only, so the second round, whose prompts extend the first round's (prefix-cache hits
    on KV the last decode steps wrote), still gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["llama"]
    sched = local_scheduler(
        path, dtype="float32", kv_tokens=8192, max_running_requests=64, cuda_graph_max_bs=40
    )
    runner = sched.runner.graph_runner
    assert sorted(runner._graphs) == [1, 2, 4, 8, 16, 32, 40] and runner.pending == [24]
    assert sched.control("stats")["cuda_graph_sizes_pending"] == 1.0
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rng = random.Random(5)
    first = [[rng.randrange(512) for _ in range(5 + i)] for i in range(20)]
    got = _generate(sched, first, [6] * 20)
    assert got == [hf_greedy(hf, p, 6, eos=False) for p in first]
    assert runner.replays[32] > 0 and runner.replays[24] == 0
    assert runner.capture_pending() and runner.pending == []
    assert sched.control("stats")["cuda_graph_sizes_pending"] == 0.0
    assert not runner.capture_pending()
    # Each second-round prompt is a first-round prompt and its output: a cache hit up to the
    # last decoded token, whose KV the last replays wrote.
    second = [p + t + [rng.randrange(512)] for p, t in zip(first, got)]
    before = sched.stats.cached_prompt_tokens
    got2 = _generate(sched, second, [6] * 20)
    assert sched.stats.cached_prompt_tokens - before >= sum(len(p) + 5 for p in first)
    assert got2 == [hf_greedy(hf, p, 6, eos=False) for p in second]
    assert runner.replays[24] > 0
    # Every size's graph wrote its logits into one buffer of the largest size's rows.
    assert runner._logits.shape[0] == 40 and len(runner._graphs) == 8


@pytest.mark.gpu
@needs_cuda
def test_the_grammar_compiler_is_built_during_the_load(tmp_path, tiny_model_dirs):
    """On a GPU the scheduler builds its grammar compiler (the tokenizer's vocabulary, and the
    default backend, xgrammar, imported with transformers) beside the weights' load and the
    capture, and waits for it after them: the phases run weights, KV cache, graphs, grammar;
    the compile pool's workers start as the load begins. A model without a tokenizer waits
    for nothing."""
    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    path, _ = build_tiny_constrained_model(tmp_path / "with-tokenizer")
    sched = local_scheduler(path, kv_tokens=4096, cuda_graph_max_bs=4)
    assert list(sched.runner.phases) == ["weights", "kv cache", "graphs", "grammar"]
    assert sched.runner.graph_runner is not None
    pool = sched.grammars.waiting.compiler
    deadline = time.monotonic() + 10
    while not (pool.compiler and pool.worker_pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.compiler is not None and "xgrammar" in pool.compiler._backends  # built
    assert pool.compiler.backend == "xgrammar" and pool.worker_pids
    bare = local_scheduler(tiny_model_dirs["llama"], kv_tokens=1024, cuda_graph_max_bs=4)
    assert list(bare.runner.phases) == ["weights", "kv cache", "graphs"]


@pytest.mark.gpu
@needs_cuda
def test_8b_shaped_dummy_model_serves_with_cuda_graphs():
    """Llama-3.1-8B shapes, random bf16 weights, through braid.LLM (graphs captured in the
    scheduler process): mixed batches that shrink as requests finish, then batch-1 decode."""
    rng = random.Random(0)
    prompts = [[rng.randrange(128256) for _ in range(n)] for n in (1, 7, 300, 60, 33)]
    max_tokens = [16, 3, 12, 9, 5]
    with braid.LLM(
        LLAMA_8B,
        load_format="dummy",
        dtype="bfloat16",
        kv_tokens=32768,
        context_length=8192,
        cuda_graph_max_bs=16,
        show_progress=False,
    ) as llm:
        outs = llm.generate(
            prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
        assert all(0 <= t < 128256 for o in outs for t in o.outputs[0].token_ids)
        sp = SamplingParams(max_tokens=128, **GREEDY)
        llm.generate([prompts[2]], sp, use_tqdm=False)  # warm
        t0 = time.perf_counter()
        one = llm.generate([prompts[3]], sp, use_tqdm=False)[0].outputs[0].token_ids
        dt = time.perf_counter() - t0
        assert len(one) == 128
        llm.check_invariants()
    print(f"8B-shaped bf16 batch-1 greedy: {128 / dt:.1f} tok/s end to end (prefill included)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_token_fused_layers_give_the_unfused_tokens(tiny_model_dirs, arch):
    """bf16 on CUDA: batch-1 decode runs each layer's norms, projections and activation in
    fused skinny kernels (`select_one_row_forward`); with it switched off, the same greedy
    tokens, eagerly and from CUDA graphs (qwen2 has QKV bias, qwen3 per-head q/k norms)."""
    path = tiny_model_dirs[arch]
    kw = dict(dtype="bfloat16", kv_tokens=4096)
    fused = local_scheduler(path, **kw)
    fused_eager = local_scheduler(path, disable_cuda_graph=True, **kw)
    plain = local_scheduler(path, disable_cuda_graph=True, **kw)
    layers = plain.runner.model.model.layers
    assert all(layer.one_row is not None for layer in layers)
    for layer in layers:
        layer.one_row = None
    prompts = [[7, 100, 3, 42, 9], [300, 1]]
    want = _generate(plain, prompts[:1], [10]) + _generate(plain, prompts[1:], [10])
    for sched in (fused_eager, fused):
        got = _generate(sched, prompts[:1], [10]) + _generate(sched, prompts[1:], [10])
        assert got == want
