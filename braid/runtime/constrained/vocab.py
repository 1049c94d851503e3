"""The model's vocabulary as raw bytes, as outlines-core wants it.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) spell each byte as a printable
character (`Ġ` is a space); SentencePiece tokenizers write a space as `▁` and unprintable bytes
as `<0xNN>`. Both are mapped back to bytes. The EOS token and special added tokens stay out of
the map (outlines-core adds EOS itself where the grammar may end).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _unicode_to_byte() -> dict[str, int]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_sentencepiece(vocab: dict[str, int]) -> bool:
    return any(t.startswith("▁") for t in vocab) and not any(t.startswith("Ġ") for t in vocab)


def token_bytes(tokenizer) -> tuple[int, dict[bytes, list[int]]]:
    """(eos id, {token bytes: [token ids]}) for outlines-core's `Vocabulary`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("constrained decoding needs a tokenizer with an EOS token")
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    out: dict[bytes, list[int]] = {}
    sp = _is_sentencepiece(vocab)
    u2b = _unicode_to_byte()
    for tok, tid in sorted(vocab.items(), key=lambda kv: kv[1]):  # ids in order, any source
        if tid in special or tid == eos:
            continue
        if sp:
            m = _BYTE_TOKEN.match(tok)
            raw = bytes([int(m.group(1), 16)]) if m else tok.replace("▁", " ").encode()
        else:
            try:
                raw = bytes(u2b[c] for c in tok)
            except KeyError:
                raw = tok.encode()  # a token outside the byte alphabet: take it as text
        out.setdefault(raw, []).append(tid)
    return eos, out


@dataclass(frozen=True)
class TokenVocab:
    """What constrained decoding needs to know about a tokenizer's vocabulary.

    `size`: every token id is below it (EOS and added tokens included), so a bitmask of
    `ceil(size / 32)` words covers them all. `token_bytes`: the bytes each grammar token spells.
    `byte_tokens[b]`: a token spelling exactly the byte `b`, or None. `encode`: text to token
    ids, without special tokens (jump-forward tokenizes the strings a grammar forces).
    """

    eos_token_id: int
    size: int
    token_bytes: dict[int, bytes]
    byte_tokens: tuple[int | None, ...]
    encode: Callable[[str], list[int]]

    @property
    def spells_every_first_byte(self) -> bool:
        """True when every byte that starts some token is also a token of its own. Then the
        bytes a grammar allows next are exactly those whose one-byte token it allows, which is
        what finding forced strings relies on (byte-level BPE and byte-fallback vocabularies
        hold all 256 bytes)."""
        return all(self.byte_tokens[b[0]] is not None for b in self.token_bytes.values() if b)


def token_vocab(tokenizer) -> tuple[TokenVocab, dict[bytes, list[int]]]:
    """The `TokenVocab` of a Hugging Face tokenizer, and the {bytes: [ids]} map for
    outlines-core's `Vocabulary` (see `token_bytes`)."""
    eos, mapping = token_bytes(tokenizer)
    by_id = {tid: raw for raw, ids in mapping.items() for tid in ids}
    singles: list[int | None] = [None] * 256
    for raw, ids in mapping.items():
        if len(raw) == 1:
            singles[raw[0]] = min(ids)
    size = max([len(tokenizer), eos + 1, *(t + 1 for t in by_id)])

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return TokenVocab(eos, size, by_id, tuple(singles), encode), mapping
