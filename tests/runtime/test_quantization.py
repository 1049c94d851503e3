"""Quantized linear layers end to end: the method names and bad configs (each refusal names the
field, the layer and the value), the online quantizers' error bounds, the CPU layers against a
computation of their own from the float weights (and the shapes the CPU kernels refuse falling
back to the torch reference), fusion switched off in a quantized model, random quantized
weights for benchmarks, and greedy tokens of tiny quantized checkpoints (made by the packers of
test_quantization_checkpoints.py) through the real loader and scheduler, equal to those of the
same model whose quantized layers multiply by the weights the packer meant, computed from its
own codes and scales at the kernels' rounding points (on the CPU; on a GPU, against the
methods' torch references): one checkpoint through `braid.LLM`'s processes, the others
through a scheduler in this process.

No reference here runs the code it checks: on the CPU the int4 kernel's packing is opaque, so
a CPU layer's `reference` reads its weight back through the kernel, and fp8 has no CPU kernel
(its `reference` is what it runs); those references are for the GPU's kernels.
"""

from __future__ import annotations

import functools
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
from braid.runtime.quantization.fp8 import Fp8LinearMethod, quantize_fp8
from braid.runtime.quantization.int4 import Int4LinearMethod, Int4Weights, quantize_int4
from braid.runtime.quantization.int8 import quantize_int8
from braid.runtime.sampling_params import SamplingParams
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.test_quantization_checkpoints import (
    FORMATS,
    Written,
    bf16_kernel_linear,
    cpu_int4_weight,
    stacked_weight,
    write_quantized,
)

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [100, 200, 300, 400, 17]]
MAX_TOKENS = 10
METHODS = ["awq", "fp8", "gptq", "w8a16"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dirs, tmp_path_factory) -> dict[str, tuple[Path, Written]]:
    """The tiny Qwen2 (qkv bias, tied embeddings) in every checkpoint format, with what each
    holds."""
    root = tmp_path_factory.mktemp("quantized")
    return {
        fmt: (root / fmt, write_quantized(tiny_model_dirs["qwen2"], root / fmt, fmt))
        for fmt in FORMATS
    }


def fp8_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 fp8 computed apart from braid's code: each row of x divided by its scale max|row| /
    448 (a float32 number, as the method defines it) and rounded to e4m3 from float64, the
    products with `weight` (float32, the dequantized e4m3 weight) summed in float64, plus the
    bias, rounded once to x's dtype."""
    scale = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12).double()
    codes = (x.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    y = (codes * scale) @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def _multiply_as_meant(model, written: Written) -> None:
    """Each quantized layer of `model` (built on the CPU from a checkpoint of `write_quantized`)
    multiplies, in place of its kernel, by the weight its checkpoint's packer meant at the
    kernel's rounding points (`Written.on_cpu`): fp8 `fp8_float64`, int4 and int8, whose CPU
    kernels take bfloat16, `bf16_kernel_linear`."""
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or layer.method is None:
            continue
        if isinstance(layer.method, Fp8LinearMethod):
            linear = fp8_float64
        else:
            assert layer.method.compute_dtype == torch.bfloat16, name  # torch's CPU kernel
            linear = bf16_kernel_linear
        weight = stacked_weight(model, name, layer, written.on_cpu)
        layer.forward = functools.partial(linear, weight=weight, bias=layer.bias)


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


@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
def test_int4_checkpoint_shards_not_a_multiple_of_8_rows_are_refused_naming_the_layer(fmt):
    """AWQ packs 8 outputs a word, GPTQ 8 zero points: a shard of 12 rows cannot be read."""
    spec = LinearSpec(
        "model.layers.3.self_attn.qkv_proj",
        64,
        {"q": (0, 64), "k": (64, 12), "v": (76, 12)},
        torch.float32,
        CPU,
    )
    method = select_quantization(FORMATS[fmt], None, dummy=False)
    with pytest.raises(
        ValueError,
        match=r"layers\.3\.self_attn\.qkv_proj: 12 output rows \(shard 'k'\) are not a multiple "
        r"of 8",
    ):
        method.linear_method(spec, ("q_proj", "k_proj", "v_proj"))


def test_fp8_refuses_sizes_not_a_multiple_of_16_and_gpus_before_8_9(monkeypatch):
    """`_scaled_mm`'s limits, checked as the layer is made (the GPU's compute capability
    stubbed: the check's function runs on the CPU)."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    method = select_quantization(None, "fp8", dummy=False)

    def layer(k: int, n: int):
        cuda, name = torch.device("cuda"), "model.layers.2.mlp.down_proj"
        spec = LinearSpec(name, k, {None: (0, n)}, torch.bfloat16, cuda)
        return method.linear_method(spec, ("down_proj",))

    assert layer(64, 32) is not None
    with pytest.raises(
        ValueError, match=r"layers\.2\.mlp\.down_proj: fp8 needs its input size \(100\) to be a "
    ):
        layer(100, 32)
    with pytest.raises(ValueError, match=r"down_proj: fp8 needs its output size \(24\) to be a "):
        layer(64, 24)
    capability[0] = (8, 6)
    with pytest.raises(
        ValueError,
        match=r"layers\.2\.mlp\.down_proj: fp8 needs a GPU of compute capability 8\.9 or newer, "
        r"this one is 8\.6",
    ):
        layer(64, 32)


@pytest.mark.parametrize("name", ["awq", "gptq"])
def test_online_int4_without_a_group_size_that_divides_the_input_names_the_layer(name):
    spec = LinearSpec("model.layers.0.mlp.down_proj", 80, {None: (0, 64)}, torch.float32, CPU)
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.mlp\.down_proj: no int4 group size of \[128, 64, 32\] divides its "
        r"input size 80",
    ):
        select_quantization(None, name, dummy=False).linear_method(spec, ("down_proj",))


def test_tensor_parallelism_of_a_quantized_checkpoint_is_refused_naming_its_method(checkpoints):
    from braid.runtime.distributed.group import TPGroup
    from braid.runtime.executor.model_runner import ModelRunner

    path, _ = checkpoints["awq"]
    rank1 = TPGroup(rank=1, size=2, local_rank=1, device_group=None, cpu_group=None)
    config = EngineConfig(
        model=str(path), device="cpu", kv_tokens=64, show_progress=False, tp_size=2
    )
    match = r"tensor parallelism of quantized checkpoints \(quant_method 'awq'\)"
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dir(path).check_engine(config)  # the front end's check
    with pytest.raises(ValueError, match=match):
        ModelRunner(config, ModelConfig.from_dir(path), path, tp=rank1)


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

    src, _ = checkpoints["gptq_act_order"]
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


def _quantized_as_meant(
    method: str, layer: Linear, x: torch.Tensor, float_weight: torch.Tensor
) -> torch.Tensor:
    """`layer`'s output for x computed from the float weight it was quantized from: the online
    quantizer's codes and scales, dequantized in plain torch with the CPU kernel's roundings,
    multiplied at its rounding points."""
    if method == "fp8":
        codes, scales = quantize_fp8(float_weight)
        return fp8_float64(x, codes.float() * scales[:, None], layer.bias)
    if method == "w8a16":
        codes, scales = quantize_int8(float_weight)  # the kernel's scales are bfloat16
        weight = codes.float() * scales.bfloat16().float()[:, None]
        return bf16_kernel_linear(x, weight, layer.bias)
    g = layer.method.group_size
    codes, scales, zeros = quantize_int4(float_weight, g)
    g_idx = torch.arange(layer.in_features) // g
    weight = cpu_int4_weight(codes, scales.T, zeros.T, g_idx)
    return bf16_kernel_linear(x, weight, layer.bias)


@pytest.mark.parametrize("method", METHODS)
def test_cpu_layers_multiply_by_their_quantized_weights_and_approximate_the_float_model(
    tiny_model_dirs, method
):
    """Each CPU layer against its float weight quantized by the online quantizer and
    multiplied in plain torch (fp8, which has no CPU kernel of its own: in float64)."""
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
        got, want, exact = q(xi), _quantized_as_meant(method, q, xi, f.weight), f(xi)
        assert got.dtype == torch.float32 and got.shape == exact.shape
        if method == "fp8":
            # float32 sums of exact e4m3 products against float64 ones.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        else:
            # Same rounding points, sums in another order: last-place differences of
            # bfloat16; a wrong code, zero or scale is off by a step of the weight.
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3, msg=name)
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


def _greedy_as_meant(path: Path, written: Written) -> list[list[int]]:
    """The same checkpoint on the CPU, its quantized layers multiplying by the weights the
    packer meant (`_multiply_as_meant`)."""
    sched = local_scheduler(path, kv_tokens=256)
    _multiply_as_meant(sched.runner.model, written)
    return _greedy(sched)


def test_an_awq_model_through_the_engine_gives_the_greedy_tokens_of_its_packers_weights(
    checkpoints,
):
    path, written = checkpoints["awq"]
    with braid.LLM(path, kv_tokens=256, show_progress=False) as llm:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        llm.check_invariants()
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == _greedy_as_meant(path, written)


@pytest.mark.parametrize(
    "fmt",
    [
        "gptq_act_order",
        "gptq_v2",
        "gptq_per_channel",
        "fp8_channel",
        "fp8_tensor_static",
        "int8_packed",
        "int8",
    ],
)
def test_each_format_gives_the_greedy_tokens_of_its_packers_weights(checkpoints, fmt):
    path, written = checkpoints[fmt]
    got = _greedy(local_scheduler(path, kv_tokens=256))
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == _greedy_as_meant(path, written)


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
    CUDA graphs, against the references run eagerly (plain torch over the weights as the CUDA
    path keeps them: the planar int4 form, which `test_the_planar_form_holds_the_same_weights`
    ties to the checkpoint's)."""
    path, _ = checkpoints[fmt]
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
