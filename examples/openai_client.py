"""Talk to `braid serve` with the official openai client: one chat, plain and streaming.

examples/serve.sh            # in one shell
python examples/openai_client.py [--base-url http://127.0.0.1:30000/v1]
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    ap.add_argument("--api-key", default="none", help="what braid serve --api-key was given")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Give me two tips for learning a language."}]

    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=80)
    print("Plain:", reply.choices[0].message.content)
    print("Usage:", reply.usage)

    print("Streaming: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=80, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
