"""Jump-forward: the text a grammar forces from a state, as tokens, so the scheduler can append
it without sampling it token by token.

A string is forced at a state when every continuation the grammar accepts from there starts
with it: a JSON key and its quotes, the `": ` after it, the rest of the only choice that starts
with what was generated. Each backend finds the forced bytes its own way: outlines-core's index
is a deterministic automaton over bytes whose transitions are labelled with tokens, so the next
byte is forced exactly when the state is not final (EOS could end the output) and the one-byte
token of a single byte is allowed (`ForcedStrings`, cached by state); xgrammar and llguidance
compute them from their parser state. For all of them the forced bytes are cut at the last
whole UTF-8 character, tokenized the way the tokenizer would tokenize that text, and kept only
if the tokens spell it byte for byte and the grammar accepts them one after the other
(`tokens_spelling`; a tokenizer that adds a prefix space, as SentencePiece does, fails that
check and gets no jump).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from outlines_core import Index

from braid.runtime.constrained.vocab import TokenVocab

# Longest forced string followed at once (a jump stops there; the next step finds the rest).
MAX_FORCED_BYTES = 512
# Results kept per grammar; an index has few states where generation actually goes.
MAX_CACHED_STATES = 4096


class ForcedStrings:
    """Forced continuations of one compiled grammar, cached by state. Thread-safe."""

    def __init__(self, index: Index, vocab: TokenVocab) -> None:
        self.index = index
        self.vocab = vocab
        self._cache: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every accepted continuation from `state` starts with (maybe empty)."""
        out = bytearray()
        index, singles = self.index, self.vocab.byte_tokens
        while len(out) < MAX_FORCED_BYTES and not index.is_final_state(state):
            only: tuple[int, int] | None = None
            for b, tid in enumerate(singles):
                if tid is None:
                    continue
                nxt = index.get_next_state(state, tid)
                if nxt is None:
                    continue
                if only is not None:
                    return bytes(out)  # two possible next bytes: the forced part ends here
                only = (b, nxt)
            if only is None:
                break
            out.append(only[0])
            state = only[1]
        return bytes(out)

    def tokens(self, state: int) -> tuple[int, ...]:
        """Tokens spelling the forced string from `state`, as the tokenizer splits that text;
        empty when nothing is forced or no such tokens are accepted."""
        with self._lock:
            hit = self._cache.get(state)
        if hit is not None:
            return hit
        result = self._compute(state)
        with self._lock:
            if len(self._cache) < MAX_CACHED_STATES:
                self._cache[state] = result
        return result

    def _compute(self, state: int) -> tuple[int, ...]:
        def accepts(ids: list[int]) -> bool:
            s: int | None = state
            for t in ids:
                s = self.index.get_next_state(s, t)
                if s is None:
                    return False
            return True

        return tokens_spelling(self.forced_bytes(state), self.vocab, accepts)


def tokens_spelling(
    raw: bytes, vocab: TokenVocab, accepts: Callable[[list[int]], bool]
) -> tuple[int, ...]:
    """The tokens a jump appends for `raw`, the bytes a grammar forces: its longest prefix of
    whole UTF-8 characters (at most MAX_FORCED_BYTES), tokenized as the tokenizer would
    tokenize that text, if those tokens spell it byte for byte and the grammar `accepts` them
    one after the other; else none. Every backend's matcher finds its forced bytes its own way
    and gets its tokens here."""
    text = _whole_characters(raw[:MAX_FORCED_BYTES])
    if not text:
        return ()
    ids = vocab.encode(text)
    spelled = b"".join(vocab.token_bytes.get(t, b"\xff\xff") for t in ids)
    if spelled != text.encode() or not accepts(ids):
        return ()
    return tuple(ids)


def _whole_characters(raw: bytes) -> str:
    """The longest prefix of `raw` that is whole UTF-8 characters, decoded."""
    for cut in range(len(raw), max(-1, len(raw) - 4), -1):
        try:
            return raw[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def jump_tokens(
    forced: tuple[int, ...], room: int, stop_token_ids: tuple[int, ...] | list[int] = ()
) -> tuple[int, ...]:
    """Which of the `forced` tokens (`ForcedStrings.tokens`) a request appends without sampling.

    All but the last: the model samples that one itself, so it may pick a token that crosses
    the end of the forced text (`":` after a key, `{"` at the start), as it would without
    jump-forward; appending it instead makes the model continue from a tokenization it would
    not have produced, and its later choices drift. At most `room` tokens (the token that
    reaches max_tokens is always sampled), and none from the first stop token on."""
    take = forced[: max(0, min(len(forced) - 1, room))]
    for k, t in enumerate(take):
        if t in stop_token_ids:
            return take[:k]
    return take
