"""The xgrammar backend: a constraint -> an xgrammar grammar (JSON schema, regex, EBNF,
structural tag) -> a pushdown automaton with a precomputed token-mask cache, walked by an
xgrammar `GrammarMatcher` per request.

Compiling computes the mask cache for every grammar position, which grows with the grammar: a
70 kB schema of 1000 patterned optional properties took 37 s on SmolLM2's vocabulary. So it
compiles in a worker process (killed when it overruns) and sends the compiled grammar back as
xgrammar's JSON serialization (tens of kB for a typical schema, loaded in milliseconds).
Importing xgrammar imports torch, so a worker takes seconds to start; it starts with the first
compile that needs it.

xgrammar skips some JSON Schema keywords (`uniqueItems`, `not`, `if`/`then`, `contains`,
unknown formats) and says so for others only as a warning on stderr (`allOf` of several
schemas, a `oneOf` whose branches may overlap, `multipleOf` on numbers). The first are refused
before compiling (`SUPPORT`); the worker reads xgrammar's warnings while it compiles and refuses
the grammar if there are any.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import xgrammar as xgr

from braid.runtime.constrained import GRAMMAR_BACKENDS
from braid.runtime.constrained.grammar import (
    PARALLEL_MIN_ROWS,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    parallel_cpus,
    schemas_of,
    thread_cap,
)
from braid.runtime.constrained.jump_forward import tokens_spelling
from braid.runtime.constrained.schema_support import CORE, SchemaSupport, unenforced
from braid.runtime.constrained.spec import regex_of_choices, structural_tag
from braid.runtime.constrained.vocab import TokenVocab

SUPPORT = SchemaSupport(
    "xgrammar",
    keywords=CORE
    | set(
        "minimum maximum exclusiveMinimum exclusiveMaximum multipleOf patternProperties "
        "propertyNames minProperties maxProperties".split()
    ),
    # Its ipv4 (and ipv6's embedded ipv4) admits leading zeros: "176.83.039.49".
    formats=frozenset(
        "date-time date time duration email hostname uri uri-reference uuid "
        "uri-template json-pointer relative-json-pointer".split()
    ),
    multiple_of_integers_only=True,
    empty_type_matches_nothing=False,
)
# xgrammar's log prefix: "[23:14:39] /project/cpp/json_schema_converter.cc:870: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Threads one compile may use (xgrammar splits the mask cache between them).
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
# Threads of one batch mask fill. One: on the H200 machine's 16 CPUs a JSON-schema row took
# 10 us alone against 26-48 us with 2, 4 or 16 threads at 64 rows (9.6 against 10.5-11.9 at
# 256; a regex row 4.4 against 30-58 at 64), and on the 2-core VM 5 against 38-64 us
# (`benchmarks/grammar_batch.py --threads`). The call releases the GIL either way, so the
# mask thread fills beside the scheduler's.
FILL_THREADS = 1


def _message(e: BaseException) -> str:
    return _LOG_PREFIX.sub("", str(e).strip().splitlines()[-1] if str(e).strip() else repr(e))


@contextlib.contextmanager
def _stderr_lines() -> Iterator[list[str]]:
    """Collect what is written to file descriptor 2 (xgrammar's C++ log) inside the block."""
    lines: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def _structural_tag(spec: Any) -> dict[str, Any]:
    tag = structural_tag(spec)
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s["schema"]},
            "end": s["end"],
        }
        for s in tag["structures"]
    ]
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags},
    }


def dot_excludes_newline(regex: str) -> str:
    """`regex` with each `.` outside a character class written `[^\\n]`: xgrammar's `.` matches
    a newline, Python's (and llguidance's, outlines-core's) does not. Escaped characters and
    classes (`\\.`, `[.]`) are copied as they are."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            out.append(regex[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            # A "]" first in the class (after any "^") is a literal one.
            j = i + 1 + (regex[i + 1 : i + 2] == "^")
            if regex[j : j + 1] == "]":
                out.append(regex[i : j + 1])
                i = j + 1
                continue
        elif ch == ".":
            ch = "[^\\n]"
        out.append(ch)
        i += 1
    return "".join(out)


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, spec: Any) -> xgr.CompiledGrammar:
    """Compile a checked (kind, spec); `ValueError` naming the field if xgrammar cannot, or if
    it warns that it would not enforce all of it."""
    with _stderr_lines() as log:
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(dot_excludes_newline(spec))
            elif kind == "choice":
                compiled = compiler.compile_regex(regex_of_choices(spec))
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(spec)
            else:
                compiled = compiler.compile_structural_tag(_structural_tag(spec))
        except Exception as e:  # xgrammar raises RuntimeError, ValueError, its own types
            raise ValueError(f"{kind}: cannot be compiled by xgrammar: {_message(e)}") from None
    warnings = [_LOG_PREFIX.sub("", line) for line in log if "Warning" in line]
    if warnings:
        raise ValueError(f"{kind}: xgrammar would not enforce all of it: {warnings[0]}")
    return compiled


class XGrammarGrammar(CompiledGrammar):
    backend = "xgrammar"

    def __init__(self, kind: str, compiled: xgr.CompiledGrammar, vocab: TokenVocab) -> None:
        self.kind = kind
        self.compiled = compiled
        self.vocab = vocab
        self.words = (vocab.size + 31) // 32

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)


@GRAMMAR_BACKENDS.register
class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    kinds = frozenset({"json_schema", "regex", "choice", "ebnf", "structural_tag"})

    @classmethod
    def refusal(cls, kind: str, spec: Any) -> str | None:
        reason = super().refusal(kind, spec)
        if reason is not None:
            return reason
        for schema in schemas_of(kind, spec):
            why = unenforced(schema, SUPPORT)
            if why is not None:
                return f"{kind}: {why}"
        return None

    def __init__(self, vocab: TokenVocab, mapping: dict[bytes, list[int]]) -> None:
        self.vocab = vocab
        encoded = [b""] * vocab.size  # empty: a special token, never allowed
        for tid, raw in vocab.token_bytes.items():
            encoded[tid] = raw
        self.info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType.RAW,
            vocab_size=vocab.size,
            stop_token_ids=[vocab.eos_token_id],
        )
        self._compiler: xgr.GrammarCompiler | None = None

    def build(self, kind: str, spec: Any) -> XGrammarGrammar:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(
                self.info, max_threads=COMPILE_THREADS, cache_enabled=False
            )
        return XGrammarGrammar(kind, compile_spec(self._compiler, kind, spec), self.vocab)

    def worker_payload(self) -> bytes:
        return self.info.serialize_json().encode()

    @staticmethod
    def worker_load(payload: bytes) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.deserialize_json(payload.decode())
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)

    @staticmethod
    def worker_build(state: xgr.GrammarCompiler, kind: str, spec: Any) -> str:
        return compile_spec(state, kind, spec).serialize_json()

    def load(self, kind: str, spec: Any, artifact: str) -> XGrammarGrammar:
        compiled = xgr.CompiledGrammar.deserialize_json(artifact, self.info)
        return XGrammarGrammar(kind, compiled, self.vocab)


@functools.cache
def _batch() -> xgr.BatchGrammarMatcher | None:
    """xgrammar's batch calls for a batch's masks, on FILL_THREADS native threads (None on a
    machine with too few CPUs for the mask thread to pay)."""
    if not parallel_cpus():
        return None
    return xgr.BatchGrammarMatcher(max_threads=thread_cap() or FILL_THREADS)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, grammar: XGrammarGrammar) -> None:
        self.grammar = grammar
        self._m = xgr.GrammarMatcher(grammar.compiled)
        self._words = grammar.words

    @classmethod
    def fills_natively(cls, n: int) -> bool:
        return _batch() is not None and n >= PARALLEL_MIN_ROWS

    @classmethod
    def fill_many(cls, matchers: Sequence[XGrammarMatcher], buf: Any, rows: Sequence[int]) -> None:
        if not cls.fills_natively(len(matchers)):
            return super().fill_many(matchers, buf, rows)
        batch = _batch()
        assert all(m._words == buf.shape[1] for m in matchers), "a row is not one mask wide"
        batch.batch_fill_next_token_bitmask([m._m for m in matchers], buf, list(rows))

    @classmethod
    def advance_many(
        cls, matchers: Sequence[XGrammarMatcher], tokens: Sequence[int]
    ) -> list[str | None]:
        if len(matchers) < PARALLEL_MIN_ROWS:
            return super().advance_many(matchers, tokens)
        took = xgr.BatchGrammarMatcher.batch_accept_token([m._m for m in matchers], list(tokens))
        return [
            None if ok else f"token {t} is not allowed by the grammar here"
            for t, ok in zip(tokens, took)
        ]

    def fill_bitmask(self, row: torch.Tensor) -> None:
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        # A model's vocabulary may be wider than the tokenizer's: those words ban everything.
        self._m.fill_next_token_bitmask(row[: self._words].view(1, self._words), 0)
        if row.numel() > self._words:
            row[self._words :] = 0

    def advance(self, token_id: int) -> None:
        if not self._m.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the grammar here")

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def is_final(self) -> bool:
        return self._m.is_completed()

    def forced_tokens(self) -> tuple[int, ...]:
        forced = self._m.find_jump_forward_string()
        if not forced:
            return ()

        def accepts(ids: list[int]) -> bool:
            taken = 0
            for t in ids:
                if not self._m.accept_token(t):
                    break
                taken += 1
            self.rollback(taken)
            return taken == len(ids)

        return tokens_spelling(forced.encode(), self.grammar.vocab, accepts)

    def allowed_tokens(self) -> list[int]:
        row = torch.zeros(self._words, dtype=torch.int32)
        self.fill_bitmask(row)
        ids = torch.arange(self._words * 32)
        bits = (row[ids // 32] >> (ids % 32)) & 1
        return ids[bits.bool()].tolist()
