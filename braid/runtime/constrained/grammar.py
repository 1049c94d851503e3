"""Grammar backends behind one interface, and the compiler the scheduler holds.

A `GrammarBackend` (outlines-core, xgrammar, llguidance: one module each, in the
`GRAMMAR_BACKENDS` registry) turns a constraint (kind, spec) into a `CompiledGrammar` over one
tokenizer's vocabulary; a `GrammarMatcher` walks it as a request's tokens are sampled and
writes the int32 bitmask rows `bitmask.BitmaskBuffer` applies. Every backend writes the same
rows, so requests of different backends share a batch.

`GrammarCompiler` holds the vocabulary, a bounded cache of compiled grammars and the backends
it has built. Each constraint goes to the configured backend, unless that backend cannot
enforce it (a kind it lacks, a schema keyword it would ignore: see `schema_support`, or a
refusal it gives when compiling); then it goes to the next backend in `FALLBACK_ORDER` that
can, and if none can, the request is refused with the first reason. Nothing is ever compiled
into a grammar that accepts more than the spec does, so the output never silently fails to
match. A spec that no output satisfies is refused too, before its request runs: when a backend
says so while compiling (then no other backend is tried), or when the compiled grammar's first
step allows nothing (`start_refusal`, found once per compiled grammar and cached with it).

Imports no torch (the compile workers import the backends through this module).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from braid.runtime.constrained import GRAMMAR_BACKENDS, get_grammar_backend
from braid.runtime.constrained.schema_support import counted_open_object
from braid.runtime.constrained.spec import check_spec, grammar_key, json_spec, structural_tag
from braid.runtime.constrained.vocab import TokenVocab, token_vocab

logger = logging.getLogger(__name__)

# Where a constraint goes when the configured backend cannot enforce it: llguidance refuses
# what it cannot enforce itself and covers the most of JSON Schema; then xgrammar.
FALLBACK_ORDER = ("llguidance", "xgrammar", "outlines")
# A batch's masks are filled (and its grammars advanced) by the library's own native threads
# when there are at least this many rows and the process may use at least PARALLEL_MIN_CPUS
# CPUs; below that the thread hand-off costs more than it saves (measured on 2 cores: a
# regex mask takes 2.9 us a row alone, 6.7 us through llguidance's executor).
PARALLEL_MIN_ROWS = 16
PARALLEL_MIN_CPUS = 4
# What a request is told when its constraint admits no output at all; a compile error holding it
# is about the spec, not the backend, so no other backend is tried (`matches_nothing`).
NO_OUTPUT = "the constraint matches no output"
# The most of a grammar library's error a client is shown, and an operator's log line holds:
# llguidance's errors carry a dump of its parser state and grammar (tens of kB).
MAX_ERROR_CHARS = 300


def short_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line (each run of whitespace one space), cut after `limit` characters
    with " (truncated)" added where it was cut."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    return line[:limit].rstrip() + " (truncated)"


def matches_nothing(error: str) -> bool:
    """Whether a compile error (`kind: why`) says the spec itself admits no output (see
    NO_OUTPUT)."""
    return error.partition(": ")[2].startswith(NO_OUTPUT)


def thread_cap() -> int | None:
    """BRAID_GRAMMAR_THREADS, for measuring: the most native threads one batch call may use;
    None where unset or not a whole number."""
    cap = os.environ.get("BRAID_GRAMMAR_THREADS", "").strip()
    if not cap:
        return None
    try:
        return max(1, int(cap))
    except ValueError:
        return _bad_thread_cap(cap)


@functools.cache
def _bad_thread_cap(value: str) -> None:
    """None, with one warning per bad value of BRAID_GRAMMAR_THREADS."""
    logger.warning("BRAID_GRAMMAR_THREADS=%r is not a whole number: ignored", value)


def parallel_cpus() -> int:
    """CPUs a batch operation may spread over, at most `thread_cap()` (0 when the process may
    use fewer than PARALLEL_MIN_CPUS: then the batch calls are not used)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (n or 0) < PARALLEL_MIN_CPUS:
        return 0
    return min(n, thread_cap() or n)


class CompiledGrammar(ABC):
    """A compiled constraint, shared by every request with the same spec (thread-safe to
    share). `forced` is the outlines backend's forced-string finder, None elsewhere.
    `unsatisfiable`: why no output satisfies it (`start_refusal`), set by
    `GrammarCompiler.add` before the grammar is cached; a request with such a grammar is
    refused before it runs."""

    kind: str
    backend: str
    forced: Any = None
    unsatisfiable: str | None = None

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarMatcher(ABC):
    """Where one request stands in its grammar. Not thread-safe: one per request, used by one
    thread at a time (the scheduler's, or its mask thread while a fill runs: see
    `GrammarManager.start_fill`)."""

    grammar: CompiledGrammar

    @abstractmethod
    def fill_bitmask(self, row: Any) -> None:
        """Write this state's allowed tokens into `row`, a contiguous int32 CPU tensor of
        ceil(vocab.size / 32) or more words: bit j of word w set means token 32 * w + j is
        allowed; every other bit is cleared. EOS is allowed exactly where the grammar may end.
        Does not change the state."""

    @abstractmethod
    def advance(self, token_id: int) -> None:
        """Move past `token_id`; `ValueError` if the grammar does not allow it here (the state
        is then unusable: the request fails)."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last `n` advances (at most MAX_FORCED_BYTES)."""

    @property
    @abstractmethod
    def is_final(self) -> bool:
        """Whether the text so far is a whole match (EOS is allowed here)."""

    @abstractmethod
    def forced_tokens(self) -> tuple[int, ...]:
        """Tokens spelling the string the grammar forces next (empty if none, or if this
        vocabulary does not support finding forced strings; see `jump_forward`)."""

    @abstractmethod
    def allowed_tokens(self) -> list[int]:
        """The token ids `fill_bitmask` allows (for tests; slow)."""

    # Batch forms, for a step's rows of one backend. A backend whose library fills masks or
    # advances matchers many at a time, in native threads with the GIL released, overrides
    # them; these loop.
    @classmethod
    def fill_many(cls, matchers: Sequence[GrammarMatcher], buf: Any, rows: Sequence[int]) -> None:
        """`matchers[i].fill_bitmask(buf[rows[i]])` for every i: `buf` is a contiguous int32 CPU
        tensor of exactly `ceil(vocab.size / 32)` words a row; the matchers are of this class."""
        for m, r in zip(matchers, rows):
            m.fill_bitmask(buf[r])

    @classmethod
    def fills_natively(cls, n: int) -> bool:
        """Whether `fill_many` of `n` rows runs in the library's native threads with the GIL
        released throughout, so that a thread filling them leaves the scheduler's thread free
        to run Python beside it. Not a Python loop over rows: each row would wait for the GIL
        again (measured on 2 cores beside a busy thread: llguidance's per-row fill goes from
        about 4 to 140 us a row)."""
        return False

    @classmethod
    def advance_many(
        cls, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
    ) -> list[str | None]:
        """`matchers[i].advance(tokens[i])` for every i; the error of each that refused its
        token (its state is then unusable), None for each that took it."""
        errors: list[str | None] = []
        for m, t in zip(matchers, tokens):
            try:
                m.advance(t)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        return errors


def schemas_of(kind: str, spec: Any) -> list[Any]:
    """The JSON schemas a constraint holds: a json_schema's own, a structural tag's
    structures'; none for other kinds."""
    if kind == "json_schema":
        return [json_spec(kind, spec)]
    if kind == "structural_tag":
        return [s["schema"] for s in structural_tag(spec)["structures"]]
    return []


class GrammarBackend(ABC):
    """One grammar library over one tokenizer's vocabulary.

    `kinds` are the constraint kinds it compiles. Its compiles run in a compile worker
    process, killed when one overruns its time limit (see `compile_pool`: each library has
    inputs that take minutes, or crash the process). The worker protocol: `worker_payload()`
    (bytes, sent once) -> `worker_load` in the worker -> `worker_build(state, kind, spec)` per
    task, returning a picklable artifact -> `load` here. `build` does it all in this thread
    (tests, benchmarks)."""

    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]]

    @classmethod
    def refusal(cls, kind: str, spec: Any) -> str | None:
        """Why this backend cannot enforce (kind, spec), checked spec, or None if it can (it
        may still fail to compile). Cheap: needs no vocabulary."""
        if kind not in cls.kinds:
            return f"{kind}: the {cls.name} grammar backend does not take {kind} constraints"
        for schema in schemas_of(kind, spec):
            why = counted_open_object(schema)
            if why is not None:
                return f"{kind}: {why}"
        return None

    @abstractmethod
    def __init__(self, vocab: TokenVocab, mapping: dict[bytes, list[int]]) -> None:
        """Build the backend's own view of the vocabulary (`token_vocab`'s results)."""

    def build(self, kind: str, spec: Any) -> CompiledGrammar:
        """Compile in this thread, with no time limit; `ValueError` naming the field if it
        cannot be compiled."""
        state = self.worker_load(self.worker_payload())
        return self.load(kind, spec, self.worker_build(state, kind, spec))

    @abstractmethod
    def worker_payload(self) -> bytes:
        """What a compile worker needs of this backend's vocabulary view."""

    @staticmethod
    @abstractmethod
    def worker_load(payload: bytes) -> Any:
        """In the worker: its state, from `worker_payload`'s bytes."""

    @staticmethod
    @abstractmethod
    def worker_build(state: Any, kind: str, spec: Any) -> Any:
        """In the worker: the artifact of a checked (kind, spec); `ValueError` naming the field
        if it cannot be compiled."""

    @abstractmethod
    def load(self, kind: str, spec: Any, artifact: Any) -> CompiledGrammar:
        """The compiled grammar of a worker's artifact; `ValueError` if it is refused here."""


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary with `backend` (a name in
    `GRAMMAR_BACKENDS`), falling back as the module docstring says (unless `fallback` is
    False: then what `backend` cannot enforce is refused; for measuring one backend alone);
    compiled grammars are kept in a bounded LRU keyed by (kind, spec). Thread-safe."""

    def __init__(
        self, tokenizer, backend: str, max_entries: int = 256, *, fallback: bool = True
    ) -> None:
        if backend not in GRAMMAR_BACKENDS:
            get_grammar_backend(backend)  # raises the registry's ValueError
        self.backend = backend
        self.fallback = fallback
        self.vocab, self._mapping = token_vocab(tokenizer)
        self.eos_token_id = self.vocab.eos_token_id
        self.max_entries = max_entries
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.hits = self.misses = 0

    def candidates(self, kind: str, spec: Any) -> Iterator[str]:
        """The backends to try for (kind, spec), in order: the configured one if it may enforce
        it, then those in FALLBACK_ORDER that may (each may still refuse when compiling: then
        the next is tried). The first is found before this returns; each later one only when
        the caller asks for it, so a backend is imported only once those before it refused
        (importing xgrammar imports transformers: seconds of Python holding the scheduler
        process's GIL). `ValueError` naming the field if the spec is malformed or no backend
        can enforce it."""
        spec = check_spec(kind, spec)
        order = (self.backend, *FALLBACK_ORDER) if self.fallback else (self.backend,)
        names, reasons = iter(dict.fromkeys(order)), []
        first = self._next_candidate(kind, spec, names, reasons)
        if first is None:
            if len(reasons) == 1:
                raise ValueError(reasons[0])
            raise ValueError(f"{reasons[0]}; no other grammar backend can enforce it either")

        def each() -> Iterator[str]:
            name = first
            while name is not None:
                yield name
                name = self._next_candidate(kind, spec, names, reasons)

        return each()

    @staticmethod
    def _next_candidate(
        kind: str, spec: Any, names: Iterator[str], reasons: list[str]
    ) -> str | None:
        """The next of `names` whose backend is installed and may enforce (kind, spec), or None;
        each one passed over adds its reason to `reasons`."""
        for name in names:
            try:
                reason = get_grammar_backend(name).refusal(kind, spec)
            except ImportError as e:
                reason = f"{kind}: the {name} grammar backend is not installed ({e})"
            except Exception as e:  # a later one is looked at while compiling: never raise there
                reason = f"{kind}: the {name} grammar backend failed ({type(e).__name__}: {e})"
            if reason is None:
                return name
            reasons.append(reason)
        return None

    def get_backend(self, name: str) -> GrammarBackend:
        """The backend `name` over this vocabulary, built on first use (holds the build lock:
        building one takes up to a second)."""
        backend = self._backends.get(name)
        if backend is None:
            with self._build_lock:
                backend = self._backends.get(name)
                if backend is None:
                    backend = get_grammar_backend(name)(self.vocab, self._mapping)
                    self._backends[name] = backend
        return backend

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
        """The compiled grammar, from the cache or built now in this thread, with no time limit
        and no worker (`AsyncGrammarCompiler` is the scheduler's way); `ValueError` naming the
        field if no backend compiles it (the first backend's error)."""
        hit = self.cached(kind, spec)
        if hit is not None:
            return hit
        names, checked = self.candidates(kind, spec), check_spec(kind, spec)
        errors = []
        for name in names:
            try:
                return self.add(kind, spec, self.get_backend(name).build(kind, checked))
            except ValueError as e:
                if matches_nothing(str(e)):
                    raise  # the spec's fault: no other backend would do better
                errors.append(e)
        raise errors[0]

    def add(self, kind: str, spec: Any, grammar: CompiledGrammar) -> CompiledGrammar:
        """Cache `grammar`, compiled for (kind, spec) (counts as a miss), and return it, with
        its `unsatisfiable` found first (one mask: a cached grammar is never checked again)."""
        grammar.unsatisfiable = start_refusal(grammar, self.vocab)
        with self._lock:
            self.misses += 1
            self._cache[grammar_key(kind, spec)] = grammar
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return grammar


def start_refusal(grammar: CompiledGrammar, vocab: TokenVocab) -> str | None:
    """Why no output can satisfy `grammar`, judged from the mask of its first step, or None:
    no token is allowed there (so it cannot end either), or, for a JSON schema, nothing but to
    end (an empty output is never JSON). Either way every request with it would fail at its
    first token. (A grammar that starts well and turns out to allow nothing later, such as a
    recursion without a base case below an object, is not found here.)"""
    import torch  # not at import: the compile workers import this module

    words = (vocab.size + 31) // 32
    row = torch.zeros(words, dtype=torch.int32)
    grammar.matcher().fill_bitmask(row)
    ids = torch.arange(words * 32)
    allowed = ids[((row[ids >> 5] >> (ids & 31)) & 1).bool()].tolist()
    if not allowed:
        return f"{grammar.kind}: {NO_OUTPUT}"
    if grammar.kind == "json_schema" and not any(vocab.token_bytes.get(t) for t in allowed):
        return f"{grammar.kind}: {NO_OUTPUT} (only the empty one, which is not JSON)"
    return None


def to_regex(kind: str, spec: Any) -> str:
    """The regex outlines-core would compile for a json_schema, regex or choice constraint
    (tests compare outputs with it); `ValueError` naming the field if there is none."""
    from braid.runtime.constrained.outlines_backend import to_regex as outlines_regex

    return outlines_regex(kind, check_spec(kind, spec))
