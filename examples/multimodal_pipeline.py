"""A multimodal pipeline: for each image of a batch, a caption, a `select` of a category, a
JSON-schema-constrained record, then two forked questions about the same image.

    python examples/multimodal_pipeline.py                 # a tiny random Qwen2.5-VL on the CPU
    python examples/multimodal_pipeline.py --model DIR     # a real vision-language model

With no --model it builds a tiny random-weight Qwen2.5-VL (the test suite's builder), so the
output is noise; the pipeline, the constraint and the image handling are real. Each image goes
through the vision tower once: the forks after it share its KV through the prefix cache, and
the printed counters show it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import braid

RECORD = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 12},
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer"},
    },
    "required": ["label", "size", "count"],
}
CATEGORIES = ["animal", "landscape", "object", "person"]


@braid.function
def inspect_image(s, image):
    s += braid.system("You describe images briefly.")
    s += braid.user(braid.image(image) + "Describe the picture in one line.")
    s += braid.assistant(braid.gen("caption", max_tokens=16))
    s += braid.user("Which category fits it best?")
    s += braid.assistant(braid.select("category", choices=CATEGORIES))
    s += braid.user("Give a JSON record of the main thing in it.")
    s += braid.assistant(braid.gen("record", max_tokens=48, json_schema=json.dumps(RECORD)))
    # Two questions of the same image: the forks share the prompt's KV (image included).
    forks = s.fork(2)
    for f, question in zip(forks, ["What colour dominates?", "Is it indoors?"]):
        f += braid.user(question)
        f += braid.assistant(braid.gen("answer", max_tokens=12))
    forks.join()


def tiny_model(root: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(root / "tiny-qwen2.5-vl", "2.5")


def images(n: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(112, 84), (84, 112), (56, 56), (140, 112)]
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")
        for w, h in (sizes[i % len(sizes)] for i in range(n))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a vision-language model directory")
    parser.add_argument("--images", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp))
        with braid.Engine(model, kv_tokens=8192, show_progress=False) as engine:
            braid.set_default_backend(engine)
            batch = [{"image": im} for im in images(args.images)]
            states = inspect_image.run_batch(batch, temperature=0)
            for i, state in enumerate(states):
                print(f"image {i}:")
                print(f"  caption:  {state['caption']!r}")
                print(f"  category: {state['category']}")
                print(f"  record:   {state['record']!r}")
                print(f"  answers:  {[a for a in state['answer']]!r}")
            stats = engine.stats()
            print(
                f"vision tower runs: {stats['images_encoded']:.0f} for {len(batch)} images; "
                f"prompt tokens from the prefix cache: {stats['cached_prompt_tokens']:.0f}"
            )
            print(inspect_image.trace())


if __name__ == "__main__":
    main()
