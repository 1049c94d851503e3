"""braid's Qwen2-VL / Qwen2.5-VL / Qwen3-VL models against transformers, on tiny random-weight
models (tests/multimodal/tiny_vlms.py): strict loading from both checkpoint layouts,
vision-tower features (Qwen3-VL's DeepStack levels too), M-RoPE positions, whole-prompt logits
through the paged KV cache, and decode."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.image_data import ImageData
from braid.runtime.layers.rotary import RotaryEmbedding, mrope_axes
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl, tiny_image

CPU = torch.device("cpu")
VERSIONS = ["2", "2.5", "3"]
# 112x112 -> 8x8 patches (16 tokens, 4 windows in 2.5); 140x84 -> 6x10 patches (15 tokens,
# 6 windows of unequal sizes). Qwen3-VL's 16-pixel patches: 128x128 and 160x96 alike.
SIZES = [(112, 112), (140, 84)]
QWEN3_SIZES = [(128, 128), (160, 96)]


def _load(cfg: ModelConfig, path: Path):
    return build_model(
        cfg, path, dtype=torch.float32, device=CPU, max_positions=512, progress=False
    )


@dataclass
class VLM:
    path: Path
    cfg: ModelConfig
    model: torch.nn.Module
    hf: torch.nn.Module
    processor: object
    tokenizer: object

    @property
    def sizes(self) -> list[tuple[int, int]]:
        return QWEN3_SIZES if self.qwen3 else SIZES

    @property
    def qwen3(self) -> bool:
        return self.cfg.architecture == "Qwen3VLForConditionalGeneration"

    def image(self, which: int, seed: int) -> ImageData:
        size = self.sizes[which]
        out = self.processor(images=tiny_image(*size, seed=seed), return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        tokens = grid[0] * grid[1] * grid[2] // 4
        return ImageData(out["pixel_values"], tokens, hash=seed, grid_thw=grid)

    def prompt(self, images: list[ImageData]) -> list[int]:
        """Chat prompt: text, image, text, image, text; each <|image_pad|> expanded to its
        image's token count, as transformers' processor does."""
        parts = [{"type": "text", "text": "hello world"}, {"type": "image"}]
        parts += [{"type": "text", "text": " and the quick fox"}, {"type": "image"}]
        parts += [{"type": "text", "text": " tags?"}]
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer(text)["input_ids"]
        return _expand(ids, self.cfg.image_token_id, images)


def _expand(ids: list[int], image_token: int, images: list[ImageData]) -> list[int]:
    out, k = [], 0
    for i in ids:
        if i == image_token:
            out += [image_token] * images[k].num_tokens
            k += 1
        else:
            out.append(i)
    assert k == len(images)
    return out


@pytest.fixture(scope="module", params=VERSIONS)
def vlm(request, tmp_path_factory) -> VLM:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp(f"qwen{request.param}"), request.param)
    cfg = ModelConfig.from_dir(path)
    hf = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    return VLM(
        path=path,
        cfg=cfg,
        model=_load(cfg, path),
        hf=hf,
        processor=AutoImageProcessor.from_pretrained(str(path)),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
    )


def _hf_inputs(vlm: VLM, ids: list[int], images: list[ImageData]) -> dict:
    x = torch.tensor([ids])
    return dict(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        pixel_values=torch.cat([im.pixel_values for im in images]),
        image_grid_thw=torch.tensor([im.grid_thw for im in images]),
        # What transformers' processor adds: 1 on image tokens, 0 on text.
        mm_token_type_ids=(x == vlm.cfg.image_token_id).int(),
    )


# ---------------------------------------------------------------------------------- loading


def _flat_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's nested key layout renamed to the hub's (transformers 4) flat one."""
    out = {}
    for name, t in state.items():
        for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = t
    return out


def _save(tmp_path: Path, name: str, vlm: VLM, tensors: dict[str, torch.Tensor]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text((vlm.path / "config.json").read_text())
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_loads_strictly_from_both_checkpoint_layouts(vlm, tmp_path):
    saved_file = safe_open(str(vlm.path / "model.safetensors"), framework="pt")
    saved = {k: saved_file.get_tensor(k) for k in saved_file.keys()}
    nested = any(k.startswith(("model.language_model.", "model.visual.")) for k in saved)
    # transformers 5's save_pretrained writes the hub layout each family was published in:
    # flat (`visual.`, `model.layers.`) for Qwen2-VL and Qwen2.5-VL, nested for Qwen3-VL.
    assert nested == vlm.qwen3
    assert nested != any(k.startswith("visual.") for k in saved)
    flat = _flat_layout(saved)
    ours = dict(vlm.model.named_parameters())
    conv = flat["visual.patch_embed.proj.weight"]
    assert conv.dim() == 5
    torch.testing.assert_close(ours["visual.patch_embed.proj.weight"], conv.flatten(1))
    if vlm.qwen3:
        # Qwen3: q/k norms, no QKV bias; the blocks' MLP keys are renamed.
        assert "model.layers.1.self_attn.qkv_proj.bias" not in ours
        torch.testing.assert_close(
            ours["model.layers.1.self_attn.q_norm.weight"],
            flat["model.layers.1.self_attn.q_norm.weight"],
        )
        torch.testing.assert_close(
            ours["visual.blocks.1.mlp.fc1.weight"], flat["visual.blocks.1.mlp.linear_fc1.weight"]
        )
    else:
        q, k = (flat[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qk")
        torch.testing.assert_close(
            ours["model.layers.1.self_attn.qkv_proj.bias"][: len(q) + len(k)], torch.cat((q, k))
        )

    # The in-memory state dict names the nested layout; the same weights in the layout not
    # on disk load to the same parameters.
    state = {n: t.detach().clone().contiguous() for n, t in vlm.hf.state_dict().items()}
    assert any(n.startswith("model.language_model.layers.") for n in state)
    assert any(n.startswith("model.visual.blocks.") for n in state)
    other = _flat_layout(state) if nested else state
    reloaded = dict(_load(vlm.cfg, _save(tmp_path, "other", vlm, other)).named_parameters())
    assert reloaded.keys() == ours.keys()
    for name, p in ours.items():
        assert torch.equal(reloaded[name], p), name

    # Strict: a key nothing consumes, or a parameter nothing fills, is an error.
    extra = {**state, "model.visual.blocks.0.attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="no parameter consumes"):
        _load(vlm.cfg, _save(tmp_path, "extra", vlm, extra))
    last = "merger.linear_fc2.bias" if vlm.qwen3 else "merger.mlp.2.bias"
    dropped = {n: t for n, t in state.items() if not n.endswith("visual." + last)}
    assert len(dropped) == len(state) - 1
    missing = _save(tmp_path, "missing", vlm, dropped)
    with pytest.raises(ValueError, match="did not fill"):
        _load(vlm.cfg, missing)


def test_config_reads_the_tower_shape(vlm):
    raw = json.loads((vlm.path / "config.json").read_text())
    spec = vlm.model.vision_spec
    assert spec.windowed == (vlm.cfg.architecture == "Qwen2_5_VLForConditionalGeneration")
    assert spec.depth == raw["vision_config"]["depth"] == 2
    assert spec.out_dim == vlm.cfg.hidden_size
    patch = 16 if vlm.qwen3 else 14
    assert spec.patch_dim == 3 * 2 * patch * patch
    assert spec.deepstack_layers == ((0, 1) if vlm.qwen3 else ())


# ----------------------------------------------------------------------------- vision tower


def test_encode_images_matches_transformers_one_and_two_images(vlm):
    one = [vlm.image(0, seed=0)]
    two = [vlm.image(0, seed=0), vlm.image(1, seed=1)]
    same = [vlm.image(1, seed=2), vlm.image(1, seed=3)]  # one size: frames are equal runs
    assert two[0].grid_thw != two[1].grid_thw
    with torch.inference_mode():
        got_one = vlm.model.encode_images(one)
        got_two = vlm.model.encode_images(two)
        got_same = vlm.model.encode_images(same)
        for images, got in ((one, got_one), (two, got_two), (same, got_same)):
            x = _hf_inputs(vlm, [0], images)
            ref = vlm.hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"])
            assert len(got) == len(ref.pooler_output) == len(images)
            hidden = vlm.cfg.hidden_size
            levels = vlm.model.vision_spec.deepstack_layers
            for k, (im, g, r) in enumerate(zip(images, got, ref.pooler_output)):
                assert g.shape == (im.num_tokens, hidden * (1 + len(levels)))
                assert g.dtype == torch.float32
                torch.testing.assert_close(g[:, :hidden], r, atol=1e-5, rtol=0)
                for level in range(len(levels)):
                    # Qwen3-VL: each DeepStack level's features follow, side by side.
                    want = ref.deepstack_features[level][k]
                    got_level = g[:, hidden * (level + 1) : hidden * (level + 2)]
                    torch.testing.assert_close(got_level, want, atol=1e-5, rtol=0)
    # One batched pass: the first image's features do not depend on the second image.
    torch.testing.assert_close(got_two[0], got_one[0], atol=1e-6, rtol=0)


def test_widening_the_gated_mlp_with_zero_weights_keeps_its_output(vlm):
    """What CUDA does to Qwen2.5-VL's MLPs (an intermediate size of 60 here, 3420 in the 7B),
    done on the CPU: padded to a multiple of 64 with zero weights, the output is the same."""
    import copy

    gated = [m for m in vlm.model.modules() if type(m).__name__ == "VisionGatedMLP"]
    if vlm.cfg.architecture != "Qwen2_5_VLForConditionalGeneration":
        assert not gated
        return
    mlp = copy.deepcopy(gated[0])
    x = torch.randn(7, mlp.gate_up_proj.in_features, generator=torch.Generator().manual_seed(0))
    want = mlp(x)
    mlp.widen(64)
    assert (mlp.down_proj.in_features, mlp.gate_up_proj.out_features) == (64, 128)
    torch.testing.assert_close(mlp(x), want, rtol=0, atol=1e-6)
    gu = mlp.gate_up_proj
    for pad in (slice(60, 64), slice(124, 128)):  # gate's padding, then up's
        assert not gu.weight[pad].any() and not gu.bias[pad].any()
    assert not mlp.down_proj.weight[:, 60:].any()
    mlp.widen(64)  # already a multiple: nothing changes
    assert mlp.down_proj.weight.shape[1] == 64


def test_window_partition_is_nontrivial_and_matches_transformers(vlm):
    images = [vlm.image(0, seed=0), vlm.image(1, seed=1)]
    grids = [im.grid_thw for im in images]
    layout = vlm.model.visual.layout(grids)
    if not vlm.model.vision_spec.windowed:
        # Qwen2-VL attends over whole images: one segment per image, no windows.
        assert layout.windows is None and layout.frames.num_segments == 2
        return
    from transformers.vision_utils import get_vision_window_index

    spec = vlm.model.vision_spec
    window_index, cu = get_vision_window_index(
        torch.tensor(grids), spec.merge_size, spec.window_size, spec.patch_size
    )
    assert layout.frames.num_segments == 2
    assert layout.windows.num_segments == len(cu) - 1 == 4 + 6
    # The blocks run the patches in transformers' window order, window by window.
    unit = spec.merge_size**2
    assert (layout.order[::unit] // unit).tolist() == window_index.tolist()
    assert (layout.order.view(-1, unit) % unit).eq(torch.arange(unit)).all()
    assert layout.windows.sizes() == (cu[1:] - cu[:-1]).tolist()
    assert max(layout.windows.sizes()) < min(layout.frames.sizes())
    # Unequal windows and frames attend through gathers; one image's equal windows are runs.
    assert not layout.windows.runs and not layout.frames.runs
    alone = vlm.model.visual.layout(grids[:1] * 2)
    assert alone.windows.runs and alone.frames.runs and alone.windows.index is None
    merged = torch.arange(layout.order.shape[0] // unit)
    assert layout.restore(merged[window_index]).tolist() == merged.tolist()


def test_encode_images_rejects_pixels_that_do_not_fit_the_grid(vlm):
    im = vlm.image(0, seed=0)
    bad = ImageData(im.pixel_values[:-4], im.num_tokens, hash=0, grid_thw=im.grid_thw)
    with pytest.raises(ValueError, match="do not fit grid"):
        vlm.model.encode_images([bad])


# ---------------------------------------------------------------------------------- M-RoPE


def test_mrope_rotary_rows_follow_each_columns_axis():
    assert mrope_axes((2, 3, 3), 16).tolist() == [0, 0, 1, 1, 1, 2, 2, 2] * 2
    # Qwen3-VL interleaves: t h w t h w, then the height axis has its third frequency (8
    # columns < 3 * 3) and the width axis, whose third would be column 8, has run out.
    assert mrope_axes((2, 3, 3), 16, interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2
    # Qwen3-VL-8B's split: heights at 1, 4 .. 58, widths at 2, 5 .. 59, then temporal.
    big = mrope_axes((24, 20, 20), 128, interleaved=True)[:64].tolist()
    assert big[:60] == [0, 1, 2] * 20 and big[60:] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="add up to"):
        mrope_axes((2, 3, 4), 16)
    rot = RotaryEmbedding(16, 64, 10000.0, None, torch.float32)
    axes = mrope_axes((2, 3, 3), 16)
    # Equal positions on the three axes: exactly the 1-D rows (text tokens, decode).
    pos = torch.tensor([0, 5, 63])
    cos, sin = rot.lookup_mrope(pos.expand(3, -1), axes)
    cos1, sin1 = rot.lookup(pos)
    assert cos.shape == (3, 1, 16) and torch.equal(cos, cos1) and torch.equal(sin, sin1)
    # Distinct positions: column j rotates by the position of its axis.
    pos3 = torch.tensor([[1, 7], [2, 8], [3, 9]])
    cos, sin = rot.lookup_mrope(pos3, axes)
    for t in range(2):
        for j, axis in enumerate(axes.tolist()):
            assert cos[t, 0, j] == rot.cos[pos3[axis, t], j]
            assert sin[t, 0, j] == rot.sin[pos3[axis, t], j]


def _raw_prompt(vlm: VLM, images: list[ImageData]) -> list[int]:
    """Starts with an image and has the second right after the first image's end token."""
    raw = vlm.cfg.raw
    start, end, pad = (
        raw["vision_start_token_id"],
        raw["vision_end_token_id"],
        raw["image_token_id"],
    )
    ids = [start, pad, end, start, pad, end] + vlm.tokenizer("done")["input_ids"]
    return _expand(ids, pad, images)


@pytest.mark.parametrize("layout", ["chat", "raw"])
def test_mrope_positions_match_get_rope_index(vlm, layout):
    images = [vlm.image(0, seed=0), vlm.image(1, seed=1)]
    ids = vlm.prompt(images) if layout == "chat" else _raw_prompt(vlm, images)
    positions, delta = vlm.model.mrope_positions(vlm.cfg, ids, images)
    x = _hf_inputs(vlm, ids, images)
    ref, ref_delta = vlm.hf.model.get_rope_index(
        x["input_ids"], x["mm_token_type_ids"], image_grid_thw=x["image_grid_thw"]
    )
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref[:, 0])
    assert delta == int(ref_delta) and delta < 0  # images compress the positions


def test_mrope_positions_reject_a_token_count_mismatch(vlm):
    images = [vlm.image(0, seed=0), vlm.image(1, seed=1)]
    ids = vlm.prompt(images)
    with pytest.raises(ValueError, match="image tokens"):
        vlm.model.mrope_positions(vlm.cfg, ids[:-20] + ids[-19:], images)


# ------------------------------------------------------------------- logits through the cache


class _OneRequest:
    """One request's extend and decode forwards over a real paged KV pool (page size 1)."""

    def __init__(self, cfg: ModelConfig, model, device: torch.device, backend: type) -> None:
        self.device = device
        slots = 256
        self.pool = KVPool(
            cfg.num_layers, slots, 1, cfg.num_kv_heads, cfg.head_dim, model.dtype, device
        )
        self.table = ReqToTokenPool(2, slots, device)
        self.attn = backend(self.pool, self.table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.row = self.table.alloc()
        self.length = 0

    def _batch(self, mode: ForwardMode, ids: list[int], positions: torch.Tensor) -> ForwardBatch:
        n, dev = len(ids), self.device
        # Slot 0 is the padding page: the request's token i lives in slot i + 1.
        locs = torch.arange(self.length + 1, self.length + n + 1, device=dev)
        self.table.table[self.row, self.length : self.length + n] = locs
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, device=dev),
            positions=positions.to(dev),
            out_cache_loc=locs,
            req_pool_indices=torch.tensor([self.row], device=dev),
            seq_lens=torch.tensor([self.length + n], device=dev),
            prefix_lens=[self.length],
            extend_lens=[n],
            logits_indices=torch.arange(n, device=dev),
        )
        self.length += n
        return batch

    def extend(self, model, ids: list[int], embeds, mrope: torch.Tensor, **kw) -> torch.Tensor:
        batch = self._batch(ForwardMode.EXTEND, ids, mrope[0].clone())
        batch.mrope_positions = mrope.to(self.device)
        self.attn.init_forward_metadata(batch)
        return model(batch, self.attn, input_embeds=embeds, **kw)

    def decode(self, model, token: int, position: int) -> torch.Tensor:
        batch = self._batch(ForwardMode.DECODE, [token], torch.tensor([position]))
        self.attn.init_forward_metadata(batch)
        return model(batch, self.attn)[0]


@dataclass
class _Run:
    features: list[torch.Tensor]
    prompt_logits: torch.Tensor  # [prompt, vocab]
    step_logits: torch.Tensor  # [steps, vocab]
    tokens: list[int]  # the greedy token after the prompt and after each step


def _greedy(model, cfg, ids, images, device, backend=TorchNativeBackend, steps=2) -> _Run:
    """The runtime's path: embed the prompt, put the image embeddings in its image rows
    (Qwen3-VL: pass its DeepStack levels for those rows), extend with M-RoPE positions, then
    decode greedily with 1-D positions shifted by the rope delta."""
    mrope, delta = model.mrope_positions(cfg, ids, images)
    ids_t = torch.tensor(ids, device=device)
    req = _OneRequest(cfg, model, device, backend)
    with torch.inference_mode():
        features = model.encode_images(images)
        embeds = model.embed_tokens(ids_t)
        is_image = ids_t == cfg.image_token_id
        stacked = torch.cat(features)
        embeds[is_image] = stacked[:, : cfg.hidden_size]
        kw = {}
        if stacked.shape[1] > cfg.hidden_size:
            levels = list(stacked[:, cfg.hidden_size :].split(cfg.hidden_size, dim=1))
            kw["deepstack"] = (is_image.nonzero().flatten(), levels)
        logits = req.extend(model, ids, embeds, mrope, **kw)
        tokens, step_logits = [int(logits[-1].argmax())], []
        for _ in range(steps):
            out = req.decode(model, tokens[-1], position=req.length + delta)
            step_logits.append(out)
            tokens.append(int(out.argmax()))
    return _Run(features, logits, torch.stack(step_logits), tokens)


def test_prompt_logits_and_greedy_decode_match_transformers(vlm):
    cfg = vlm.cfg
    images = [vlm.image(0, seed=0), vlm.image(1, seed=1)]
    ids = vlm.prompt(images)
    run = _greedy(vlm.model, cfg, ids, images, CPU)
    x = _hf_inputs(vlm, ids, images)
    with torch.inference_mode():
        ref = vlm.hf(**x).logits[0]
        hf_tokens = vlm.hf.generate(
            **x, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
        # transformers over the prompt and the first two generated tokens: its last two rows
        # are the decode steps' logits.
        ref_steps = vlm.hf(**_hf_inputs(vlm, ids + run.tokens[:2], images)).logits[0, -2:]
    logits = run.prompt_logits
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), cfg.vocab_size)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    assert run.tokens == hf_tokens
    torch.testing.assert_close(run.step_logits, ref_steps, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_cuda_model_matches_the_cpu_model(vlm, backend):
    """On CUDA the norms, the rotary (M-RoPE rows too, through either backend) and batch-1
    decode take Triton kernels."""
    from braid.runtime.attention.triton_backend import TritonBackend

    cuda = torch.device("cuda")
    model = build_model(
        vlm.cfg, vlm.path, dtype=torch.float32, device=cuda, max_positions=512, progress=False
    )
    # Qwen2.5-VL's gated MLPs (intermediate size 60 here) are widened to 64 with zero weights.
    gated = [m for m in model.modules() if type(m).__name__ == "VisionGatedMLP"]
    assert all(m.down_proj.in_features == 64 for m in gated)
    assert bool(gated) == (vlm.cfg.architecture == "Qwen2_5_VLForConditionalGeneration")
    images = [vlm.image(0, seed=0), vlm.image(1, seed=1)]
    ids = vlm.prompt(images)
    cls = TritonBackend if backend == "triton" else TorchNativeBackend
    got = _greedy(model, vlm.cfg, ids, images, cuda, cls)
    want = _greedy(vlm.model, vlm.cfg, ids, images, CPU)
    # Triton's float32 dots may round through TF32.
    tol = 2e-3 if backend == "triton" else 1e-4
    for g, w in zip(got.features, want.features):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.prompt_logits.cpu(), want.prompt_logits, atol=tol, rtol=0)
    torch.testing.assert_close(got.step_logits.cpu(), want.step_logits, atol=tol, rtol=0)
    assert got.tokens == want.tokens
