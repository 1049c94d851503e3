"""Quantized linear layers end to end: the method names and bad configs (each refusal names the
field, the layer and the value), the online quantizers' error bounds, the CPU kernels against
each method's torch reference (and the shapes they refuse falling back to it), fusion switched
off in a quantized model, random quantized weights for benchmarks, and greedy tokens of tiny
quantized checkpoints (made by the packers of test_quantization_checkpoints.py) through the
real loader and scheduler, equal to the same model run through its methods' references: one
checkpoint through `braid.LLM`'s processes, the others through a scheduler in this process.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import braid
from braid.kernels.fp8_quant import per_token_quant_fp8
from braid.kernels.quant_reference import dequantize_int4
from braid.runtime.config import EngineConfig
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.layers.fusion import (
    select_one_row_forward,
    select_prepared_one_row_forward,
    select_silu_mul_down,
    silu_mul_down,
)
from braid.runtime.layers.linear import Linear
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from braid.runtime.quantization import quantization_method_names, select_quantization
from braid.runtime.quantization.base import (
    INPUTS_AHEAD_ENV,
    LinearSpec,
    PreparedInputs,
    building,
)
from braid.runtime.quantization.fp8 import quantize_fp8
from braid.runtime.quantization.int4 import Int4LinearMethod, Int4Weights, quantize_int4
from braid.runtime.quantization.int8 import quantize_int8
from braid.runtime.sampling_params import SamplingParams
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.test_quantization_checkpoints import FORMATS, write_quantized

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [100, 200, 300, 400, 17]]
MAX_TOKENS = 10
METHODS = ["awq", "fp8", "gptq", "w8a16"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen2 (qkv bias, tied embeddings) in every checkpoint format."""
    root = tmp_path_factory.mktemp("quantized")
    for fmt in FORMATS:
        write_quantized(tiny_model_dirs["qwen2"], root / fmt, fmt)
    return {fmt: root / fmt for fmt in FORMATS}


def _config_dir(tmp_path: Path, src: Path, quantization_config: dict | None) -> Path:
    """A model directory with `src`'s config (and a quantization_config) and no weights."""
    d = tmp_path / "cfg"
    d.mkdir()
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(config))
    return d


def _build(path: Path, **kw):
    return build_model(
        ModelConfig.from_dir(path),
        path,
        dtype=torch.float32,
        device=CPU,
        max_positions=64,
        progress=False,
        **kw,
    )


# ---- names and refusals -----------------------------------------------------------------------


def test_every_method_is_a_choice_of_the_quantization_setting():
    names = quantization_method_names()
    # Sorted, and holding these (GGUF registers its own beside them).
    assert names == sorted(names)
    assert {"awq", "compressed-tensors", "fp8", "gptq", "w8a16"} <= set(names)
    for name in quantization_method_names():
        assert EngineConfig(quantization=name).quantization == name
    with pytest.raises(ValueError, match=r"quantization must be None or one of \['awq'"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "w8a16"}, "quant_method 'w8a16' is not supported"),
        ({"quant_method": "awq", "bits": 3}, "bits: AWQ with 3 bits"),
        ({"quant_method": "awq", "version": "gemv"}, "version: AWQ 'gemv'"),
        ({"quant_method": "awq", "zero_point": False}, "zero_point"),
        ({"quant_method": "gptq", "bits": 8}, "bits: GPTQ with 8 bits"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format: 'marlin'"),
        ({"quant_method": "gptq", "lm_head": True}, "lm_head: a quantized LM head"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme"),
        (
            {
                **FORMATS["int8_packed"],
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "symmetric": True,
                        },
                        "input_activations": None,
                    }
                },
            },
            r"format 'pack-quantized' with weights \{num_bits=4, type='int', strategy='group'",
        ),
        ({**FORMATS["fp8_channel"], "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ],
)
def test_a_checkpoint_config_braid_cannot_run_is_refused_naming_the_field(qc, match):
    with pytest.raises(ValueError, match=match):
        select_quantization(qc, None, dummy=False)


def test_a_requested_method_must_match_the_checkpoints():
    awq = FORMATS["awq"]
    assert select_quantization(awq, "awq", dummy=False).name == "awq"
    assert select_quantization(FORMATS["int8"], "w8a16", dummy=False).name == "w8a16"
    assert select_quantization(FORMATS["int8"], "compressed-tensors", dummy=False).name == "w8a16"
    with pytest.raises(ValueError, match="quantization 'fp8' does not match the checkpoint"):
        select_quantization(awq, "fp8", dummy=False)
    with pytest.raises(ValueError, match="compressed-tensors reads checkpoints"):
        select_quantization(None, "compressed-tensors", dummy=False)
    assert select_quantization(None, None, dummy=False) is None


def test_a_group_size_that_does_not_divide_a_layer_names_the_layer_and_value(
    tiny_model_dirs, tmp_path
):
    qc = {**FORMATS["awq"], "group_size": 48}
    d = _config_dir(tmp_path, tiny_model_dirs["qwen2"], qc)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.qkv_proj: group_size 48 does not divide its input "
        r"size 64",
    ):
        _build(d, load_format="dummy")


def test_a_fused_layer_half_left_in_floats_is_refused(tiny_model_dirs, tmp_path):
    qc = {**FORMATS["fp8_channel"], "ignore": ["re:.*\\.q_proj"]}
    d = _config_dir(tmp_path, tiny_model_dirs["qwen2"], qc)
    with pytest.raises(ValueError, match=r"qkv_proj: the checkpoint leaves some of this fused"):
        _build(d, load_format="dummy")


def test_vision_language_models_are_refused(tiny_model_dirs):
    cfg = ModelConfig.from_dir(tiny_model_dirs["qwen2"])
    vlm = replace(cfg, vision_config={"hidden_size": 8}, quantization_config=FORMATS["awq"])
    with pytest.raises(ValueError, match=r"quantization \(awq\) of vision-language models"):
        build_model(
            vlm, None, dtype=torch.float32, device=CPU, max_positions=8, load_format="dummy"
        )


def test_quantized_checkpoints_load_strictly(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoints["gptq_act_order"]
    state = load_file(str(src / "model.safetensors"))
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.g_idx"}
    save_file(missing, str(d / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"did not fill: \['model\.layers\.1\.self_attn\.qkv_proj\.g_idx\[k\]'\]"
    ):
        _build(d)
    bad = {
        **state,
        "model.layers.0.mlp.down_proj.qweight": state[
            "model.layers.0.mlp.down_proj.qweight"
        ].float(),
    }
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"down_proj\.qweight: shard None: checkpoint dtype "
        r"torch\.float32 is not one of \(int32\)",
    ):
        _build(d)


# ---- online quantizers ------------------------------------------------------------------------


def test_online_quantizers_round_to_nearest():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    codes, scales, zeros = quantize_int4(w, 64)
    assert int(codes.max()) <= 15
    deq = (codes.float() - zeros.repeat_interleave(64, 1).float()) * scales.repeat_interleave(64, 1)
    assert ((deq - w).abs() <= scales.repeat_interleave(64, 1) / 2 + 1e-6).all()
    q8, s8 = quantize_int8(w)
    assert ((q8.float() * s8[:, None] - w).abs() <= s8[:, None] / 2 + 1e-6).all()
    assert q8.abs().amax(1).eq(127).all()  # each row's largest weight takes the full range
    f8, sf = quantize_fp8(w)
    err = (f8.float() * sf[:, None] - w).abs()
    assert (err <= w.abs() * 2**-4 + sf[:, None] * 2**-9).all()  # 3 mantissa bits


# ---- layers on the CPU ------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_cpu_kernels_equal_their_reference_and_approximate_the_float_model(tiny_model_dirs, method):
    path = tiny_model_dirs["qwen2"]
    quantized, floats = _build(path, quantization=method), _build(path)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    pairs = [
        (n, a, b)
        for (n, a), b in zip(quantized.named_modules(), floats.modules())
        if isinstance(a, Linear)
    ]
    assert len(pairs) == 8 and all(a.method is not None for _, a, _ in pairs)
    for name, q, f in pairs:
        xi = x if q.in_features == 64 else torch.randn(5, q.in_features)
        got, ref, exact = q(xi), q.reference(xi), f(xi)
        assert got.dtype == torch.float32 and got.shape == exact.shape
        # Same rounding points, sums in another order: last-place differences of bfloat16
        # (fp8's reference is its CPU path: equal).
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3, msg=name)
        # The quantized weights approximate the float ones (int4: about a tenth).
        tol = {"awq": 0.25, "gptq": 0.25, "w8a16": 0.03, "fp8": 0.08}[method]
        assert (got - exact).abs().max() <= tol * exact.abs().max(), name


def test_shapes_the_cpu_int4_kernel_refuses_run_the_reference_in_the_models_dtype():
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    codes, scales, zeros = quantize_int4(w, 32)
    from braid.kernels.quant_reference import pack_int4

    weights = Int4Weights(pack_int4(codes), scales.T.contiguous(), zeros.T.contiguous(), 32)
    spec = LinearSpec("odd", 64, {None: (0, 24)}, torch.float32, CPU)  # N % 16 != 0

    class Given:
        def parameters(self):
            return {}

        def read(self):
            return weights

    m = Int4LinearMethod(spec, 32, Given())
    m.create_weights()
    m.finish_loading()
    x = torch.randn(3, 64)
    exact = x @ dequantize_int4(weights.qweight, weights.scales, weights.zeros, 32).T
    # No bfloat16 anywhere: float32 to the last bits.
    torch.testing.assert_close(m.apply(x, None), exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("perm", [False, True])
def test_the_planar_form_holds_the_same_weights(perm):
    """What the CUDA path keeps (`PlanarInt4`) dequantizes to the checkpoint's weights: the
    references of CUDA layers read it."""
    from braid.kernels.quant_reference import pack_int4, pack_int4_meta, pack_int4_planar
    from braid.runtime.quantization.int4 import PlanarInt4

    g = torch.Generator().manual_seed(3)
    codes, scales, zeros = quantize_int4(torch.randn(24, 320, generator=g), 64)
    order = torch.randperm(320, generator=g) if perm else None
    w = Int4Weights(pack_int4(codes), scales.T.contiguous(), zeros.T.contiguous(), 64, order)
    planar = PlanarInt4(
        pack_int4_planar(w.qweight), pack_int4_meta(w.scales, w.zeros), 64, 320, order
    )
    assert torch.equal(planar.dequantize(), w.dequantize())


def test_a_quantized_model_takes_no_fused_float_kernel():
    method = select_quantization(None, "w8a16", dummy=False)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert select_one_row_forward(cuda, bf16) is not None
    assert select_silu_mul_down(cuda, bf16) is not silu_mul_down
    with building(method):
        assert select_one_row_forward(cuda, bf16) is None
        assert select_silu_mul_down(cuda, bf16) is silu_mul_down


def test_the_prepared_one_row_forward_needs_the_flag_and_every_projection_prepared(monkeypatch):
    """`BRAID_GEMV_INPUTS_AHEAD=fused` chooses the layer forward whose norms and activation
    make their GEMV's input, only where qkv, gate_up and down have that form (on CUDA; a CPU
    model has none, so it keeps its own forward); a value other than 0, 1 or fused is
    refused naming the variable."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama"
    model = build_model(
        ModelConfig.from_dir(path), None, dtype=torch.float32, device=CPU, max_positions=64,
        load_format="dummy", quantization="fp8", progress=False,
    )  # fmt: skip
    layer = model.model.layers[0]
    monkeypatch.setenv(INPUTS_AHEAD_ENV, "fused")
    assert layer.one_row is None and select_prepared_one_row_forward(layer) is None
    sa, mlp = layer.self_attn, layer.mlp
    prepared = PreparedInputs(per_token_quant_fp8, None)
    for p in (sa.qkv_proj, mlp.gate_up_proj, mlp.down_proj):
        monkeypatch.setattr(p.method, "prepared", prepared)
    assert callable(select_prepared_one_row_forward(layer))  # o_proj needs none
    monkeypatch.setattr(mlp.down_proj.method, "prepared", None)
    assert select_prepared_one_row_forward(layer) is None
    monkeypatch.setattr(mlp.down_proj.method, "prepared", prepared)
    monkeypatch.setenv(INPUTS_AHEAD_ENV, "1")
    assert select_prepared_one_row_forward(layer) is None
    monkeypatch.setenv(INPUTS_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match="BRAID_GEMV_INPUTS_AHEAD must be 0, 1 or fused"):
        select_prepared_one_row_forward(layer)


@pytest.mark.parametrize("method", METHODS)
def test_random_weights_are_quantized_as_they_are_drawn(method):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama"
    model = build_model(
        ModelConfig.from_dir(path),
        None,
        dtype=torch.float32,
        device=CPU,
        max_positions=64,
        load_format="dummy",
        quantization=method,
        progress=False,
    )
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.method is not None for m in layers)
    assert not any(p.is_meta for p in model.parameters())
    for layer in layers:
        w = layer.method.dequantize()
        # Drawn from N(0, 0.02): the quantized weights keep that spread.
        assert 0.015 < w.std().item() < 0.025
        assert torch.isfinite(layer(torch.randn(2, layer.in_features))).all()


# ---- greedy tokens: fast kernels vs the methods' references -----------------------------------


def _greedy(sched) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        sched.handle(GenerateReq(str(i), p, sp, i))
    tokens = run_to_end(sched)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def _reference_greedy(path: Path, monkeypatch, **config) -> list[list[int]]:
    """The same checkpoint, every linear layer through its method's torch reference."""
    with monkeypatch.context() as m:
        m.setattr(Linear, "forward", Linear.reference)
        return _greedy(local_scheduler(path, kv_tokens=256, **config))


def test_an_awq_model_through_the_engine_gives_its_references_greedy_tokens(
    checkpoints,
    monkeypatch,
):
    path = checkpoints["awq"]
    with braid.LLM(path, kv_tokens=256, show_progress=False) as llm:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        llm.check_invariants()
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == _reference_greedy(path, monkeypatch)


@pytest.mark.parametrize(
    "fmt", ["gptq_act_order", "fp8_channel", "fp8_tensor_static", "int8_packed"]
)
def test_each_format_gives_its_references_greedy_tokens(checkpoints, monkeypatch, fmt):
    path = checkpoints[fmt]
    got = _greedy(local_scheduler(path, kv_tokens=256))
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == _reference_greedy(path, monkeypatch)


def test_the_quantization_setting_quantizes_a_float_checkpoint_in_the_engine(
    tiny_model_dirs, capfd
):
    path = tiny_model_dirs["qwen2"]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with braid.LLM(path, quantization="w8a16", kv_tokens=256, show_progress=False) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    # The scheduler process logs the model's method with its weights.
    assert "MB of weights (w8a16)" in capfd.readouterr().err


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order", "fp8_channel", "int8_packed"])
def test_on_gpu_each_format_gives_its_references_greedy_tokens(
    checkpoints,
    monkeypatch,
    fmt,
):
    """bfloat16 on CUDA: the Triton GEMMs (fp8: per-token quantization and _scaled_mm) under
    CUDA graphs, against the references run eagerly."""
    path = checkpoints[fmt]
    gpu = dict(device="cuda", dtype="bfloat16")
    got = _greedy(local_scheduler(path, kv_tokens=256, **gpu))
    assert got == _reference_greedy(path, monkeypatch, disable_cuda_graph=True, **gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_on_gpu_norms_and_activation_that_prepare_the_gemv_inputs_give_the_same_tokens(
    tmp_path, monkeypatch, method
):
    """BRAID_GEMV_INPUTS_AHEAD=fused at Llama-3.1-8B's layer shapes (two layers, a small
    vocabulary, random weights), batch-1 decode under CUDA graphs: each layer runs the
    prepared forward (the norms and the activation make their GEMV's input), and the greedy
    tokens equal those of the model whose GEMVs prepare their own input (the norms' sums of
    squares add in `rmsnorm`'s order at hidden 4096, and the GEMVs run the same launch shapes
    here, so the bits do not move)."""
    from braid.kernels.quant_gemv import config_for
    from tests.conftest import same_launch_shapes

    same_launch_shapes(monkeypatch)

    src = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.1-8b"
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=2, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(config))
    dev = torch.device("cuda")
    if method == "awq" and not config_for("int4", 6144, 4096, dev).packed:
        pytest.skip(f"{torch.cuda.get_device_name()}: no packed one-row int4 form in its table")
    gpu = dict(device="cuda", dtype="bfloat16", load_format="dummy", quantization=method)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for mode in ("0", "fused"):
        monkeypatch.setenv(INPUTS_AHEAD_ENV, mode)
        sched = local_scheduler(tmp_path, kv_tokens=512, **gpu)
        layers = sched.runner.model.model.layers
        assert all((layer.one_row is not None) == (mode == "fused") for layer in layers)
        sched.handle(GenerateReq("a", list(range(5, 40)), sp, 0))
        tokens[mode] = run_to_end(sched)["a"]
        del sched
    assert len(tokens["0"]) == 24 and tokens["fused"] == tokens["0"]
