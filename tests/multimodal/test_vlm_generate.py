"""Vision-language models end to end through `braid.LLM` (the scheduler, the encoder cache, the
prefix cache, chunked prefill): greedy float32 tokens equal transformers' `generate` for tiny
random Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA models, with 1 and 2 images of different sizes
per prompt, alone and batched with text-only prompts, on a prefix-cache hit and with chunked
prefill cutting through an image; a different image never reuses another's KV; bad images are
refused with a clear error and the engine keeps serving."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

import braid
from braid.runtime.models.config import ModelConfig
from braid.runtime.multimodal.processor import ImageProcessor
from tests.multimodal.tiny_llava import build_tiny_llava
from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl, tiny_image

NEW = 8
GREEDY = braid.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@dataclass
class Reference:
    """transformers' side: the model, and braid's processor to expand prompts the way
    transformers' processor does (tests/multimodal/test_processor.py holds that equality)."""

    path: Path
    hf: object
    processor: ImageProcessor
    tokenizer: object
    qwen: bool

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def greedy(self, text: str, images: list, new: int = NEW) -> list[int]:
        data = [self.processor.process(im) for im in images]
        ids, _ = self.processor.expand(self.ids(text), data)
        x = torch.tensor([ids])
        kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x))
        if data and self.qwen:
            kwargs["pixel_values"] = torch.cat([d.pixel_values for d in data])
            kwargs["image_grid_thw"] = torch.tensor([d.grid_thw for d in data])
            # As transformers' processor marks them; without it transformers drops M-RoPE.
            kwargs["mm_token_type_ids"] = (x == self.processor.image_token_id).int()
        elif data:
            kwargs["pixel_values"] = torch.stack([d.pixel_values for d in data])
        with torch.inference_mode():
            out = self.hf.generate(
                **kwargs, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return out[0, len(ids) :].tolist()


def _reference(path: Path, qwen: bool) -> Reference:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    proc = ImageProcessor.from_model_dir(path, ModelConfig.from_dir(path), tok)
    return Reference(path, hf, proc, tok, qwen)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Reference:
    return _reference(build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen25"), "2.5"), qwen=True)


@pytest.fixture(scope="module")
def qwen_llm(qwen):
    with braid.LLM(qwen.path, kv_tokens=4096, page_size=4, show_progress=False) as llm:
        yield llm


def _prompt(llm, text_parts: list[str]) -> str:
    """The texts joined by the model's image placeholder (one image between two texts)."""
    return llm.media.placeholder.join(text_parts)


def _run(llm, prompts: list[tuple[str, list]]) -> list[list[int]]:
    items = [
        {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        for text, images in prompts
    ]
    return [o.outputs[0].token_ids for o in llm.generate(items, GREEDY, use_tqdm=False)]


def _assert_alone_and_batched_match(ref: Reference, llm, prompts: list[tuple[str, list]]) -> None:
    """Each prompt alone and all of them in one batch give transformers' greedy tokens."""
    expected = [ref.greedy(t, ims) for t, ims in prompts]
    alone = [_run(llm, [p])[0] for p in prompts]
    batched = _run(llm, prompts)
    llm.check_invariants()
    assert alone == expected
    assert batched == expected


def test_qwen_images_match_transformers_alone_and_batched_with_text(qwen, qwen_llm):
    ph = qwen_llm.media.placeholder
    one = (f"describe {ph} briefly", [tiny_image(112, 84, 1)])
    two = (f"compare {ph} and {ph} now", [tiny_image(56, 56, 2), tiny_image(140, 112, 3)])
    text = ("a plain question about JSON", [])
    _assert_alone_and_batched_match(qwen, qwen_llm, [one, two, text])


def test_qwen2_vl_images_match_transformers_alone_and_batched(tmp_path):
    ref = _reference(build_tiny_qwen2_vl(tmp_path / "qwen2", "2"), qwen=True)
    with braid.LLM(ref.path, kv_tokens=2048, show_progress=False) as llm:
        ph = llm.media.placeholder
        one = (f"describe {ph} briefly", [tiny_image(84, 112, 1)])
        two = (f"{ph} versus {ph}", [tiny_image(56, 56, 2), tiny_image(112, 84, 3)])
        plain = ("a plain question", [])
        _assert_alone_and_batched_match(ref, llm, [one, two, plain])


def test_qwen3_vl_matches_transformers_chunked_batched_and_from_the_prefix_cache(tmp_path):
    """Qwen3-VL's DeepStack features join the first language layers at the image rows: with
    chunks of 16 tokens the 20-token image is cut in two, and each chunk must get its rows'
    slice of every level."""
    ref = _reference(build_tiny_qwen2_vl(tmp_path / "qwen3", "3"), qwen=True)
    with braid.LLM(
        ref.path, kv_tokens=2048, chunked_prefill_size=16, page_size=4, show_progress=False
    ) as llm:
        ph = llm.media.placeholder
        one = (f"describe {ph} briefly", [tiny_image(128, 96, 1)])
        two = (f"{ph} versus {ph}", [tiny_image(64, 64, 2), tiny_image(160, 128, 3)])
        plain = ("a plain question", [])
        _assert_alone_and_batched_match(ref, llm, [one, two, plain])
        stats = llm.stats()
        again = llm.generate(
            [{"prompt": two[0], "multi_modal_data": {"image": two[1]}}], GREEDY, use_tqdm=False
        )[0]
        llm.check_invariants()
    assert 20 in [ref.processor.process(im).num_tokens for im in two[1]]
    assert stats["images_encoded"] == 3  # each image once: alone, batched and chunked
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 4
    assert again.outputs[0].token_ids == ref.greedy(*two)


def test_same_image_hits_the_prefix_cache_and_a_different_image_does_not(qwen, qwen_llm):
    qwen_llm.flush_cache()
    ph = qwen_llm.media.placeholder
    text = f"the same long opening words, then {ph} and a question"
    first, other = tiny_image(84, 84, 10), tiny_image(84, 84, 11)
    before = qwen_llm.stats()
    outs = qwen_llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": first}}], GREEDY, use_tqdm=False
    )
    again = qwen_llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": first}}], GREEDY, use_tqdm=False
    )
    changed = qwen_llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": other}}], GREEDY, use_tqdm=False
    )
    after = qwen_llm.stats()
    prompt_len = len(outs[0].prompt_token_ids)
    image_start = outs[0].prompt_token_ids.index(qwen.processor.image_token_id)
    # The repeat reuses the whole prompt but its last token's page; the other image reuses
    # at most the text before the image.
    assert again[0].num_cached_tokens >= prompt_len - 4
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert changed[0].num_cached_tokens <= image_start
    assert changed[0].outputs[0].token_ids == qwen.greedy(text, [other])
    assert outs[0].outputs[0].token_ids == qwen.greedy(text, [first])
    # Two distinct images, each through the tower once.
    assert after["images_encoded"] - before["images_encoded"] == 2
    qwen_llm.check_invariants()


def test_one_image_many_questions_encodes_once_and_reuses_its_kv(qwen_llm):
    qwen_llm.flush_cache()
    image = tiny_image(112, 112, 20)
    ph = qwen_llm.media.placeholder
    before = qwen_llm.stats()
    first = _run(qwen_llm, [(f"{ph} question 0", [image])])
    prompts = [(f"{ph} question {i}", [image]) for i in range(1, 5)]
    outs = qwen_llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts],
        GREEDY,
        use_tqdm=False,
    )
    after = qwen_llm.stats()
    assert first and all(len(o.outputs[0].token_ids) == NEW for o in outs)
    assert after["images_encoded"] - before["images_encoded"] == 1
    image_tokens = outs[0].prompt_token_ids.count(qwen_llm.media.processor.image_token_id)
    assert all(o.num_cached_tokens >= image_tokens for o in outs)


def test_chunked_prefill_through_an_image_matches_transformers(qwen):
    image = tiny_image(140, 112, 30)
    text = f"chunks cut through {qwen.processor.placeholder} here"
    expected = qwen.greedy(text, [image])
    with braid.LLM(qwen.path, kv_tokens=2048, chunked_prefill_size=8, show_progress=False) as llm:
        got = _run(llm, [(text, [image])])[0]
        stats = llm.stats()
        llm.check_invariants()
    assert stats["prefill_steps"] >= 3  # the image's tokens span several chunks
    assert stats["images_encoded"] == 1  # later chunks read the encoder cache
    assert got == expected


@pytest.mark.parametrize("tower,text", [("clip", "llama"), ("siglip", "qwen2")])
def test_llava_images_match_transformers_alone_and_batched(tmp_path, tower, text):
    ref = _reference(build_tiny_llava(tmp_path / "llava", tower, text), qwen=False)
    with braid.LLM(ref.path, kv_tokens=2048, show_progress=False) as llm:
        ph = llm.media.placeholder
        one = (f"USER: {ph}\nwhat is it?", [tiny_image(40, 30, 1)])
        two = (f"USER: {ph} and {ph}\nsame?", [tiny_image(64, 64, 2), tiny_image(20, 50, 3)])
        plain = ("USER: no image here", [])
        _assert_alone_and_batched_match(ref, llm, [one, two, plain])


def test_chat_with_image_parts_equals_the_rendered_prompt(qwen_llm):
    image = tiny_image(56, 84, 40)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": buf.getvalue()}, {"type": "text", "text": "hi"}],
        }
    ]
    chat = qwen_llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    text = qwen_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": qwen_llm.media.placeholder + "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat.outputs[0].token_ids == _run(qwen_llm, [(text, [image])])[0]


def test_offline_images_by_path_are_the_callers_files(qwen_llm, tmp_path):
    """`LLM.generate` reads the caller's image files by path (a string or a `Path`), as the
    docs show, with the same tokens as the image itself."""
    image = tiny_image(32, 32, 3)
    image.save(tmp_path / "cat.png")
    ph = qwen_llm.media.placeholder
    want = _run(qwen_llm, [(f"{ph} what is it?", [image])])
    for source in (str(tmp_path / "cat.png"), tmp_path / "cat.png"):
        assert _run(qwen_llm, [(f"{ph} what is it?", [source])]) == want


def test_bad_images_are_refused_and_the_engine_keeps_serving(qwen_llm):
    ph = qwen_llm.media.placeholder
    png = io.BytesIO()
    tiny_image(32, 32, 0).save(png, format="PNG")
    with Image.open(io.BytesIO(png.getvalue())) as closed:
        pass  # closed before its pixels were read
    cases = [
        (b"not an image at all", ph, "not an image"),
        (png.getvalue()[:60], ph, "truncated"),
        ("data:image/png;base64,@@@", ph, "base64"),
        ("/etc/passwd", ph, "not an image"),  # the offline caller's files are read
        ("/no/such/image.png", ph, "does not exist"),
        ("/no/such_dir/image", ph, "image file '/no/such_dir/image' does not exist"),
        (closed, ph, "the PIL image was closed before it was loaded"),
    ]
    for source, text, words in cases:
        with pytest.raises(ValueError, match=f"(?i){words}"):
            qwen_llm.generate(
                [{"prompt": text, "multi_modal_data": {"image": source}}], GREEDY, use_tqdm=False
            )
    with pytest.raises(ValueError, match="placeholder"):
        qwen_llm.generate(
            [{"prompt": "no placeholder", "multi_modal_data": {"image": tiny_image(8, 8, 1)}}],
            GREEDY,
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="no images were given"):
        qwen_llm.generate([f"a placeholder typed by hand {ph}"], GREEDY, use_tqdm=False)
    many = [tiny_image(8, 8, i) for i in range(9)]
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        qwen_llm.generate(
            [{"prompt": ph * 9, "multi_modal_data": {"image": many}}], GREEDY, use_tqdm=False
        )
    with pytest.raises(ValueError, match="multi_modal_data"):
        qwen_llm.generate([{"prompt": ph, "multi_modal_data": {"video": []}}], use_tqdm=False)
    # A cut could split an image's tokens: refused whatever the prompt's length before them.
    with pytest.raises(ValueError, match="truncate_prompt_tokens: not with images"):
        qwen_llm.generate(
            [{"prompt": f"{ph} short", "multi_modal_data": {"image": tiny_image(8, 8, 1)}}],
            GREEDY.replace(truncate_prompt_tokens=100),
            use_tqdm=False,
        )
    ok = _run(qwen_llm, [(f"{ph} still fine", [tiny_image(28, 28, 5)])])
    assert len(ok[0]) == NEW
    qwen_llm.check_invariants()


def test_images_on_a_text_only_model_are_refused(smollm2):
    with pytest.raises(ValueError, match="takes text only"):
        smollm2.generate(
            [{"prompt": "x", "multi_modal_data": {"image": tiny_image(8, 8, 1)}}], use_tqdm=False
        )
    with pytest.raises(ValueError, match="takes text only"):
        smollm2.chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            use_tqdm=False,
        )


def test_retracted_image_requests_resume_without_re_encoding(qwen):
    """A KV pool too small for every request's output (any two requests' outputs overflow it,
    however their images' requests trickle in): the scheduler retracts some and resumes them
    later; their images come back from the encoder cache, and the tokens still equal
    transformers'."""
    ph = qwen.processor.placeholder
    prompts = [
        (f"request {i} {ph} goes on", [tiny_image(56 + 28 * i, 56, 50 + i)]) for i in range(4)
    ]
    long = braid.SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    with braid.LLM(qwen.path, kv_tokens=192, show_progress=False) as llm:
        items = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts]
        outs = llm.generate(items, long, use_tqdm=False)
        stats = llm.stats()
        llm.check_invariants()
    assert stats["retractions"] >= 1
    assert stats["images_encoded"] == 4  # each image once, retractions included
    for (text, ims), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == qwen.greedy(text, ims, new=100)


def test_one_lazily_decoded_pil_image_shared_by_many_prompts(qwen_llm):
    """Many prompts given the same not-yet-decoded PIL image (one image, many questions): the
    media threads must not decode it at once (PIL's load() is not thread-safe)."""
    from PIL import Image

    png = io.BytesIO()
    tiny_image(84, 84, 60).save(png, format="PNG")
    lazy = Image.open(io.BytesIO(png.getvalue()))
    ph = qwen_llm.media.placeholder
    prompts = [(f"{ph} question {i}", [lazy]) for i in range(8)]
    got = _run(qwen_llm, prompts)
    decoded = Image.open(io.BytesIO(png.getvalue())).convert("RGB")
    assert got[0] == _run(qwen_llm, [(prompts[0][0], [decoded])])[0]
    assert got[7] == _run(qwen_llm, [(prompts[7][0], [decoded])])[0]
    assert all(len(t) == NEW for t in got)
