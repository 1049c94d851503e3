"""Offline batched generation, vLLM-style, on braid's embedded model (SmolLM2-135M-Instruct).

python examples/offline_batch.py [--model PATH]
"""

from __future__ import annotations

import argparse

import braid

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    args = parser.parse_args()

    sampling_params = braid.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48)
    with braid.LLM(args.model) as llm:
        outputs = llm.generate(PROMPTS, sampling_params)
        for out in outputs:
            print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}\n")
        chat = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            braid.SamplingParams(temperature=0, max_tokens=32),
            use_tqdm=False,
        )
        print(f"Chat (greedy): {chat[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
