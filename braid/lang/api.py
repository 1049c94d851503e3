"""The constructors a program is written with: `gen`, `select`, roles, `image`, and the
`@function` decorator. SGLang's names and signatures, so `import braid as sgl` runs SGLang
programs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from braid.lang.choices import ChoicesMethod, token_length_normalized
from braid.lang.ir import (
    ROLES,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    SamplingArgs,
    Select,
    Seq,
    as_expr,
)
from braid.lang.program import Program


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None, **opts):
    """Decorate a program: `@function` or `@function(...)`. The first parameter is the state."""
    del num_api_spec_tokens  # accepted for SGLang compatibility; braid needs no hint
    if opts:
        raise ValueError(f"function: unknown option(s) {sorted(opts)}")
    if func is None:
        return lambda f: Program(f)
    return Program(func)


def gen(
    name: str | None = None,
    *,
    dtype: type | None = None,
    choices: list[str] | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    **sampling: Any,
) -> Expr:
    """Generate into variable `name`. Sampling keywords are `SamplingArgs`' fields
    (`max_tokens`, `stop`, `temperature`, ...). `dtype` in (int, float, str, bool) constrains
    the text and converts the value; `choices` makes it a `select`; `regex` / `json_schema`
    constrain the text (at most one constraint)."""
    args = SamplingArgs.from_kwargs(sampling, f"gen({name!r})")
    if choices is not None:
        if regex is not None or json_schema is not None or dtype is not None:
            raise ValueError(
                f"gen({name!r}): choices cannot be combined with regex/json_schema/dtype"
            )
        temperature = 0.0 if args.temperature is None else args.temperature
        return select(name, choices=choices, temperature=temperature)
    given = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("dtype", dtype)) if v]
    if len(given) > 1:
        raise ValueError(f"gen({name!r}): give only one of {given}")
    if dtype is not None and dtype not in (int, float, str, bool):
        raise ValueError(f"gen({name!r}): dtype must be int, float, str or bool, got {dtype!r}")
    if regex is not None or json_schema is not None:
        from braid.runtime.constrained.grammar import to_regex

        to_regex("regex", regex) if regex is not None else to_regex("json_schema", json_schema)
    return Gen(name, args, regex, json_schema, dtype)


def gen_int(name: str | None = None, **sampling: Any) -> Expr:
    return gen(name, dtype=int, **sampling)


def gen_string(name: str | None = None, **sampling: Any) -> Expr:
    return gen(name, dtype=str, **sampling)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Expr:
    """Choose one of `choices` (scored by log-probability in one batched request) into
    variable `name`."""
    if (
        not isinstance(choices, (list, tuple))
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError(f"select({name!r}): choices must be a non-empty list of non-empty strings")
    if not isinstance(choices_method, ChoicesMethod):
        raise ValueError(f"select({name!r}): choices_method must be one of braid.lang.choices'")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"select({name!r}): temperature must be >= 0, got {temperature!r}")
    return Select(name, tuple(choices), float(temperature), choices_method)


def _role(role: str, expr: Any = None) -> Expr:
    if expr is None:
        return RoleBegin(role)
    return Seq((RoleBegin(role), as_expr(expr), RoleEnd(role)))


def system(expr: Any = None) -> Expr:
    """A system message around `expr` (`s += system("...")`)."""
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def image(source: str | bytes) -> Expr:
    """An image (a path, a URL, or bytes) in the prompt; needs a backend whose model takes
    images."""
    if not isinstance(source, (str, bytes)) or not source:
        raise ValueError("image: give a path, a URL, or the image's bytes")
    return Image(source)


__all__ = [
    "ROLES",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "image",
    "select",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
