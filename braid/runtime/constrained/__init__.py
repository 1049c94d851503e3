"""Constrained decoding: regex, JSON schema, choice, EBNF, Lark and structural-tag constraints,
compiled by a grammar backend into a matcher that writes each step's allowed-token bitmask.

- `spec`: constraint kinds, the checks every backend shares, cache keys (no heavy imports).
- `grammar`: the backend interface (`GrammarBackend`, `CompiledGrammar`, `GrammarMatcher`) and
  `GrammarCompiler`, which routes each constraint to a backend that can enforce it and caches
  compiled grammars.
- `schema_support`: which JSON Schema keywords a backend enforces; a schema using one it would
  ignore is refused (or routed), never compiled into a looser grammar.
- `outlines_backend`, `xgrammar_backend`, `llguidance_backend`: the three backends.
- `compile_pool`: compiling off the scheduler's critical path, time-limited; compiles that can
  run for minutes run in worker processes (`compile_worker`) that are killed when they
  overrun, bounded ones on the pool's threads.
- `bitmask`: each step's allowed tokens as int32 bitmask rows, applied to the logits.
- `jump_forward`: text a grammar forces, appended without sampling it token by token.
- `vocab`: the tokenizer's vocabulary as bytes.

Grammar backends sit in `GRAMMAR_BACKENDS`, a registry of lazily imported `GrammarBackend`
classes, each built over a tokenizer's vocabulary by the `GrammarCompiler`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.constrained.grammar import GrammarBackend

GRAMMAR_BACKENDS: Registry[type[GrammarBackend]] = Registry(
    "grammar_backend",
    {
        "llguidance": "braid.runtime.constrained.llguidance_backend",
        "outlines": "braid.runtime.constrained.outlines_backend",
        "xgrammar": "braid.runtime.constrained.xgrammar_backend",
    },
)


def grammar_backend_names() -> list[str]:
    """The names `get_grammar_backend` accepts, sorted; listing them imports no backend."""
    return GRAMMAR_BACKENDS.names()


def get_grammar_backend(name: str) -> type[GrammarBackend]:
    """The grammar backend class registered as `name`; `ValueError` naming the field and the
    known names if `name` is unknown, `ImportError` if its library is not installed."""
    return GRAMMAR_BACKENDS.get(name)
