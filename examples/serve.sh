#!/usr/bin/env bash
# Start braid's OpenAI-compatible server on the embedded model (SmolLM2-135M-Instruct).
# Then, in another shell: python examples/openai_client.py
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
exec .venv/bin/braid serve --host 127.0.0.1 --port "${PORT:-30000}" "$@"
