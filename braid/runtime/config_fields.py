"""How a settings field is declared (`setting`) and what its declaration gives: its choices
(`choices_of`, `check_choices`) and the Python spelling of its flags (`python_name`); the check
of positive values (`check_positive`). Used by `EngineConfig` (braid/runtime/config.py), the
server's settings and `braid serve`'s flag generation (braid/runtime/server/cli.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import Field, field, fields
from typing import Any


def setting(
    default: Any,
    doc: str,
    *,
    aliases: Sequence[str] = (),
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    off_flag: str | None = None,
) -> Any:
    """A settings field, declared once: its `default` and its `doc` (the `--help` text; it says
    what an unset value, None, means).

    `aliases`: SGLang's flag names for the field ("--max-total-tokens"); `LLM` accepts their
    Python spelling (`max_total_tokens`) as a keyword too. `choices`: the values it may take,
    either a fixed tuple (the CLI refuses others) or a function returning them (an open
    registry: checked at construction, listed in `--help`); None is allowed besides them when
    the default is None. `off_flag`: SGLang's flag that sets a bool field to False."""
    return field(
        default=default,
        metadata={"doc": doc, "aliases": tuple(aliases), "choices": choices, "off_flag": off_flag},
    )


def choices_of(f: Field) -> list[Any] | None:
    """The values field `f` may take besides None, or None when any value of its type goes."""
    choices = f.metadata.get("choices")
    if choices is None:
        return None
    return list(choices() if callable(choices) else choices)


def check_choices(settings: Any) -> None:
    """`ValueError` for a field of the settings dataclass whose value is not one of its
    choices (None passes where the default is None)."""
    for f in fields(settings):
        allowed, v = choices_of(f), getattr(settings, f.name)
        if allowed is not None and not (v is None and f.default is None) and v not in allowed:
            none = "None or " if f.default is None else ""
            raise ValueError(f"{f.name} must be {none}one of {allowed}, got {v!r}")


def check_positive(
    settings: Any, *names: str, integer: bool = False, optional: bool = False
) -> None:
    """`ValueError` for the first of the fields `names` that is not a positive number (an
    integer with `integer`; None passes with `optional`)."""
    kinds = (int,) if integer else (int, float)
    for name in names:
        v = getattr(settings, name)
        if optional and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, kinds) or not v > 0:
            what = "integer" if integer else "number"
            none = " or None" if optional else ""
            raise ValueError(f"{name} must be a positive {what}{none}, got {v!r}")


def python_name(flag: str) -> str:
    """A flag's Python spelling: "--max-total-tokens" -> "max_total_tokens"."""
    return flag.lstrip("-").replace("-", "_")
