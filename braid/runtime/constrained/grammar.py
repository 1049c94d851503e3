"""Grammars: a constraint spec -> regex -> outlines-core `Index` (cached), and a per-request
matcher that walks the index as tokens are sampled."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

KINDS = ("json_schema", "regex", "choice")


def to_regex(kind: str, spec: Any) -> str:
    """The regex for a constraint; `ValueError` naming the field if the spec is bad."""
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("regex: must be a non-empty string")
        try:
            re.compile(spec)
        except re.error as e:
            raise ValueError(f"regex: invalid pattern: {e}") from None
        return spec
    if kind == "choice":
        if (
            not isinstance(spec, (list, tuple))
            or not spec
            or not all(isinstance(c, str) and c for c in spec)
        ):
            raise ValueError("choice: must be a non-empty list of non-empty strings")
        return "(" + "|".join(re.escape(c) for c in spec) + ")"
    if kind == "json_schema":
        text = spec if isinstance(spec, str) else json.dumps(spec)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not valid JSON: {e}") from None
        try:
            return build_regex_from_schema(text)
        except Exception as e:  # outlines-core raises several types for bad schemas
            raise ValueError(f"json_schema: unsupported or invalid schema: {e}") from None
    raise ValueError(f"unknown constraint kind {kind!r}")


class GrammarCompiler:
    """Compiles regexes against one vocabulary; compiled indexes are kept in a bounded LRU
    keyed by (kind, spec)."""

    def __init__(self, tokenizer, max_entries: int = 256) -> None:
        from braid.runtime.constrained.vocab import token_bytes

        eos, mapping = token_bytes(tokenizer)
        self.eos_token_id = eos
        self.vocabulary = Vocabulary(eos, mapping)
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], Index] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, kind: str, spec: Any) -> Index:
        key = (kind, spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        regex = to_regex(kind, spec)
        try:
            index = Index(regex, self.vocabulary)
        except Exception as e:  # e.g. a regex outlines-core cannot turn into an automaton
            raise ValueError(f"{kind}: cannot be compiled: {e}") from None
        with self._lock:
            self.misses += 1
            self._cache[key] = index
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return index


@dataclass
class GrammarMatcher:
    """Where one request stands in its grammar."""

    index: Index
    state: int

    @classmethod
    def start(cls, index: Index) -> GrammarMatcher:
        return cls(index, index.get_initial_state())

    def allowed_tokens(self) -> list[int]:
        return self.index.get_allowed_tokens(self.state)

    def advance(self, token_id: int) -> None:
        nxt = self.index.get_next_state(self.state, token_id)
        if nxt is None:
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        self.state = nxt

    @property
    def is_final(self) -> bool:
        return self.index.is_final_state(self.state)
