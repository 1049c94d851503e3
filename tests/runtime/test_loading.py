"""Model loading: strict weights, dtypes, GGUF conversion cache, model resolution."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import braid
from braid.runtime.models.source import EMBEDDED_GGUF, embedded_gguf_path, resolve_model
from tests.conftest import local_scheduler


def _copy_with_state(src, dst, edit):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})
    return dst


def test_unconsumed_checkpoint_key_is_an_error(tiny_model_dirs, tmp_path):
    def add(state):
        state["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)

    path = _copy_with_state(tiny_model_dirs["llama"], tmp_path / "m", add)
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        local_scheduler(path, kv_tokens=64)
    # The same error reaches the caller of LLM() from the scheduler process.
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        braid.LLM(path, kv_tokens=64, show_progress=False)


def test_unfilled_parameter_is_an_error(tiny_model_dirs, tmp_path):
    def drop(state):
        del state["model.layers.1.self_attn.k_proj.weight"]

    path = _copy_with_state(tiny_model_dirs["llama"], tmp_path / "m", drop)
    with pytest.raises(ValueError, match=r"layers.1.self_attn.qkv_proj.weight\[k\]"):
        local_scheduler(path, kv_tokens=64)


def test_wrong_shape_is_an_error(tiny_model_dirs, tmp_path):
    def bad(state):
        state["model.norm.weight"] = torch.zeros(3)

    path = _copy_with_state(tiny_model_dirs["llama"], tmp_path / "m", bad)
    with pytest.raises(ValueError, match="model.norm.weight"):
        local_scheduler(path, kv_tokens=64)


def test_fused_projections_hold_the_checkpoint_weights(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    state = load_file(str(path / "model.safetensors"))
    model = local_scheduler(path, kv_tokens=64).runner.model
    attn = model.model.layers[0].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(k, state["model.layers.0.self_attn.k_proj.weight"])
    qb, kb, vb = attn.qkv_proj.bias.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(vb, state["model.layers.0.self_attn.v_proj.bias"])
    gate, up = model.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, state["model.layers.1.mlp.up_proj.weight"])
    # Tied embeddings: one tensor.
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(
    "dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_half_precision_dtypes_load_and_run(tiny_model_dirs, dtype, torch_dtype):
    runner = local_scheduler(tiny_model_dirs["llama"], dtype=dtype, kv_tokens=128).runner
    assert all(p.dtype == torch_dtype for p in runner.model.parameters())
    assert runner.kv_pool.k[0].dtype == torch_dtype
    with braid.LLM(
        tiny_model_dirs["llama"], dtype=dtype, kv_tokens=128, show_progress=False
    ) as llm:
        assert llm.ready.dtype == dtype
        out = llm.generate([[1, 2, 3]], braid.SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_load_format_builds_random_weights_from_config(tiny_model_dirs, tmp_path):
    path = tmp_path / "cfg-only"
    path.mkdir()
    shutil.copy(tiny_model_dirs["qwen3"] / "config.json", path / "config.json")
    with braid.LLM(path, load_format="dummy", kv_tokens=128, show_progress=False) as llm:
        out = llm.generate([[5, 6, 7]], braid.SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_unknown_models_and_architectures(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve_model("./no-such-model/anywhere")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        braid.LLM(tmp_path, load_format="dummy", kv_tokens=64, show_progress=False)
    with pytest.raises(ValueError, match="dtype"):
        braid.LLM(tmp_path, dtype="int3")


def test_embedded_model_is_converted_once_and_reused():
    gguf = embedded_gguf_path()
    assert gguf.name == EMBEDDED_GGUF
    first = resolve_model(None)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m") == first
    assert resolve_model(str(gguf)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (first / f).is_file()
