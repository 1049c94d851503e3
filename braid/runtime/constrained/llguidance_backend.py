"""The llguidance backend: a constraint -> an llguidance grammar (JSON schema, regex, Lark, EBNF
through llguidance's GBNF converter, structural tags as lazy Lark rules) -> an Earley parser
over a lazily built lexer, which computes each step's mask from the token trie.

Nothing is precomputed per grammar position, so a compile is milliseconds (a 70 kB schema of
1000 patterned properties: about 0.3 s, where xgrammar takes 37 s), and llguidance bounds its
own work at decode (`LLParserLimits`: `step_lexer_fuel`, `step_max_items`; a matcher over a
limit enters an error state, its mask bans every token, and the request fails with the error
at its next token). The grammar is still written and checked in a compile worker, as for the
other backends: llguidance's GBNF converter is pure Python and quadratic (115 s, holding the
GIL, for a 177 kB grammar of 5000 chained rules), and checking that same grammar crashed the
process (SIGSEGV) — a worker's crash fails one request. The worker sends back the grammar's
text; the matcher prototype is built from it here (GIL released), and each request's matcher
is a copy of it.

llguidance refuses JSON Schema keywords it does not implement (`Unimplemented keys: [...]`,
`Unknown format`) rather than skipping them; braid turns off its `lenient` mode and its oneOf
coercion, so a schema either compiles exactly or is refused, naming the keyword. Objects are
closed as the other backends close them (`schema_support.closed_objects`): a small model
otherwise goes on inventing keys. Imports no torch: the compile worker imports this module.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import gbnf_to_lark

from braid.runtime.constrained import GRAMMAR_BACKENDS
from braid.runtime.constrained.grammar import (
    NO_OUTPUT,
    PARALLEL_MIN_ROWS,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    parallel_cpus,
    short_error,
    thread_cap,
)
from braid.runtime.constrained.jump_forward import tokens_spelling
from braid.runtime.constrained.schema_support import closed_objects
from braid.runtime.constrained.spec import json_spec, regex_of_choices, structural_tag, trigger_of
from braid.runtime.constrained.vocab import TokenVocab

# JSON as json.dumps writes it (the other backends' separators too); a schema's own
# "x-guidance" options may change these, never the two below.
JSON_DEFAULTS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
JSON_OVERRIDES = {"lenient": False, "coerce_one_of": False}


def grammar_of(kind: str, spec: Any) -> str:
    """The llguidance grammar (Lark, or its JSON form) of a checked (kind, spec); `ValueError`
    naming the field if the spec cannot be written as one."""
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(
            closed_objects(json_spec(kind, spec)), defaults=JSON_DEFAULTS, overrides=JSON_OVERRIDES
        )
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_regex(regex_of_choices(spec))
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec)
    if kind == "ebnf":
        try:
            lark = gbnf_to_lark(spec)
        except Exception as e:  # the converter raises plain Exceptions for bad grammars
            raise ValueError(f"ebnf: invalid grammar: {e}") from None
        return llg.LLMatcher.grammar_from_lark(parser_rules(lark))
    tag = structural_tag(spec)
    tags = [
        llg.StructTag(
            trigger=trigger_of(s["begin"], tag["triggers"]),
            begin=s["begin"],
            grammar=closed_objects(s["schema"]),
            end=s["end"],
        )
        for s in tag["structures"]
    ]
    # Triggers are text here: `<function=` is typed out, not one special token.
    return llg.StructTag.to_grammar(tags, assume_special=False)


# A piece of Lark text: a string, a regex, a comment, a directive line, a name, anything else.
_LARK_PIECE = re.compile(
    r'"(?:\\.|[^"\\])*"i?|//[^\n]*|/(?:\\.|[^/\\\n])+/[imslux]*|%[^\n]*|[A-Za-z_]\w*|.', re.S
)


def parser_rules(lark: str) -> str:
    """`lark` with its terminals (upper-case names) turned into rules.

    llguidance's GBNF converter makes a rule made of literals alone a terminal, and terminals
    are lexed greedily with no way back: in `expr " = " num` with `EXPR: NUM (" " OP " " NUM)*`
    the lexer takes the space of " = " as the start of another `" " OP`, and "1 = 2" is
    refused. As rules they are parsed as EBNF means them; the strings and regexes inside stay
    terminals."""
    out = []
    for m in _LARK_PIECE.finditer(lark):
        piece = m.group()
        out.append(piece.lower() if piece.isupper() and piece[0].isalpha() else piece)
    return "".join(out)


def check_grammar(kind: str, grammar: str, tokenizer: llg.LLTokenizer | None = None) -> None:
    """`ValueError` with llguidance's error (or its first warning: a warning says something
    would not be enforced exactly) if `grammar` is not valid."""
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise _compile_error(kind, messages[0])
    if messages:
        raise ValueError(f"{kind}: llguidance would not enforce all of it: {messages[0]}")


class _Tokens:
    """The vocabulary as llguidance's `TokenizerWrapper` reads it: each token's bytes (special
    ones by name, which llguidance marks as special) and the tokenizer's encoding."""

    def __init__(self, vocab: TokenVocab) -> None:
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = None
        self.special_token_ids = [t for t in range(vocab.size) if t not in vocab.token_bytes]
        self.tokens = [
            vocab.token_bytes.get(t) or f"<|special_{t}|>".encode() for t in range(vocab.size)
        ]
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("encodes text only")  # tells llguidance to pass str
        return self._encode(text)


class LLGuidanceGrammar(CompiledGrammar):
    backend = "llguidance"

    def __init__(self, kind: str, prototype: llg.LLMatcher, vocab: TokenVocab) -> None:
        self.kind = kind
        self.vocab = vocab
        self.words = (vocab.size + 31) // 32
        self._prototype = prototype  # built and warmed at compile; matchers are copies
        self._lock = threading.Lock()

    def matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            return LLGuidanceMatcher(self, self._prototype.deep_copy())


@GRAMMAR_BACKENDS.register
class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    kinds = frozenset({"json_schema", "regex", "choice", "ebnf", "lark", "structural_tag"})
    # What it refuses, it refuses when compiling (in the worker): see the module docstring.

    def __init__(self, vocab: TokenVocab, mapping: dict[bytes, list[int]]) -> None:
        self.vocab = vocab
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Tokens(vocab)))

    def build(self, kind: str, spec: Any) -> LLGuidanceGrammar:
        return self.load(kind, spec, self.worker_build(None, kind, spec))

    def worker_payload(self) -> bytes:
        return b""  # the grammar is checked without the vocabulary

    @staticmethod
    def worker_load(payload: bytes) -> None:
        return None

    @staticmethod
    def worker_build(state: None, kind: str, spec: Any) -> str:
        grammar = grammar_of(kind, spec)
        check_grammar(kind, grammar)
        return grammar

    def load(self, kind: str, spec: Any, artifact: str) -> LLGuidanceGrammar:
        import torch  # not at import: the compile worker imports this module

        prototype = llg.LLMatcher(self.tokenizer, artifact, log_level=0)
        if prototype.is_error():
            raise _compile_error(kind, prototype.get_error())
        compiled = LLGuidanceGrammar(kind, prototype, self.vocab)
        # The first mask builds the lexer states the start needs: here, not at the first step.
        LLGuidanceMatcher(compiled, prototype).fill_bitmask(
            torch.empty(compiled.words, dtype=torch.int32)
        )
        return compiled


@functools.cache
def _executor() -> llg.LLExecutor | None:
    """llguidance's thread pool for a batch's masks and advances (None on a machine with too
    few CPUs for it to pay)."""
    cpus = parallel_cpus()
    return llg.LLExecutor(num_threads=thread_cap()) if cpus else None


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, grammar: LLGuidanceGrammar, matcher: llg.LLMatcher) -> None:
        self.grammar = grammar
        self._m = matcher
        self._words = grammar.words

    @classmethod
    def fills_natively(cls, n: int) -> bool:
        return _executor() is not None and n >= PARALLEL_MIN_ROWS

    @classmethod
    def fill_many(
        cls, matchers: Sequence[LLGuidanceMatcher], buf: Any, rows: Sequence[int]
    ) -> None:
        executor = _executor()
        if not cls.fills_natively(len(matchers)):
            return super().fill_many(matchers, buf, rows)
        assert buf.dtype.itemsize == 4 and buf.is_contiguous() and buf.device.type == "cpu"
        words = buf.shape[1]
        assert all(m._words == words for m in matchers), "a row is not one mask wide"
        # A matcher in an error state gets an all-banned row, as from `fill_bitmask`.
        executor.unsafe_compute_mask_ptr(
            [(m._m, r) for m, r in zip(matchers, rows)], buf.data_ptr(), 4 * words, buf.shape[0]
        )
        for m, r in zip(matchers, rows):
            if m._m.is_error():
                buf[r].zero_()

    # Grammars advance one at a time (the base class's loop), not through the executor's
    # `consume_token_par`: on the H200's 16 CPUs that took 20-118 us a row against 5-11 one at
    # a time, at 16 to 256 rows (benchmarks/results/grammar_batch_h200_cuda.json).

    def fill_bitmask(self, row: Any) -> None:
        assert row.element_size() == 4 and row.is_contiguous() and row.device.type == "cpu"
        if not self._m.is_error():
            self._m.unsafe_compute_mask_ptr(row.data_ptr(), 4 * self._words)
        if self._m.is_error():  # over a limit: nothing is allowed, the next token fails
            row.zero_()
        elif row.numel() > self._words:
            row[self._words :] = 0

    def advance(self, token_id: int) -> None:
        if self._m.try_consume_tokens([token_id]) != 1:
            raise ValueError(_refusal(token_id, self._m.get_error()))

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {short_error(self._m.get_error())}")

    @property
    def is_final(self) -> bool:
        return self._m.is_accepting()

    def forced_tokens(self) -> tuple[int, ...]:
        forced = self._m.compute_ff_bytes()
        if not forced:
            return ()
        return tokens_spelling(
            forced, self.grammar.vocab, lambda ids: self._m.validate_tokens(ids) == len(ids)
        )

    def allowed_tokens(self) -> list[int]:
        import torch

        row = torch.zeros(self._words, dtype=torch.int32)
        self.fill_bitmask(row)
        ids = torch.arange(self._words * 32)
        bits = (row[ids // 32] >> (ids % 32)) & 1
        return ids[bits.bool()].tolist()


def _compile_error(kind: str, message: str) -> ValueError:
    """The `ValueError` of llguidance's compile error `message`. A schema llguidance proves
    unsatisfiable (`Unsatisfiable schema: ...`, for `{"enum": []}` or a required property that
    allows nothing) is `NO_OUTPUT`: no other backend is tried (one would compile some of these
    into a grammar allowing only the empty output, or any value)."""
    if message.startswith("Unsatisfiable schema"):
        return ValueError(f"{kind}: {NO_OUTPUT} (llguidance: {message})")
    return ValueError(f"{kind}: cannot be compiled by llguidance: {message}")


def _refusal(token_id: int, error: str | None) -> str:
    """Why the matcher took no `token_id`: its error's first line (what went wrong; the lines
    after it dump the parser's state and the grammar, tens of kB, for llguidance's own
    debugging), at most `MAX_ERROR_CHARS`."""
    if not error:
        return f"token {token_id} is not allowed by the grammar here"
    first = error.split("\n", 1)[0]
    return f"token {token_id} is not allowed by the grammar here ({short_error(first)})"
