"""The outlines-core backend: a constraint -> regex -> a token-level DFA (`Index`), walked by a
`Guide` per request.

Building an index can take minutes (`(a|b)*a(a|b){14}`, or SGLang's Harry Potter character
regex with its `[\\w\\d\\s]{1,16}` fields: 30.9 s on SmolLM2's vocabulary), so it is built in
a compile worker process that is killed when it overruns. Masks are a table lookup per state,
and forced strings (jump-forward) are found on the automaton itself (`ForcedStrings`).

outlines-core writes JSON Schema keywords it does not implement as if absent (`minimum`,
`maximum`, `multipleOf`, `uniqueItems`, ...), an `anyOf` beside other keywords as one side
alone, a date-time without its UTC offset, a uri or email that may end the string early, a
recursive `$ref` cut off a few levels deep, and `pattern` beside a length bound as the bound
alone; those schemas are refused here (`SUPPORT`) and go to another backend. Imports no torch:
the compile worker imports this module.
"""

from __future__ import annotations

import json
from typing import Any

from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from braid.runtime.constrained import GRAMMAR_BACKENDS
from braid.runtime.constrained.grammar import CompiledGrammar, GrammarBackend, GrammarMatcher
from braid.runtime.constrained.jump_forward import MAX_FORCED_BYTES, ForcedStrings
from braid.runtime.constrained.schema_support import CORE, SchemaSupport, unenforced
from braid.runtime.constrained.spec import json_spec, regex_of_choices
from braid.runtime.constrained.vocab import TokenVocab

SUPPORT = SchemaSupport(
    "outlines",
    keywords=CORE,
    # Its date-time and time patterns make the UTC offset optional (RFC 3339 requires one);
    # its uri and email patterns allow a '"', which ends the JSON string early.
    formats=frozenset({"date", "uuid"}),
    empty_type_matches_nothing=False,
    writes_recursion=False,
    apart=frozenset(
        {
            ("pattern", "minLength"),
            ("pattern", "maxLength"),
            ("prefixItems", "minItems"),
            ("prefixItems", "maxItems"),
        }
    ),
)


def to_regex(kind: str, spec: Any) -> str:
    """The regex outlines-core compiles for a checked (kind, spec); `ValueError` naming the
    field if outlines-core cannot write one."""
    if kind == "regex":
        return spec
    if kind == "choice":
        return regex_of_choices(spec)
    text = spec if isinstance(spec, str) else json.dumps(spec)
    try:
        return build_regex_from_schema(text)
    except Exception as e:  # outlines-core raises several types for bad schemas
        raise ValueError(f"json_schema: unsupported or invalid schema: {e}") from None


def build_index(kind: str, spec: Any, vocabulary: Vocabulary) -> Index:
    """The token index of a checked constraint over `vocabulary`; `ValueError` naming the field
    if outlines-core cannot build an automaton for it. Releases the GIL while outlines-core
    builds, and may take minutes on a pathological spec."""
    regex = to_regex(kind, spec)
    try:
        return Index(regex, vocabulary)
    except Exception as e:  # e.g. a regex outlines-core cannot turn into an automaton
        raise ValueError(f"{kind}: cannot be compiled: {e}") from None


class OutlinesGrammar(CompiledGrammar):
    backend = "outlines"

    def __init__(self, kind: str, index: Index, forced: ForcedStrings | None) -> None:
        self.kind = kind
        self.index = index
        self.forced = forced

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)


@GRAMMAR_BACKENDS.register
class OutlinesBackend(GrammarBackend):
    name = "outlines"
    kinds = frozenset({"json_schema", "regex", "choice"})

    @classmethod
    def refusal(cls, kind: str, spec: Any) -> str | None:
        reason = super().refusal(kind, spec)
        if reason is None and kind == "json_schema":
            why = unenforced(json_spec(kind, spec), SUPPORT)
            reason = None if why is None else f"json_schema: {why}"
        return reason

    def __init__(self, vocab: TokenVocab, mapping: dict[bytes, list[int]]) -> None:
        self.vocab = vocab
        self.vocabulary = Vocabulary(vocab.eos_token_id, mapping)
        self.jump_forward_supported = vocab.spells_every_first_byte

    def build(self, kind: str, spec: Any) -> OutlinesGrammar:
        return self.load(kind, spec, build_index(kind, spec, self.vocabulary))

    def worker_payload(self) -> bytes:
        import pickle

        return pickle.dumps(self.vocabulary, pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def worker_load(payload: bytes) -> Vocabulary:
        import pickle

        return pickle.loads(payload)

    @staticmethod
    def worker_build(state: Vocabulary, kind: str, spec: Any) -> Index:
        return build_index(kind, spec, state)

    def load(self, kind: str, spec: Any, artifact: Index) -> OutlinesGrammar:
        forced = ForcedStrings(artifact, self.vocab) if self.jump_forward_supported else None
        return OutlinesGrammar(kind, artifact, forced)


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, grammar: OutlinesGrammar) -> None:
        self.grammar = grammar
        # A jump appends at most MAX_FORCED_BYTES tokens, all of which verifying may undo.
        self._guide = Guide(grammar.index, max_rollback=MAX_FORCED_BYTES)

    @property
    def state(self) -> int:
        return self._guide.get_state()

    def allowed_tokens(self) -> list[int]:
        return self._guide.get_tokens()

    def fill_bitmask(self, row: Any) -> None:
        assert row.element_size() == 4 and row.is_contiguous() and row.device.type == "cpu"
        self._guide.write_mask_into(row.data_ptr(), row.numel(), 4)

    def advance(self, token_id: int) -> None:
        try:
            self._guide.advance(token_id, False)
        except ValueError:
            raise ValueError(f"token {token_id} is not allowed by the grammar here") from None

    def rollback(self, n: int) -> None:
        if n:
            self._guide.rollback_state(n)

    @property
    def is_final(self) -> bool:
        return self.grammar.index.is_final_state(self.state)

    def forced_tokens(self) -> tuple[int, ...]:
        forced = self.grammar.forced
        return forced.tokens(self.state) if forced is not None else ()
