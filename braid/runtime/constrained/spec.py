"""Constraint specs: their kinds, cache keys and regexes, and the outlines-core index built
from one. Imports no torch, so that a compile worker process (`compile_worker`) starts light."""

from __future__ import annotations

import json
import re
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


def grammar_key(kind: str, spec: Any) -> tuple[str, str]:
    """The cache key of a constraint: equal specs (dicts in any key order) give equal keys."""
    return kind, spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)


def build_index(kind: str, spec: Any, vocabulary: Vocabulary) -> Index:
    """The token index of a constraint over `vocabulary`; `ValueError` naming the field if the
    spec is bad or outlines-core cannot build an automaton for it. Releases the GIL while
    outlines-core builds, and may take minutes on a pathological spec."""
    regex = to_regex(kind, spec)
    try:
        return Index(regex, vocabulary)
    except Exception as e:  # e.g. a regex outlines-core cannot turn into an automaton
        raise ValueError(f"{kind}: cannot be compiled: {e}") from None
