"""Vision-language serving: Qwen2.5-VL-7B shapes with random bf16 weights on the GPU.

    python benchmarks/multimodal.py             # the H200 run
    python benchmarks/multimodal.py --tiny-cpu  # the same code paths at toy size on the CPU

Two figures, one run:
1. Throughput. N requests, each one random image (448 x 448: 256 image tokens) and 64 random
   text tokens, 64 output tokens (ignore_eos), sent to `braid.LLM` at once. It reports
   requests/s, output tokens/s and the share of the wall time spent in the vision tower (the
   scheduler's `encoder_seconds`, CUDA events), and the front end alone: images/s and the pixel
   bytes per image it sends (the processor's uint8 image), beside the processor's float32
   output and that output in the model's dtype (what braid sent before). After braid's engine
   has shut down, transformers' `generate` runs the same requests at each batch size in
   `hf_batch_sizes` (the same config, random init, bf16, sdpa), and its best throughput is the
   baseline. Target: braid at least 3x.
2. One image, 32 questions. The first question runs alone, then the other 31 together. The
   vision tower must run once (`images_encoded` rises by 1), and every later prompt's image
   tokens must come from the prefix cache (`cached_prompt_tokens` rises by at least 31 x the
   image's tokens).

The model directory is built in a temp dir: config.json from transformers' Qwen2_5_VLConfig,
a small real tokenizer whose special tokens carry the image ids (tests/multimodal/tiny_vlms.py),
and Qwen2-VL's image processor config. braid draws its weights with load_format="dummy".
Writes benchmarks/results/multimodal_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import wait_for_graphs, write_result  # noqa: E402
from tests.multimodal.tiny_vlms import (  # noqa: E402
    build_vlm_tokenizer,
    qwen_image_processor_config,
    tiny_image,
)

TARGET_SPEEDUP = 3.0
TEXT_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
)
VISION_7B = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    hidden_act="silu",
)
TEXT_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
)
VISION_TINY = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
    hidden_act="silu",
)
SIZES = {
    "gpu": dict(
        text=TEXT_7B,
        vision=VISION_7B,
        num_requests=256,
        image_px=448,
        text_len=64,
        output_len=64,
        hf_batch_sizes=[32, 64, 128, 256],
        hf_requests=256,
        questions=32,
        kv_tokens=160_000,
        dtype="bfloat16",
        device="cuda",
    ),
    "tiny": dict(
        text=TEXT_TINY,
        vision=VISION_TINY,
        num_requests=8,
        image_px=56,
        text_len=8,
        output_len=4,
        hf_batch_sizes=[2, 4],
        hf_requests=4,
        questions=4,
        kv_tokens=4096,
        dtype="float32",
        device="cpu",
    ),
}


def build_model_dir(path: Path, size: dict) -> dict[str, int]:
    """config.json, tokenizer and image processor config for the run's shapes; returns the
    tokenizer's special ids."""
    from transformers import Qwen2_5_VLConfig

    ids = build_vlm_tokenizer(path)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(size["text"], bos_token_id=None, eos_token_id=ids["<|im_end|>"]),
        vision_config=size["vision"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        dtype=size["dtype"],
    )
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    cfg.save_pretrained(str(path))
    px = size["image_px"]
    processor = qwen_image_processor_config(56 * 56, px * px)
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return ids


def make_requests(n: int, size: dict, ids: dict[str, int], seed: int) -> list[dict]:
    """n prompts: vision start, one image token (expanded by braid), vision end, then
    `text_len` random text tokens; each with its own random image."""
    rng = random.Random(seed)
    px = size["image_px"]
    out = []
    for i in tqdm(range(n), desc="images", unit="img"):
        text = [rng.randrange(16, 400) for _ in range(size["text_len"])]
        prompt = [ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"], *text]
        out.append(
            {
                "prompt_token_ids": prompt,
                "multi_modal_data": {"image": tiny_image(px, px, seed * 100_000 + i)},
            }
        )
    return out


def run_braid(
    model_dir: Path,
    size: dict,
    requests: list[dict],
    ids: dict[str, int],
    profile: Path | None = None,
    warmup: int = 32,
) -> dict:
    """braid's run; with `profile`, the image run and the text-only run are each recorded by
    the scheduler's torch profiler (`LLM.start_profile`) into `profile/images` and
    `profile/text` (their times then include the profiler's cost)."""
    sp = braid.SamplingParams(max_tokens=size["output_len"], temperature=0.0, ignore_eos=True)
    with braid.LLM(
        model_dir,
        load_format="dummy",
        dtype=size["dtype"],
        kv_tokens=size["kv_tokens"],
        show_progress=False,
    ) as llm:
        wait_for_graphs(llm)
        # Warm-up (kernels, graphs, the tower): one prefill step's worth of requests, so the
        # timed run meets no kernel specialisation it has not seen.
        llm.generate(requests[:warmup], sp, use_tqdm=False)
        llm.flush_cache()
        # The front end alone: load, process and serialise every image (the media workers).
        t0 = time.perf_counter()
        prepared = llm.run_coroutine(prepare_all(llm, requests)).result()
        front_s = time.perf_counter() - t0
        before = llm.stats()
        if profile:
            llm.start_profile(str(profile / "images"))
        t0 = time.perf_counter()
        outs = llm.generate(requests, sp, use_tqdm=True)
        wall = time.perf_counter() - t0
        if profile:
            llm.stop_profile()
        after = llm.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != len(requests) * size["output_len"]:
            raise RuntimeError(
                f"expected {len(requests) * size['output_len']} tokens, got {tokens}"
            )
        image_tokens = outs[0].prompt_token_ids.count(ids["<|image_pad|>"])
        encoder_s = after["encoder_seconds"] - before["encoder_seconds"]
        throughput = {
            "requests": len(requests),
            "image_tokens_per_request": image_tokens,
            "prompt_tokens_per_request": len(outs[0].prompt_token_ids),
            "seconds": wall,
            "requests_per_s": len(requests) / wall,
            "output_tokens_per_s": tokens / wall,
            "images_encoded": after["images_encoded"] - before["images_encoded"],
            "encoder_seconds": encoder_s,
            "encoder_share": encoder_s / wall,
            "front_end_seconds": front_s,
            "front_end_images_per_s": len(requests) / front_s,
            **pixel_bytes(prepared, size["dtype"]),
        }
        for key in ("prefill_steps", "decode_steps", "prefill_tokens_computed", "retractions"):
            throughput[key] = after[key] - before[key]
        same = same_image(llm, size, ids, sp, image_tokens)
        # The same prompt lengths as text only: what the images themselves cost.
        rng = random.Random(3)
        n = len(outs[0].prompt_token_ids)
        text_only = [[rng.randrange(16, 400) for _ in range(n)] for _ in requests]
        llm.flush_cache()
        if profile:
            llm.start_profile(str(profile / "text"))
        t0 = time.perf_counter()
        llm.generate(text_only, sp, use_tqdm=False)
        throughput["text_only_seconds"] = time.perf_counter() - t0
        if profile:
            llm.stop_profile()
        throughput["profiled"] = profile is not None
    return {"throughput": throughput, "same_image": same}


async def prepare_all(llm, requests: list[dict]) -> list:
    """Every request's images as the front end sends them (`ImageInput`s)."""
    import asyncio

    prepared = await asyncio.gather(
        *(
            llm.media.prepare(r["prompt_token_ids"], [r["multi_modal_data"]["image"]])
            for r in requests
        )
    )
    return [image for _, images in prepared for image in images]


def pixel_bytes(images: list, model_dtype: str) -> dict:
    """Bytes per image: the pixels braid sends (the processor's uint8 image), the processor's
    float32 output for it, and that output in the model's dtype (what braid sent before)."""
    from braid.runtime.image_data import from_wire

    sent = sum(len(m.data) for m in images)
    values = sum(math.prod(from_wire(m).shape) for m in images)
    n = len(images)
    return {
        "wire_pixel_dtype": images[0].dtype,
        "wire_bytes_per_image": sent / n,
        "float32_bytes_per_image": 4 * values / n,
        "model_dtype_bytes_per_image": getattr(torch, model_dtype).itemsize * values / n,
    }


def same_image(llm, size: dict, ids: dict[str, int], sp, image_tokens: int) -> dict:
    """One image, `questions` prompts: the first alone, then the rest together."""
    rng = random.Random(7)
    image = tiny_image(size["image_px"], size["image_px"], 999_999)
    head = [ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"]]
    prompts = [
        {
            "prompt_token_ids": head + [rng.randrange(16, 400) for _ in range(size["text_len"])],
            "multi_modal_data": {"image": image},
        }
        for _ in range(size["questions"])
    ]
    llm.flush_cache()
    before = llm.stats()
    llm.generate(prompts[:1], sp, use_tqdm=False)
    outs = llm.generate(prompts[1:], sp, use_tqdm=False)
    after = llm.stats()
    encoded = after["images_encoded"] - before["images_encoded"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    need = (size["questions"] - 1) * image_tokens
    return {
        "questions": size["questions"],
        "images_encoded": encoded,
        "cached_prompt_tokens": cached,
        "cached_needed": need,
        "per_request_cached": [o.num_cached_tokens for o in outs],
        "met": encoded == 1 and cached >= need,
    }


def hf_inputs(processor, batch: list[dict], image_token: int, device: str) -> dict:
    images = [processor.process(r["multi_modal_data"]["image"]) for r in batch]
    rows = []
    for r, im in zip(batch, images):
        ids, _ = processor.expand(r["prompt_token_ids"], [im])
        rows.append(ids)
    x = torch.tensor(rows, device=device)
    return dict(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        pixel_values=torch.cat([im.pixel_values for im in images]).to(device),
        image_grid_thw=torch.tensor([im.grid_thw for im in images], device=device),
        mm_token_type_ids=(x == image_token).int(),
    )


def run_hf(model_dir: Path, size: dict, requests: list[dict], ids: dict[str, int]) -> dict:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from braid.runtime.models.config import ModelConfig
    from braid.runtime.multimodal.processor import ImageProcessor

    device, dtype = size["device"], getattr(torch, size["dtype"])
    processor = ImageProcessor.from_model_dir(
        model_dir, ModelConfig.from_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    )
    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(
            cfg, dtype=dtype, attn_implementation="sdpa"
        ).eval()
    n_out = size["output_len"]

    def generate(batch: list[dict], model=model) -> float:
        x = hf_inputs(processor, batch, ids["<|image_pad|>"], device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **x,
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == x["input_ids"].shape[1] + n_out
        return time.perf_counter() - t0

    generate(requests[:2])  # warm-up
    points = []
    subset = requests[: size["hf_requests"]]
    for bs in size["hf_batch_sizes"]:
        try:
            seconds = sum(
                generate(subset[i : i + bs])
                for i in tqdm(range(0, len(subset), bs), desc=f"hf bs {bs}")
            )
        except torch.OutOfMemoryError:
            points.append({"batch_size": bs, "oom": True})
            break
        points.append(
            {
                "batch_size": bs,
                "requests": len(subset),
                "seconds": seconds,
                "requests_per_s": len(subset) / seconds,
                "output_tokens_per_s": len(subset) * n_out / seconds,
            }
        )
    model = None
    gc.collect()
    ok = [p for p in points if not p.get("oom")]
    best = max(ok, key=lambda p: p["requests_per_s"])
    return {"points": points, "best": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny-cpu", action="store_true", help="toy sizes on the CPU")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="record braid's image and text-only runs with the torch profiler into this dir",
    )
    ap.add_argument("--warmup", type=int, default=32, help="requests run before the timed run")
    args = ap.parse_args()
    size = SIZES["tiny" if args.tiny_cpu else "gpu"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen2.5-vl-7b-shapes"
        model_dir.mkdir()
        ids = build_model_dir(model_dir, size)
        requests = make_requests(size["num_requests"], size, ids, seed=1)
        result = run_braid(model_dir, size, requests, ids, args.profile, args.warmup)
        if size["device"] == "cuda":
            torch.cuda.empty_cache()
        hf = None if args.skip_hf else run_hf(model_dir, size, requests, ids)
    t = result["throughput"]
    print(
        f"braid: {t['requests']} requests in {t['seconds']:.1f} s: "
        f"{t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:.0f} output tok/s; "
        f"vision tower {100 * t['encoder_share']:.1f}% of the wall time "
        f"({t['images_encoded']:.0f} images encoded); the front end alone prepares "
        f"{t['front_end_images_per_s']:.0f} images/s; the same lengths as text only take "
        f"{t['text_only_seconds']:.1f} s"
    )
    print(
        f"pixels per image on the wire: {t['wire_bytes_per_image'] / 1024:.1f} KiB of "
        f"{t['wire_pixel_dtype']} (the processor's float32 output: "
        f"{t['float32_bytes_per_image'] / 1024:.1f} KiB, "
        f"{t['float32_bytes_per_image'] / t['wire_bytes_per_image']:.1f}x; in the model's "
        f"{size['dtype']}: {t['model_dtype_bytes_per_image'] / 1024:.1f} KiB)"
    )
    fields = {**result, "target_speedup": TARGET_SPEEDUP}
    if hf is not None:
        speedup = t["requests_per_s"] / hf["best"]["requests_per_s"]
        fields |= {"transformers": hf, "speedup": speedup, "met": speedup >= TARGET_SPEEDUP}
        print(
            f"transformers best (batch {hf['best']['batch_size']}): "
            f"{hf['best']['requests_per_s']:.2f} req/s -> braid {speedup:.2f}x "
            f"(target {TARGET_SPEEDUP}x: {'met' if speedup >= TARGET_SPEEDUP else 'MISSED'})"
        )
    s = result["same_image"]
    print(
        f"one image, {s['questions']} questions: {s['images_encoded']:.0f} encode(s), "
        f"{s['cached_prompt_tokens']:.0f} prompt tokens from the cache "
        f"(need {s['cached_needed']}): {'met' if s['met'] else 'MISSED'}"
    )
    write_result("multimodal", "cpu" if args.tiny_cpu else "cuda", args.out, fields)


if __name__ == "__main__":
    main()
