"""Grammars: a constraint spec -> regex -> outlines-core `Index` (see `spec`), cached with its
forced strings, and a per-request matcher that walks the index as tokens are sampled and writes
its allowed-token bitmask."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from outlines_core import Guide, Index, Vocabulary

from braid.runtime.constrained import GRAMMAR_BACKENDS
from braid.runtime.constrained.jump_forward import MAX_FORCED_BYTES, ForcedStrings
from braid.runtime.constrained.spec import build_index, grammar_key
from braid.runtime.constrained.spec import to_regex as to_regex  # callers import it from here
from braid.runtime.constrained.vocab import token_vocab


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled constraint: its token index and, when the vocabulary allows finding them, its
    forced strings (`forced` is None otherwise). Shared by every request with the same spec."""

    kind: str
    index: Index
    forced: ForcedStrings | None


@GRAMMAR_BACKENDS.register
class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary; compiled grammars are kept in a
    bounded LRU keyed by (kind, spec). `compile` may be called from several threads at once."""

    def __init__(self, tokenizer, max_entries: int = 256) -> None:
        self.vocab, mapping = token_vocab(tokenizer)
        self.eos_token_id = self.vocab.eos_token_id
        self.vocabulary = Vocabulary(self.eos_token_id, mapping)
        self.jump_forward_supported = self.vocab.spells_every_first_byte
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def cached(self, kind: str, spec: Any) -> CompiledGrammar | None:
        """The compiled grammar if it is in the cache (counts as a hit), else None."""
        key = grammar_key(kind, spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            return grammar

    def compile(self, kind: str, spec: Any) -> CompiledGrammar:
        """The compiled grammar, from the cache or built now in this thread; `ValueError`
        naming the field if the spec is bad or outlines-core cannot build an automaton for it.
        (`AsyncGrammarCompiler` builds indexes in worker processes and hands them to `add`.)"""
        hit = self.cached(kind, spec)
        if hit is not None:
            return hit
        return self.add(kind, spec, build_index(kind, spec, self.vocabulary))

    def add(self, kind: str, spec: Any, index: Index) -> CompiledGrammar:
        """Cache `index`, built for (kind, spec) over `self.vocabulary` (counts as a miss), and
        return its compiled grammar."""
        forced = ForcedStrings(index, self.vocab) if self.jump_forward_supported else None
        grammar = CompiledGrammar(kind, index, forced)
        with self._lock:
            self.misses += 1
            self._cache[grammar_key(kind, spec)] = grammar
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return grammar


class GrammarMatcher:
    """Where one request stands in its grammar. Not thread-safe: one per request."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        # A jump appends at most MAX_FORCED_BYTES tokens, all of which verifying may undo.
        self._guide = Guide(grammar.index, max_rollback=MAX_FORCED_BYTES)

    @property
    def state(self) -> int:
        return self._guide.get_state()

    def allowed_tokens(self) -> list[int]:
        return self._guide.get_tokens()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write this state's allowed tokens into `row`, a contiguous int32 CPU tensor of
        ceil(vocab.size / 32) or more words: bit j of word w set means token 32 * w + j is
        allowed; every other bit is cleared."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._guide.write_mask_into(row.data_ptr(), row.numel(), 4)

    def advance(self, token_id: int) -> None:
        """Move past `token_id`; `ValueError` if the grammar does not allow it here."""
        try:
            self._guide.advance(token_id, False)
        except ValueError:
            raise ValueError(f"token {token_id} is not allowed by the grammar here") from None

    def rollback(self, n: int) -> None:
        """Undo the last `n` advances (at most MAX_FORCED_BYTES)."""
        if n:
            self._guide.rollback_state(n)

    @property
    def is_final(self) -> bool:
        return self.grammar.index.is_final_state(self.state)

    def forced_tokens(self) -> tuple[int, ...]:
        """Tokens spelling the string the grammar forces next (empty if none, or if this
        vocabulary does not support finding forced strings)."""
        forced = self.grammar.forced
        return forced.tokens(self.state) if forced is not None else ()
