"""The scheduler's side of images, white-box on an in-process scheduler of a tiny Qwen2.5-VL:
an image the model cannot take is refused for its own request only (the rest of the batch
runs), malformed image messages are `ValueError`s, and the encoder cache holds each image's
output in storage of its own (so its byte budget is what it really holds)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from braid.runtime.image_data import ImageData, from_wire, to_wire
from braid.runtime.ipc.to_scheduler import GenerateReq
from braid.runtime.models.config import ModelConfig
from braid.runtime.multimodal.processor import ImageProcessor
from braid.runtime.sampling_params import SamplingParams
from tests.conftest import local_scheduler, run_to_end
from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl, tiny_image

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen"), "2.5")
    tok = AutoTokenizer.from_pretrained(str(path))
    proc = ImageProcessor.from_model_dir(path, ModelConfig.from_dir(path), tok)
    return path, tok, proc


def _request(rid: str, tiny, images: list) -> GenerateReq:
    _, tok, proc = tiny
    text = "look " + proc.placeholder * len(images) + " then answer"
    data = [proc.process(im) for im in images]
    ids, offsets = proc.expand(tok.encode(text, add_special_tokens=False), data)
    wires = [to_wire(d, off) for d, off in zip(data, offsets)]
    return GenerateReq(rid, ids, PARAMS, 0, images=wires)


def test_an_image_the_model_cannot_take_fails_alone(tiny):
    sched = local_scheduler(tiny[0], kv_tokens=2048)
    bad = _request("bad", tiny, [tiny_image(56, 56, 1)])
    # Pixels that do not fit the grid the message claims (a broken client or processor).
    bad.images[0].grid_thw = [1, 2, 6]
    with pytest.raises(ValueError, match=r"images\[0\]: pixel_values .* do not fit grid"):
        sched.handle(bad)
    sched.handle(_request("good", tiny, [tiny_image(56, 84, 2)]))
    sched.handle(GenerateReq("text", [7, 8, 9], PARAMS, 0))
    out = run_to_end(sched)
    assert len(out["good"]) == 4 and len(out["text"]) == 4 and "bad" not in out
    sched.check_invariants()


def test_malformed_image_messages_are_value_errors():
    image = ImageData(torch.zeros(4, 6), num_tokens=1, hash=5, grid_thw=(1, 2, 2))
    wire = to_wire(image, 0)
    wire.shape = [-4, -6]  # the byte count still matches the product
    with pytest.raises(ValueError, match="is not an image's"):
        from_wire(wire)
    wire = to_wire(image, 0)
    wire.grid_thw = [1, 2]
    with pytest.raises(ValueError, match="is not an image's"):
        from_wire(wire)
    wire = to_wire(image, 0)
    wire.data = wire.data[:-4]
    with pytest.raises(ValueError, match="do not fill shape"):
        from_wire(wire)


def test_encoder_cache_entries_own_their_storage(tiny):
    sched = local_scheduler(tiny[0], kv_tokens=2048)
    sched.handle(_request("two", tiny, [tiny_image(56, 56, 3), tiny_image(112, 84, 4)]))
    run_to_end(sched)
    cache = sched.runner.encoder_cache
    assert cache.images_encoded == 2 and len(cache) == 2
    entries = list(cache._entries.values())
    for out in entries:
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    assert cache.nbytes == sum(o.numel() * o.element_size() for o in entries)


def test_a_cache_salt_keeps_images_apart_in_the_encoder_cache(tiny):
    """vLLM's cache_salt: the same image under another salt is encoded again (the encoder
    cache would otherwise answer a tenant faster for another's image), under the same salt
    once, and gives the same tokens either way."""
    sched = local_scheduler(tiny[0], kv_tokens=2048)
    image = tiny_image(56, 56, 7)
    cache = sched.runner.encoder_cache
    outs = {}
    for rid, salt in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("plain", None)):
        req = _request(rid, tiny, [image])
        req.cache_salt = salt
        sched.handle(req)
        outs.update(run_to_end(sched))
    assert cache.images_encoded == 3  # a, b and unsalted: three keys; a's second is a hit
    assert outs["a1"] == outs["b1"] == outs["a2"] == outs["plain"]
    sched.check_invariants()
