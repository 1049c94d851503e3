"""Small real tokenizers for constrained-decoding tests, built with the `tokenizers` library and
saved as Hugging Face tokenizer files: a byte-level BPE trained on JSON-like text (to sit beside
a tiny random-weight model) and a SentencePiece-style BPE (`▁` for spaces, `<0xNN>` byte
fallback)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    '{"name": "Ann", "age": 41, "tags": ["a", "b"]}',
    '{"color": "green", "ok": true, "score": 0.5}',
    '{"city": "Lyon", "country_code": "FR", "population": 513000}',
    '[1, 2, 3] {"x": 1, "y": -2} {"items": [], "done": false, "value": null}',
    "The quick brown fox jumps over the lazy dog. Yes or no? 1999, 2024, 42.",
    "hello world\nline two\tand tabs; apple banana cherry red green blue",
]


def build_byte_level_bpe(path: Path, vocab_size: int = 512) -> Path:
    """A GPT-2-style byte-level BPE (all 256 bytes are tokens) with `<|endoftext|>` as EOS,
    saved to `path` (tokenizer.json and friends); its ids stay below `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    assert len(fast) <= vocab_size
    fast.save_pretrained(str(path))
    return path


SP_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello"]
SP_PIECES += ["wo", "wor", "worl", "world", "▁world", "{", "}", '"', ":", "▁{"]
SP_MERGES = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("▁", "hello"),
    ("w", "o"),
    ("wo", "r"),
    ("wor", "l"),
    ("worl", "d"),
    ("▁", "world"),
    ("▁", "{"),
]


def build_sentencepiece_style(path: Path | None = None):
    """A Llama-2-style tokenizer: `<unk>`, `<s>`, `</s>`, the 256 `<0xNN>` byte tokens, then
    pieces where `▁` is a space; Metaspace pre-tokenizer, byte fallback. Returned as a
    transformers fast tokenizer (and saved to `path` if given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in SP_PIECES:
        vocab[piece] = len(vocab)
    model = models.BPE(vocab=vocab, merges=SP_MERGES, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


def build_tiny_constrained_model(path: Path) -> tuple[Path, int]:
    """A tiny random-weight Llama (tests/conftest.py) with the byte-level BPE beside it, so
    constrained decoding runs on it; returns (model dir, EOS id)."""
    from tests.conftest import build_tiny_model

    build_tiny_model("llama", path)
    build_byte_level_bpe(path)
    from transformers import PreTrainedTokenizerFast

    return path, PreTrainedTokenizerFast.from_pretrained(str(path)).eos_token_id
