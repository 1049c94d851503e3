"""Constraint specs: their kinds, the checks every backend shares, and cache keys. Imports
nothing heavy: `SamplingParams` checks specs with it in the front end, and compile workers
import it.

A spec is checked here for what does not depend on the grammar backend (JSON that parses, the
shape of a structural tag, a regex Python can read); what a backend can enforce is its own
`GrammarBackend.refusal`, and a grammar that does not compile fails at compile time. Both are
`ValueError`s whose message starts with the constraint's field name; the checks here raise
`ParamError`s, which name it as data too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from braid.runtime.errors import ParamError

KINDS = ("json_schema", "regex", "choice", "ebnf", "lark", "structural_tag")

# A line that starts a Lark grammar (its `start` rule or an llguidance directive); EBNF (GBNF)
# grammars define rules with `::=` instead.
_LARK_START = re.compile(r"(?m)^\s*(%llguidance\b|[?!]?start\s*:)")


def check_spec(kind: str, spec: Any) -> Any:
    """`spec` in its stored form (a JSON schema or structural tag as JSON text, choices as a
    tuple); a `ParamError` naming the field if it is malformed."""
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ParamError.at("regex", "must be a non-empty string")
        try:
            re.compile(spec)
        except re.error as e:
            raise ParamError.at("regex", f"invalid pattern: {e}") from None
        return spec
    if kind == "choice":
        if (
            not isinstance(spec, (list, tuple))
            or not spec
            or not all(isinstance(c, str) and c for c in spec)
        ):
            raise ParamError.at("choice", "must be a non-empty list of non-empty strings")
        return tuple(spec)
    if kind == "json_schema":
        schema = _json_value(kind, spec)
        if schema is True:
            return "{}"  # any JSON value, as the schema {} says
        if schema is False:
            raise ParamError.at("json_schema", "false matches nothing")
        if not isinstance(schema, dict):
            raise ParamError.at("json_schema", "must be a JSON object (or true)")
        return spec if isinstance(spec, str) else json.dumps(spec)
    if kind in ("ebnf", "lark"):
        if not isinstance(spec, str) or not spec.strip():
            raise ParamError.at(kind, "must be a non-empty grammar string")
        return spec
    if kind == "structural_tag":
        return json.dumps(structural_tag(spec))
    raise ValueError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")


def grammar_key(kind: str, spec: Any) -> tuple[str, str]:
    """The cache key of a constraint: equal specs (dicts in any key order) give equal keys."""
    if isinstance(spec, str):
        return kind, spec
    return kind, json.dumps(list(spec) if isinstance(spec, tuple) else spec, sort_keys=True)


def json_spec(kind: str, spec: Any) -> Any:
    """A JSON-valued spec (a schema or a structural tag) as a Python value."""
    return json.loads(spec) if isinstance(spec, str) else spec


def _json_value(kind: str, spec: Any) -> Any:
    if isinstance(spec, str):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise ParamError.at(kind, f"not valid JSON: {e}") from None
    try:
        json.dumps(spec)
    except (TypeError, ValueError) as e:
        raise ParamError.at(kind, f"not a JSON value: {e}") from None
    return spec


def structural_tag(spec: Any) -> dict[str, Any]:
    """SGLang's structural tag (`{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`, the `type` optional) checked, as {"structures", "triggers"}.

    Outside the structures the text is free. Where the text reaches a trigger it must go on
    with the `begin` of a structure that starts with that trigger, then a JSON value of that
    structure's schema (any JSON object when it has none), then its `end`."""
    value = _json_value("structural_tag", spec)
    if not isinstance(value, dict):
        raise ParamError.at("structural_tag", "must be an object with structures and triggers")
    unknown = set(value) - {"type", "structures", "triggers"}
    if unknown:
        raise ParamError.at(
            "structural_tag",
            f"unknown field(s) {sorted(unknown)} (braid takes SGLang's shape: "
            "type, structures, triggers)",
        )
    if value.get("type", "structural_tag") != "structural_tag":
        raise ParamError.at(
            "structural_tag", f"type must be 'structural_tag', got {value['type']!r}"
        )
    triggers = value.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise ParamError.at(
            "structural_tag.triggers", "must be a non-empty list of non-empty strings"
        )
    structures = value.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ParamError.at("structural_tag.structures", "must be a non-empty list")
    out = []
    for i, s in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"}:
            raise ParamError.at(where, "must be an object with begin, schema and end")
        begin, end, schema = s.get("begin"), s.get("end"), s.get("schema")
        if not isinstance(begin, str) or not begin:
            raise ParamError.at(f"{where}.begin", "must be a non-empty string")
        if not isinstance(end, str):
            raise ParamError.at(f"{where}.end", "must be a string")
        if schema is None:
            schema = {"type": "object"}
        elif schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ParamError.at(f"{where}.schema", "must be a JSON schema object (or true)")
        if not any(begin.startswith(t) for t in triggers):
            raise ParamError.at(f"{where}.begin", f"{begin!r} starts with none of the triggers")
        out.append({"begin": begin, "schema": schema, "end": end})
    return {"structures": out, "triggers": list(triggers)}


def trigger_of(begin: str, triggers: list[str]) -> str:
    """The longest trigger `begin` starts with (`structural_tag` checked there is one)."""
    return max((t for t in triggers if begin.startswith(t)), key=len)


def is_lark(grammar: str) -> bool:
    """Whether a grammar string (vLLM's `grammar` field, which takes either) is Lark rather
    than EBNF."""
    return _LARK_START.search(grammar) is not None and "::=" not in grammar


def regex_of_choices(choices: tuple[str, ...] | list[str]) -> str:
    """A regex matching exactly one of `choices`, escaped for every backend's dialect (Python,
    Rust's regex crate, xgrammar): only metacharacters get a backslash."""
    return "(" + "|".join(_escape(c) for c in choices) + ")"


_META = frozenset("\\.^$|?*+()[]{}")


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in _META else ch for ch in text)
