"""Constrained decoding: regex, JSON schema and choice constraints compiled with outlines-core
into token-level automata.

- `grammar`: compiled grammars (bounded LRU cache, forced strings); a matcher per request.
- `spec`: spec -> regex -> outlines-core index (no torch: the compile worker imports it).
- `compile_pool`: compiling in worker processes (`compile_worker`), off the scheduler's critical
  path, time-limited; an overrunning compile's worker is killed and replaced.
- `bitmask`: each step's allowed tokens as int32 bitmask rows, applied to the logits.
- `jump_forward`: text a grammar forces, appended without sampling it token by token.
- `vocab`: the tokenizer's vocabulary as bytes.

Grammar backends sit in `GRAMMAR_BACKENDS`, a registry of lazily imported compiler classes,
each built from a tokenizer: "outlines" (outlines-core, `grammar.GrammarCompiler`) for now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.constrained.grammar import GrammarCompiler

GRAMMAR_BACKENDS: Registry[type[GrammarCompiler]] = Registry(
    "grammar_backend", {"outlines": "braid.runtime.constrained.grammar"}
)


def grammar_backend_names() -> list[str]:
    """The names `get_grammar_backend` accepts, sorted; listing them imports no backend."""
    return GRAMMAR_BACKENDS.names()


def get_grammar_backend(name: str) -> type[GrammarCompiler]:
    """The grammar compiler class registered as `name` (built as `cls(tokenizer)`);
    `ValueError` naming the field and the known names if `name` is unknown."""
    return GRAMMAR_BACKENDS.get(name)
