"""braid's LLaVA equals transformers': strict loading of both checkpoint layouts, image features
(`encode_images` vs `get_image_features`), whole-prompt logits over the paged KV cache with the
image rows scattered in, and greedy decoding after it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.image_data import ImageData
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from tests.multimodal.tiny_llava import build_tiny_llava, tiny_image

# name -> build_tiny_llava arguments
VARIANTS = {
    "clip-llama": dict(tower="clip", text="llama"),
    "siglip-qwen2": dict(tower="siglip", text="qwen2"),
    "clip-mistral-full": dict(tower="clip", text="mistral", strategy="full"),
    "clip-llama-layers": dict(tower="clip", text="llama", feature_layer=[-2, -1]),
    "siglip-qwen2-layers": dict(tower="siglip", text="qwen2", feature_layer=[0, -2]),
}
LOGITS_VARIANTS = ["clip-llama", "siglip-qwen2", "clip-mistral-full"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {name: build_tiny_llava(root / name, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def hf_models(dirs) -> dict[str, LlavaForConditionalGeneration]:
    return {
        name: LlavaForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
        for name, d in dirs.items()
    }


def _braid(d: Path):
    return build_model(
        ModelConfig.from_dir(d),
        d,
        dtype=torch.float32,
        device=CPU,
        max_positions=512,
        progress=False,
    )


@pytest.fixture(scope="module")
def braid_models(dirs) -> dict:
    return {name: _braid(d) for name, d in dirs.items()}


def _copy_with_keys(src: Path, dst: Path, rename) -> Path:
    """`src` with its checkpoint keys renamed (everything else copied as is)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _hub_key(key: str) -> str:
    # transformers 4 / llava-hf: the vision model's parameters sit under `vision_model.`.
    return key.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _images(n: int) -> list:
    return [tiny_image(40 + 9 * i, 30 + 13 * i, seed=i) for i in range(n)]


def _image_data(proc, model, images) -> list[ImageData]:
    pixels = proc.image_processor(images, return_tensors="pt")["pixel_values"]
    return [ImageData(pixels[i], model.tokens_per_image, hash=i) for i in range(len(images))]


# -- loading -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clip-llama", "siglip-qwen2"])
def test_strict_loader_reads_every_checkpoint_layout_to_the_same_weights(
    dirs, hf_models, braid_models, tmp_path, name
):
    d, hf = dirs[name], hf_models[name]
    stored = load_file(str(d / "model.safetensors"))
    # The unused last vision layer and the final norm are in the checkpoint, but not built.
    assert any(k.startswith("vision_tower.encoder.layers.2.") for k in stored)
    assert any("post_layernorm" in k for k in stored)
    model = braid_models[name]
    assert len(model.vision_tower.encoder.layers) == 2
    hub = _copy_with_keys(d, tmp_path / "hub", _hub_key)
    # The renamed copy is the layout transformers itself reads as the hub one.
    hf_hub = LlavaForConditionalGeneration.from_pretrained(str(hub), dtype=torch.float32)
    for (k, a), (_, b) in zip(hf.state_dict().items(), hf_hub.state_dict().items()):
        assert torch.equal(a, b), k
    modules = tmp_path / "modules"
    hf.save_pretrained(str(modules), save_original_format=False)
    assert any(
        k.startswith("model.language_model.") for k in load_file(str(modules / "model.safetensors"))
    )
    want = model.state_dict()
    for other in (_braid(hub), _braid(modules)):
        got = other.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    # Fused parameters hold transformers' blocks in order.
    attn = hf.model.vision_tower.encoder.layers[1].self_attn
    qkv = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    assert torch.equal(model.vision_tower.encoder.layers[1].self_attn.qkv_proj.bias, qkv)
    lm = hf.model.language_model.layers[0].self_attn
    w = torch.cat([lm.q_proj.weight, lm.k_proj.weight, lm.v_proj.weight])
    assert torch.equal(model.language_model.layers[0].self_attn.qkv_proj.weight, w)
    assert model.lm_head.tied == json.loads((d / "config.json").read_text())["tie_word_embeddings"]
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def test_checkpoint_keys_of_both_layouts_map_to_braid_names(braid_models):
    clip, siglip = braid_models["clip-llama"], braid_models["siglip-qwen2"]
    key = clip.checkpoint_key
    lm = "language_model.layers.0.self_attn.q_proj.weight"
    assert key("language_model.model.layers.0.self_attn.q_proj.weight") == lm
    assert key("model.language_model.layers.0.self_attn.q_proj.weight") == lm
    assert key("language_model.lm_head.weight") == key("lm_head.weight") == "lm_head.weight"
    patch = "vision_tower.embeddings.patch_embedding.weight"
    for k in (patch, "model." + patch, _hub_key(patch), "model." + _hub_key(patch)):
        assert key(k) == patch
    proj = "multi_modal_projector.linear_1.bias"
    assert key(proj) == key("model." + proj) == proj
    layer1 = "vision_tower.encoder.layers.1.mlp.fc1.weight"
    assert key(_hub_key(layer1)) == layer1
    for unused in ("encoder.layers.2.mlp.fc1.weight", "post_layernorm.weight", "head.probe"):
        assert key("vision_tower." + unused) is None
        assert key("model.vision_tower.vision_model." + unused) is None
    # With feature layer -1 the last layer is built, so its keys load.
    layers = braid_models["clip-llama-layers"]
    assert layers.checkpoint_key("vision_tower.encoder.layers.2.mlp.fc1.weight") is not None
    assert siglip.checkpoint_key("vision_tower.encoder.layers.2.mlp.fc1.weight") is None
    # Unknown keys pass through for the strict loader to reject.
    assert key("something.else") == "something.else"


def test_an_image_with_the_wrong_token_count_or_size_is_rejected(dirs, braid_models):
    model = braid_models["clip-llama"]
    proc = AutoProcessor.from_pretrained(str(dirs["clip-llama"]))
    (image,) = _image_data(proc, model, _images(1))
    image.num_tokens += 1
    with pytest.raises(ValueError, match="num_tokens"):
        model.encode_images([image])
    wrong_size = ImageData(torch.zeros(3, 16, 16), model.tokens_per_image, 0)
    with pytest.raises(ValueError, match=r"pixel_values \(3, 16, 16\) are not the tower's input"):
        model.encode_images([wrong_size])
    # The scheduler asks the same check before admission (`check_image`).
    with pytest.raises(ValueError, match="are not the tower's input"):
        model.check_image(wrong_size)


# -- image features ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_image_features_equal_transformers_for_one_and_two_images(
    dirs, hf_models, braid_models, name
):
    hf, model = hf_models[name], braid_models[name]
    proc = AutoProcessor.from_pretrained(str(dirs[name]))
    # The processor's count of image tokens is what the model makes of an image.
    expanded = proc(text=["<image>"], images=_images(1))["input_ids"][0]
    assert expanded.count(model.config.image_token_id) == model.tokens_per_image
    for n in (1, 2):
        data = _image_data(proc, model, _images(n))
        pixels = torch.stack([im.pixel_values for im in data])
        with torch.inference_mode():
            want = hf.get_image_features(pixel_values=pixels).pooler_output
            got = model.encode_images(data)
        assert len(got) == len(want) == n
        for g, w, im in zip(got, want, data):
            assert g.shape == (im.num_tokens, model.config.hidden_size)
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        if n == 2:
            assert (got[0] - got[1]).abs().max() > 1e-2  # different images, different rows


# -- whole prompt --------------------------------------------------------------------------


class _Cache:
    """One request's row and pages in a real KV pool, with the torch_native backend over it."""

    def __init__(self, model, page_size: int = 4, max_len: int = 256) -> None:
        cfg = model.config
        self.pool = KVPool(
            cfg.num_layers,
            max_len // page_size + 1,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            torch.float32,
            CPU,
        )
        self.table = ReqToTokenPool(4, max_len, CPU)
        self.attn = TorchNativeBackend(
            self.pool, self.table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )
        self.table.alloc()  # row 0 stays unused, so the request's row is not the default
        self.row = self.table.alloc()
        alloc = self.pool.allocator
        pages = alloc.alloc(alloc.pages_for(max_len))
        self.slots = torch.tensor([p * page_size + i for p in pages for i in range(page_size)])
        self.table.table[self.row, :max_len] = self.slots[:max_len]
        self.len = 0

    def batch(self, ids: list[int]) -> ForwardBatch:
        """The next forward: the whole prompt first (extend), then one token at a time."""
        n, start = len(ids), self.len
        self.len += n
        mode = ForwardMode.EXTEND if start == 0 else ForwardMode.DECODE
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids),
            positions=torch.arange(start, start + n),
            out_cache_loc=self.slots[start : start + n],
            req_pool_indices=torch.tensor([self.row]),
            seq_lens=torch.tensor([start + n]),
            prefix_lens=[start],
            extend_lens=[n],
            logits_indices=torch.arange(n),
        )
        self.attn.init_forward_metadata(batch)
        return batch


def _prompt(proc, n_images: int) -> str:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "hello world, the dog?"}]
    messages = [{"role": "user", "content": parts}]
    return proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("name", LOGITS_VARIANTS)
def test_prompt_logits_and_greedy_decode_equal_transformers(dirs, hf_models, braid_models, name):
    hf, model = hf_models[name], braid_models[name]
    proc = AutoProcessor.from_pretrained(str(dirs[name]))
    images = _images(2)
    inputs = proc(text=[_prompt(proc, 2)], images=images, return_tensors="pt")
    ids = inputs["input_ids"][0]
    is_image = ids == model.config.image_token_id
    assert int(is_image.sum()) == 2 * model.tokens_per_image
    steps = 3
    with torch.inference_mode():
        out = hf.generate(
            **inputs,
            max_new_tokens=steps + 1,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        want = hf(**inputs).logits[0]

        cache = _Cache(model)
        embeds = model.embed_tokens(ids)
        embeds[is_image] = torch.cat(model.encode_images(_image_data(proc, model, images)))
        got = model(cache.batch(ids.tolist()), cache.attn, input_embeds=embeds)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))

        tokens = [int(got[-1].argmax())]
        step_logits = [got[-1]]
        for _ in range(steps):
            logits = model(cache.batch(tokens[-1:]), cache.attn)
            step_logits.append(logits[0])
            tokens.append(int(logits[0].argmax()))
    assert tokens == out.sequences[0, len(ids) :].tolist()
    for g, w in zip(step_logits, out.logits):
        torch.testing.assert_close(g, w[0], atol=1e-5, rtol=0)
