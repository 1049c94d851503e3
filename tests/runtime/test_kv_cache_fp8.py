"""The fp8 KV cache (`kv_cache_dtype="fp8_e4m3"`): settings, sizing, and greedy tokens equal to
a pure-torch reference whose attention reads every key and value through the same e4m3
quantize-dequantize (transformers' model with an attention function written here)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import braid
from braid.kernels.reference import dequantize_kv_reference, quantize_kv_reference
from braid.runtime.config import EngineConfig
from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.models.config import ModelConfig
from tests.conftest import hf_greedy, local_scheduler, run_to_end

FP8 = "braid_fp8_kv"


# The reference's per-layer (k_scale, v_scale); layers not named use 1.0, the scales a
# checkpoint without KV scales gets.
REF_SCALES: dict[int, tuple[float, float]] = {}


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over keys and values rounded through the cache: clamp(x / scale, +-448) -> e4m3 ->
    float32 -> times scale. Written from the cache's definition, not from braid's code path."""
    k_scale, v_scale = REF_SCALES.get(module.layer_idx, (1.0, 1.0))

    def through_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
        q8 = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return (q8.float() * scale).to(x.dtype)

    key, value = through_cache(key, k_scale), through_cache(value, v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(FP8, _fp8_kv_attention)
AttentionMaskInterface.register(FP8, sdpa_mask)  # SDPA's masks (sliding windows included)


def _reference(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.set_attn_implementation(FP8)
    return model.eval()


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (5, 23, 40)]


def test_kv_cache_dtype_values_are_checked():
    assert EngineConfig(kv_cache_dtype="fp8").kv_torch_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert EngineConfig().kv_torch_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype.*'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="'fp8_e5m2' is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_an_fp8_cache_holds_4x_float32_and_2x_bfloat16_tokens_in_the_same_memory(
    tiny_model_dirs,
):
    path = tiny_model_dirs["llama"]
    cfg = ModelConfig.from_dir(path)

    def runner(**kw) -> ModelRunner:
        return ModelRunner(
            EngineConfig(model=str(path), kv_tokens=64, show_progress=False, **kw), cfg, path
        )

    f32 = runner(dtype="float32")
    bf16 = runner(dtype="bfloat16")
    fp8 = runner(dtype="float32", kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_pool.k[0].dtype == torch.float8_e4m3fn
    assert fp8.kv_bytes_per_token * 4 == f32.kv_bytes_per_token
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    # The same 64 tokens take a quarter (a half) of the bytes.
    assert fp8.kv_pool.nbytes * 4 == f32.kv_pool.nbytes
    assert fp8.kv_pool.nbytes * 2 == bf16.kv_pool.nbytes


# `differs`: the float model's greedy tokens differ from the fp8 reference's on these prompts
# (checked, so that the comparison could catch a cache that stayed float); Qwen3's q/k norms
# keep its tiny model's keys small enough that e4m3 changes no token.
@pytest.mark.parametrize("arch,differs", [("llama", True), ("mistral", True), ("qwen3", False)])
def test_fp8_kv_greedy_tokens_equal_a_reference_reading_quantized_kv(
    tiny_model_dirs, arch, differs
):
    """Batched, at page size 4 with chunked prefill (16 tokens), a sliding window (Mistral) and
    a prefix hit, the engine's greedy tokens equal the reference's."""
    path = tiny_model_dirs[arch]
    prompts = _prompts(512, seed=len(arch))
    prompts.append(prompts[1][:20] + prompts[2][:30])  # shares 20 tokens with prompt 1
    ref = _reference(path)
    expected = [hf_greedy(ref, p, 12, eos=False) for p in prompts]
    sched = local_scheduler(
        path, kv_tokens=512, page_size=4, chunked_prefill_size=16, kv_cache_dtype="fp8_e4m3"
    )
    assert sched.runner.kv_pool.quantized
    sp = braid.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(f"r{i}", p, sp, 0))
    got = run_to_end(sched)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    floats = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert ([hf_greedy(floats, p, 12, eos=False) for p in prompts] != expected) == differs


def test_llm_with_fp8_kv_generates_and_keeps_its_accounting(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    prompts = _prompts(512, seed=5)
    expected = [hf_greedy(_reference(path), p, 8, eos=False) for p in prompts]
    sp = braid.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with braid.LLM(path, kv_tokens=256, kv_cache_dtype="fp8", show_progress=False) as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        llm.check_invariants()
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_tensor_parallel_ranks_hold_their_heads_in_fp8(tiny_model_dirs):
    """tp_size=2: each rank's pool holds its KV heads in fp8 (the quantization is per value,
    so the split changes nothing): the reference's tokens, with chunks and accounting kept."""
    path = tiny_model_dirs["llama"]
    prompts = _prompts(512, seed=11)
    expected = [hf_greedy(_reference(path), p, 10, eos=False) for p in prompts]
    sp = braid.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cfg = dict(kv_tokens=256, chunked_prefill_size=16, tp_size=2, kv_cache_dtype="fp8")
    with braid.LLM(path, show_progress=False, **cfg) as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        llm.check_invariants()
    assert [o.outputs[0].token_ids for o in outs] == expected


def _with_kv_scales(src: Path, dst: Path, scales: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint `src` whose safetensors also hold `scales` (vLLM's key names)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    save_file(load_file(weights) | scales, weights, metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales_are_read_and_used(tiny_model_dirs, tmp_path):
    """vLLM's `self_attn.k_scale` / `v_scale` (and AutoFP8's `kv_scale`, both at once) become
    the pool's per-layer scales; the reference with the same scales gives the same tokens, and
    those scales (extreme on purpose: K clamped at 448 / 256, V and layer 1 pushed into e4m3's
    subnormals) change tokens, so scales that were read but not applied would fail. A float
    cache loads the same checkpoint and leaves them unused; a scale per head is refused."""
    src = tiny_model_dirs["llama"]
    path = _with_kv_scales(
        src,
        tmp_path / "scaled",
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(2.0**-8),
            "model.layers.0.self_attn.v_scale": torch.tensor([64.0]),
            "model.layers.1.self_attn.kv_scale": torch.tensor(32.0),
        },
    )
    sched = local_scheduler(path, kv_tokens=256, kv_cache_dtype="fp8_e4m3")
    pool = sched.runner.kv_pool
    assert [pool.scales(i) for i in range(2)] == [(2.0**-8, 64.0), (32.0, 32.0)]
    prompts = _prompts(512, seed=21)
    unscaled = [hf_greedy(_reference(src), p, 10, eos=False) for p in prompts]
    REF_SCALES.update({0: (2.0**-8, 64.0), 1: (32.0, 32.0)})
    try:
        expected = [hf_greedy(_reference(src), p, 10, eos=False) for p in prompts]
    finally:
        REF_SCALES.clear()
    assert expected != unscaled
    sp = braid.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(f"r{i}", p, sp, 0))
    got = run_to_end(sched)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    floats = local_scheduler(path, kv_tokens=256)
    assert not floats.runner.kv_pool.quantized and floats.runner.kv_pool.scales(0) == (1.0, 1.0)
    per_head = _with_kv_scales(
        src, tmp_path / "per_head", {"model.layers.0.self_attn.k_scale": torch.ones(2)}
    )
    with pytest.raises(ValueError, match="k_scale: a KV cache scale per head"):
        local_scheduler(per_head, kv_tokens=256, kv_cache_dtype="fp8")


def test_a_compressed_tensors_kv_cache_scheme_brings_its_scales(tiny_model_dirs, tmp_path):
    """An llm-compressor FP8 checkpoint with a static per-tensor fp8 `kv_cache_scheme` loads,
    and its `k_scale` / `v_scale` tensors become the fp8 cache's scales; any other KV scheme is
    refused naming the field."""
    from tests.runtime.test_quantization_checkpoints import write_quantized

    ct = tmp_path / "ct"
    write_quantized(tiny_model_dirs["qwen2"], ct, "fp8_channel")
    config = json.loads((ct / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (ct / "config.json").write_text(json.dumps(config))
    scales = {
        f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(s)
        for i, (k, v) in enumerate([(0.5, 0.25), (2.0, 1.0)])
        for kind, s in (("k", k), ("v", v))
    }
    path = _with_kv_scales(ct, tmp_path / "ct_kv", scales)
    sched = local_scheduler(path, kv_tokens=256, kv_cache_dtype="fp8")
    assert [sched.runner.kv_pool.scales(i) for i in range(2)] == [(0.5, 0.25), (2.0, 1.0)]
    sp = braid.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sched.handle(GenerateReq("r", _prompts(512, seed=2)[1], sp, 0))
    assert len(run_to_end(sched)["r"]) == 6
    config["quantization_config"]["kv_cache_scheme"] = dict(scheme, strategy="attn_head")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="kv_cache_scheme: only static per-tensor fp8"):
        local_scheduler(path, kv_tokens=256, kv_cache_dtype="fp8")


@pytest.mark.slow  # transformers' generate on this CPU: about 15 s
def test_smollm2_with_fp8_kv_matches_the_quantized_kv_reference(smollm2_dir):
    """SmolLM2's real weights through the fp8 cache: the reference's greedy tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    ref = _reference(smollm2_dir)
    expected = [hf_greedy(ref, p, 12) for p in ids]
    sched = local_scheduler(smollm2_dir, kv_tokens=512, kv_cache_dtype="fp8_e4m3")
    sp = braid.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(ids):
        sched.handle(GenerateReq(f"r{i}", p, sp, 0))
    got = run_to_end(sched)
    n = [len(e) for e in expected]  # the reference stops at EOS; ignore_eos goes on
    assert [got[f"r{i}"][: n[i]] for i in range(len(ids))] == expected


def test_fp8_kv_and_float_kv_agree_on_the_first_token_of_smollm2(smollm2_dir):
    """Quantizing K/V is a small change: the next token of a plain prompt is the float one."""
    ids = list(range(100, 140))
    sp = braid.SamplingParams(temperature=0.0, max_tokens=1)
    tokens = {}
    for kv in ("auto", "fp8"):
        sched = local_scheduler(smollm2_dir, kv_tokens=256, kv_cache_dtype=kv)
        sched.handle(GenerateReq("r", ids, sp, 0))
        tokens[kv] = run_to_end(sched)["r"]
    assert tokens["auto"] == tokens["fp8"]


@pytest.mark.parametrize("algo", ["EAGLE", "DRAFT"])
def test_speculative_decoding_over_an_fp8_cache_changes_no_token(tiny_model_dirs, tmp_path, algo):
    """Verify rows, draft trees (tails, KV moved into place as bytes), EAGLE's own fp8 draft
    pool and a draft model's fp8 runner: greedy tokens are those of plain fp8 decoding."""
    from tests.runtime import spec_heads

    path = tiny_model_dirs["llama"]
    cfg = dict(kv_tokens=2048, page_size=4, kv_cache_dtype="fp8_e4m3")
    sp = braid.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(512, seed=9)

    def tokens(sched) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            sched.handle(GenerateReq(f"r{i}", p, sp, 0))
        return run_to_end(sched)

    want = tokens(local_scheduler(path, **cfg))
    if algo == "EAGLE":  # a tree of 10 nodes, 3 branches a position
        spec = dict(
            speculative_draft_model_path=str(spec_heads.write_eagle(tmp_path / "eagle")),
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=10,
        )
    else:  # the target as its own draft: every draft right, the draft's KV in fp8 too
        spec = dict(speculative_draft_model_path=str(path))
    sched = local_scheduler(path, speculative_algorithm=algo, **cfg, **spec)
    draft_pool = sched.proposer.pool if algo == "EAGLE" else sched.proposer.runner.kv_pool
    assert draft_pool.k[0].dtype == torch.float8_e4m3fn
    assert tokens(sched) == want
    assert sched.stats.spec_draft_tokens > 0
    if algo == "DRAFT":
        assert sched.stats.spec_accepted_tokens == sched.stats.spec_draft_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_kv_decode_through_cuda_graphs_equals_eager_gpu(tiny_model_dirs):
    """bf16 model, fp8 cache, triton backend: decode replayed from CUDA graphs gives the eager
    path's tokens (the scales are constants in the graphs), and the pool is fp8."""
    path = tiny_model_dirs["llama"]
    prompts = _prompts(512, seed=3)
    sp = braid.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        sched = local_scheduler(
            path,
            kv_tokens=1024,
            dtype="bfloat16",
            kv_cache_dtype="fp8_e4m3",
            disable_cuda_graph=not graphs,
            device="cuda",
        )
        assert sched.runner.kv_pool.k[0].dtype == torch.float8_e4m3fn
        assert (sched.runner.graph_runner is not None) == graphs
        for i, p in enumerate(prompts):
            sched.handle(GenerateReq(f"r{i}", p, sp, 0))
        outs[graphs] = run_to_end(sched)
        if graphs:
            assert sum(sched.runner.graph_runner.replays.values()) > 0, "decode ran in graphs"
    assert outs[True] == outs[False]


def test_dequantize_reference_is_the_cache_definition():
    x = torch.tensor([0.1, -1000.0, 3.3, 1e-4])
    q = quantize_kv_reference(x, 2.0)
    assert torch.equal(q.float(), (x / 2).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert dequantize_kv_reference(q, 2.0, torch.float32).tolist() == [
        0.1015625,
        -896.0,
        3.25,
        0.0,
    ]
