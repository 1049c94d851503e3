"""Quantized checkpoints as the published tools write them, made here by packers that follow the
formats (AutoAWQ's GEMM packing with its interleave, AutoGPTQ's packing with its zero-minus-one
and g_idx, compressed-tensors' FP8 and INT8, vLLM's fp8), and braid's readers of them: every
code, zero and scale comes back exactly (round trip), act-order included; tiny models written
in each format load through the real loader with the weights the packer meant.

The packers quantize with GPTQ's formula (the range includes zero), not braid's online one, so
the two sides share nothing but the format. Other test modules build their checkpoints here,
and take from here the weight each layer's CPU kernel should multiply by, computed from the
packer's own codes, zeros and scales (`Written.on_cpu`), and the kernels' rounding points
(`bf16_kernel_linear`): references that share nothing with braid's readers and packing.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from braid.kernels.quant_reference import FP8_DTYPE, unpack_int4
from braid.runtime.layers.linear import Linear
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from braid.runtime.quantization.awq import read_awq
from braid.runtime.quantization.gptq import read_gptq

CPU = torch.device("cpu")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that read the same input (and so share GPTQ's act-order: it orders by the input).
SAME_INPUT = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


# ---- quantizer and packers --------------------------------------------------------------------


def quantize_groups(w: torch.Tensor, group: int, order: torch.Tensor | None = None):
    """GPTQ's asymmetric 4-bit round to nearest of w [N, K] (float32): per group, scale =
    (max(w, 0) - min(w, 0)) / 15 stored as float16, zero = round(-min / scale). Groups are
    consecutive inputs, or consecutive in `order` (act-order). Returns codes [N, K], scales
    float16 [K / G, N], zeros [K / G, N] (int64) and g_idx int32 [K]."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    codes = torch.empty(n, k, dtype=torch.int64)
    scales = torch.empty(k // group, n, dtype=torch.float16)
    zeros = torch.empty(k // group, n, dtype=torch.int64)
    for g in range(k // group):
        cols = order[g * group : (g + 1) * group]
        sub = w[:, cols]
        lo, hi = sub.min(1).values.clamp(max=0), sub.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).half()
        z = torch.round(-lo / s.float())
        codes[:, cols] = torch.clamp(
            torch.round(sub / s.float()[:, None]) + z[:, None], 0, 15
        ).long()
        scales[g], zeros[g] = s, z.long()
    return codes, scales, zeros, g_idx


def dequantized(codes, scales, zeros, g_idx) -> torch.Tensor:
    g = g_idx.long()
    return (codes.float() - zeros[g].T.float()) * scales[g].T.float()


def cpu_int4_weight(codes, scales, zeros, g_idx) -> torch.Tensor:
    """The weight torch's CPU int4 kernel multiplies by for these codes, zeros and scales, as
    `braid.runtime.quantization.int4` documents it: (q - 8) * s + (8 - zero) * s per group,
    s the scale rounded to bfloat16, and the offset (8 - zero) * s rounded to bfloat16."""
    g = g_idx.long()
    s, z = scales[g].T.float().bfloat16().float(), zeros[g].T.float()
    return (codes.float() - 8) * s + ((8 - z) * s).bfloat16().float()


def bf16_kernel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias with the rounding points of torch's CPU int4 and int8 kernels:
    bfloat16 activations, float32 sums, the output rounded to bfloat16, then the bias in x's
    dtype."""
    y = (x.bfloat16().float() @ weight.T).bfloat16().to(x.dtype)
    return y if bias is None else y + bias


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict:
    """AutoAWQ's WQLinear_GEMM tensors: the codes transposed to [K, N], eight outputs a word in
    the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds output 8 * col + order[i]), zeros the same
    way, scales float16 [K / G, N]."""

    def pack_columns(values: np.ndarray) -> np.ndarray:
        out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
        for col in range(out.shape[1]):
            for i, c in enumerate(AWQ_PACK_ORDER):
                out[:, col] |= values[:, col * 8 + c].astype(np.uint64) << np.uint64(4 * i)
        return out

    return {
        "qweight": _int32(pack_columns(codes.T.numpy())),
        "qzeros": _int32(pack_columns(zeros.numpy())),
        "scales": scales.clone(),
    }


def pack_gptq(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    fmt: str = "gptq",
) -> dict:
    """AutoGPTQ's QuantLinear tensors: qweight [K / 8, N] (row r packs inputs 8r..8r+7, input
    8r + j in bits 4j..4j+3), qzeros [K / G, N / 8] packed along N the same way and stored minus
    one in the "gptq" format, scales float16, g_idx int32."""
    if fmt == "gptq":
        assert int(zeros.min()) >= 1, "a zero of 0 has no gptq (v1) encoding"
    intweight = codes.T.numpy().astype(np.uint64)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint64)
    for r in range(qweight.shape[0]):
        for j in range(8):
            qweight[r] |= intweight[8 * r + j] << np.uint64(4 * j)
    stored = (zeros.numpy() - (1 if fmt == "gptq" else 0)).astype(np.uint64) & np.uint64(0xF)
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // 8), dtype=np.uint64)
    for c in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, c] |= stored[:, 8 * c + j] << np.uint64(4 * j)
    return {
        "qweight": _int32(qweight),
        "qzeros": _int32(qzeros),
        "scales": scales.clone(),
        "g_idx": g_idx.clone(),
    }


def pack_fp8(w: torch.Tensor, per_channel: bool) -> tuple[dict, torch.Tensor]:
    """An fp8 e4m3 weight with a per-channel ([N, 1]) or per-tensor (scalar) float32 scale,
    and the weight it stands for."""
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / 448.0).float()
    q = (w / scale).to(FP8_DTYPE)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def pack_int8(w: torch.Tensor, packed: bool) -> tuple[dict, torch.Tensor]:
    """compressed-tensors INT8 W8A16 (symmetric, per channel): an int8 `weight`, or
    pack-quantized `weight_packed` (four codes a word, byte i = code of input 4j + i, plus 128)
    with `weight_shape`; `weight_scale` bfloat16 [N, 1]."""
    scale = (w.abs().amax(1, keepdim=True) / 127.0).bfloat16()
    q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
    meant = q.float() * scale.float()
    if not packed:
        return {"weight": q, "weight_scale": scale}, meant
    unsigned = (q.to(torch.int64) + 128).numpy().astype(np.uint64)
    words = np.zeros((unsigned.shape[0], unsigned.shape[1] // 4), dtype=np.uint64)
    for i in range(4):
        words |= unsigned[:, i::4] << np.uint64(8 * i)
    shape = torch.tensor(list(w.shape), dtype=torch.int64)
    return {"weight_packed": _int32(words), "weight_shape": shape, "weight_scale": scale}, meant


# ---- checkpoints --------------------------------------------------------------------------------

GROUP = 32
FP8_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "strategy": "channel",
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            },
        }
    },
    # Layer 1's MLP stays in floats: a fused layer wholly in the list.
    "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\..*"],
}
INT8_PACKED = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "strategy": "channel",
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}
FORMATS = {
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    },
    "gptq_act_order": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": True,
        "sym": False,
        "checkpoint_format": "gptq",
        "lm_head": False,
    },
    "gptq_v2": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
        "lm_head": False,
    },
    "gptq_per_channel": {  # group_size -1: one group per output row
        "quant_method": "gptq",
        "bits": 4,
        "group_size": -1,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
        "lm_head": False,
    },
    "fp8_channel": FP8_CHANNEL,
    "fp8_tensor_static": {"quant_method": "fp8", "activation_scheme": "static"},
    "int8_packed": INT8_PACKED,
    "int8": {**INT8_PACKED, "format": "int-quantized"},
}


def _quantize_one(fmt: str, w: torch.Tensor, order: torch.Tensor | None):
    """The checkpoint tensors (suffix -> tensor) for one float weight, the weight meant and
    the weight the CPU kernel multiplies by."""
    if fmt == "awq" or fmt.startswith("gptq"):
        group = w.shape[1] if fmt == "gptq_per_channel" else GROUP
        codes, scales, zeros, g_idx = quantize_groups(w, group, None if fmt == "awq" else order)
        if fmt == "awq":
            tensors = pack_awq(codes, zeros, scales)
        else:
            version = "gptq" if fmt == "gptq_act_order" else "gptq_v2"
            tensors = pack_gptq(codes, zeros, scales, g_idx, version)
        parts = (codes, scales, zeros, g_idx)
        return tensors, dequantized(*parts), cpu_int4_weight(*parts)
    if fmt.startswith("fp8"):
        tensors, meant = pack_fp8(w, per_channel=fmt == "fp8_channel")
        if fmt == "fp8_tensor_static":
            tensors["input_scale"] = torch.tensor(0.05)
        return tensors, meant, meant
    # The int8 kernel's bfloat16 scales are the checkpoint's own.
    tensors, meant = pack_int8(w, packed=fmt == "int8_packed")
    return tensors, meant, meant


@dataclass
class Written:
    """What `write_quantized` wrote, per checkpoint weight key: `meant`, the float32 weight the
    quantized tensors stand for (the float weight itself for a module the config leaves in
    floats); `on_cpu`, the weight braid's CPU kernel of the format multiplies by (int4: its
    bfloat16 scales and offsets, `cpu_int4_weight`), from the packer's own values."""

    meant: dict[str, torch.Tensor]
    on_cpu: dict[str, torch.Tensor]


def write_quantized(src: Path, dst: Path, fmt: str, seed: int = 0) -> Written:
    """Write `src` (a float HF checkpoint) quantized in `fmt` to `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    qc = FORMATS[fmt]
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    g = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    out, written = {}, Written({}, {})
    for key, t in state.items():
        module, _, leaf = key.rpartition(".")
        parent, _, proj = module.rpartition(".")
        ignored = any(i.startswith("re:") and re.match(i[3:], module) for i in qc.get("ignore", []))
        if leaf != "weight" or proj not in PROJECTIONS or ignored:
            out[key] = t
            written.meant[key] = written.on_cpu[key] = t.float()
            continue
        w = t.float()
        source = (parent, SAME_INPUT.get(proj, proj))
        if source not in orders:
            orders[source] = torch.randperm(w.shape[1], generator=g)
        tensors, written.meant[key], written.on_cpu[key] = _quantize_one(fmt, w, orders[source])
        for suffix, tensor in tensors.items():
            out[f"{module}.{suffix}"] = tensor
    save_file(out, str(dst / "model.safetensors"))
    return written


@pytest.fixture(scope="session")
def quantized_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, tuple[Path, Written]]:
    """Tiny Qwen2 (qkv bias, tied embeddings) in every format: name -> (dir, what it holds)."""
    root = tmp_path_factory.mktemp("quantized")
    return {
        fmt: (root / fmt, write_quantized(tiny_model_dirs["qwen2"], root / fmt, fmt))
        for fmt in FORMATS
    }


# ---- readers: round trips ---------------------------------------------------------------------


def _weights(n=48, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.1


def test_awq_reader_recovers_every_code_zero_and_scale():
    w = _weights()
    codes, scales, zeros, g_idx = quantize_groups(w, GROUP)
    packed = pack_awq(codes, zeros, scales)
    got = read_awq(**packed, group_size=GROUP)
    assert got.perm is None
    assert torch.equal(got.dequantize(), dequantized(codes, scales, zeros, g_idx))
    # The words are interleaved (read in plain nibble order they are other codes), so the
    # equality above holds only with AWQ's order.
    assert not torch.equal(unpack_int4(packed["qweight"]).long(), codes.T)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reader_recovers_the_weight_with_and_without_act_order(fmt, act_order):
    w = _weights(seed=1)
    order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(2))
    codes, scales, zeros, g_idx = quantize_groups(w, GROUP, order if act_order else None)
    offset = 1 if fmt == "gptq" else 0
    packed = pack_gptq(codes, zeros, scales, g_idx, fmt)
    got = read_gptq(**packed, group_size=GROUP, zero_offset=offset)
    assert (got.perm is not None) == act_order
    assert torch.equal(got.dequantize(), dequantized(codes, scales, zeros, g_idx))
    if act_order:
        # The kernel's input is x[:, perm], and its groups are then contiguous.
        assert torch.equal(g_idx[got.perm].long(), torch.arange(w.shape[1]) // GROUP)


def test_gptq_v1_zero_is_the_stored_nibble_plus_one():
    # AutoGPTQ's readers add one to the stored zero: a stored 15 is a zero of 16.
    codes = torch.full((8, 32), 3)
    stored_15 = _int32(np.full((1, 1), 0xFFFFFFFF, dtype=np.uint64))
    packed = pack_gptq(
        codes,
        torch.ones(1, 8, dtype=torch.int64),
        torch.ones(1, 8).half(),
        torch.zeros(32, dtype=torch.int32),
    )
    got = read_gptq(packed["qweight"], stored_15, packed["scales"], 32, zero_offset=1)
    assert got.zeros.tolist() == [[16] * 8]
    assert torch.equal(got.dequantize(), torch.full((8, 32), -13.0))


def test_a_g_idx_without_whole_groups_is_refused_naming_the_layer():
    w = _weights(n=8, k=64)
    codes, scales, zeros, g_idx = quantize_groups(w, GROUP)
    bad = g_idx.clone()
    bad[0] = 1  # group 1 now has 33 inputs, group 0 has 31
    packed = pack_gptq(codes, zeros, scales, bad, "gptq_v2")
    with pytest.raises(ValueError, match=r"layers\.0\.x_proj: g_idx does not put exactly"):
        read_gptq(**packed, group_size=GROUP, zero_offset=0, layer="layers.0.x_proj")


# ---- tiny models through the real loader --------------------------------------------------------


def stacked_weight(
    model,
    name: str,
    layer: Linear,
    weights: dict[str, torch.Tensor] | Callable[[str], torch.Tensor],
) -> torch.Tensor:
    """Layer `name`'s weight from per-checkpoint-key weights (a mapping, or a function of the
    key): its shards' stacked in its shard order."""
    weight_of = weights.__getitem__ if isinstance(weights, dict) else weights
    prefix, _, leaf = name.rpartition(".")
    parts = {s: p for p, (fused, s) in model.stacked_params.items() if fused == leaf}
    if not parts:
        return weight_of(f"{name}.weight")
    return torch.cat([weight_of(f"{prefix}.{parts[s]}.weight") for s in layer.offsets])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_loads_the_weights_its_packer_meant(quantized_dirs, fmt):
    path, written = quantized_dirs[fmt]
    model = build_model(
        ModelConfig.from_dir(path),
        path,
        dtype=torch.float32,
        device=CPU,
        max_positions=64,
        progress=False,
    )
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    quantized = [n for n, m in linears if m.method is not None]
    if fmt == "fp8_channel":
        assert {n for n, m in linears if m.method is None} == {
            "model.layers.1.mlp.gate_up_proj",
            "model.layers.1.mlp.down_proj",
        }
    else:
        assert len(quantized) == len(linears) == 8
    for name, layer in linears:
        want = stacked_weight(model, name, layer, written.meant)
        got = layer.method.dequantize() if layer.method is not None else layer.weight.float()
        # The weight the kernel multiplies by (int4: read back through it) is the one the
        # packer's values give with the kernel's roundings, exactly: int8's bfloat16 scales
        # are the checkpoint's, fp8 and floats are exact; int4's scales and zero offsets are
        # rounded to bfloat16.
        assert torch.equal(got, stacked_weight(model, name, layer, written.on_cpu)), name
        if layer.method is not None and fmt.startswith(("awq", "gptq")):
            # Within 1/64 of a step plus a bfloat16 rounding of the scale of the weight meant;
            # a wrong code or zero is off by a whole step or more.
            step = (want.abs().amax() / 7).item()
            torch.testing.assert_close(got, want, atol=step / 20, rtol=2**-7, msg=name)
        else:
            assert torch.equal(got, want), name
    # Weight bytes held per quantized layer (scales and zeros included) against float32's.
    ratio = 6 if fmt.startswith(("awq", "gptq")) else 3
    for name, layer in linears:
        if layer.method is not None:
            held = sum(
                p.numel() * p.element_size()
                for n, p in layer.named_parameters(recurse=False)
                if n not in ("bias", "perm")
            )
            assert held < 4 * layer.in_features * layer.out_features / ratio, name
