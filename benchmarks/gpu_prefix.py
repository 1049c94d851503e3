"""Prefix-sharing workloads for a config-only model, which has no tokenizer (used by
benchmarks/gpu.py beside benchmarks/prefix_sharing.py's own builders)."""

from __future__ import annotations

import random
import re
import zlib

import braid
from benchmarks.prefix_sharing import run_batch, sentence


class WordTokenizer:
    """Words and punctuation to fixed ids (a stable hash into [100, vocab)), so that the
    prefix-sharing text builders work on a config-only model, which has no tokenizer. Equal
    text gives equal ids and text ending in whitespace encodes to a prefix of any extension,
    which is all prefix sharing needs; counts are near a real tokenizer's, not equal."""

    _PIECE = re.compile(r"\w+|[^\w\s]|\n")

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= 100:
            raise ValueError(f"vocab_size must exceed 100, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        span = self.vocab_size - 100
        return [100 + zlib.crc32(p.encode()) % span for p in self._PIECE.findall(text)]


def workload_chat_ids(llm: braid.LLM, tok: WordTokenizer, rng_seed: int, n_convs: int):
    """prefix_sharing's multi-turn chat (4 turns, 16 tokens out each), in token ids: each
    turn's prompt is the last prompt, its output ids and a new user message. (The text version
    re-tokenizes decoded replies, which needs the model's own tokenizer.)"""
    rng = random.Random(rng_seed)
    history = [
        tok.encode("<system> You are a helpful assistant. " + sentence(rng, 20) + "\n")
        for _ in range(n_convs)
    ]
    pairs = []
    for _ in range(4):
        prompts = [
            h + tok.encode("<user> " + sentence(rng, 18) + "\n<assistant>\n") for h in history
        ]
        outs = run_batch(llm, prompts, 16)
        history = []
        for p, o in zip(prompts, outs):
            ids = list(o.outputs[0].token_ids)
            pairs.append((p, ids))
            history.append(p + ids)
    return pairs
