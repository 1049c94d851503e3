"""The language's intermediate representation: plain-data nodes that a program appends to its
state (`s += gen("x")`), and the sampling arguments every backend receives.

Nodes carry no behaviour beyond `+` (which builds a `Seq`): the interpreter runs them, the
tracer records them, the backends never see them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# The texts `gen(dtype=...)` constrains to. Generation stops when the pattern cannot grow.
REGEX_INT = r"[-+]?[0-9]{1,18}"
REGEX_FLOAT = r"[-+]?[0-9]{1,18}(\.[0-9]{1,12})?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[^\"\\\n]{0,200}\""

DTYPE_REGEX: dict[type, str] = {
    int: REGEX_INT,
    float: REGEX_FLOAT,
    bool: REGEX_BOOL,
    str: REGEX_STR,
}

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingArgs:
    """The sampling keyword arguments of `gen`, `run` and `run_batch`, defined once.

    Every field is optional: None means "not given here", so a gen's arguments can be laid
    over the run's (`over`). Names are braid's (vLLM's); `max_new_tokens` is accepted as SGLang's
    name for `max_tokens` where a user passes keywords (`from_kwargs`)."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], where: str) -> SamplingArgs:
        """Sampling arguments from keywords; `ValueError` naming an unknown keyword."""
        kw = dict(kwargs)
        if "max_new_tokens" in kw:
            if kw.get("max_tokens") is not None:
                raise ValueError(f"{where}: give max_tokens or max_new_tokens, not both")
            kw["max_tokens"] = kw.pop("max_new_tokens")
        unknown = sorted(set(kw) - SAMPLING_FIELDS)
        if unknown:
            raise ValueError(
                f"{where}: unknown sampling argument(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}"
            )
        return cls(**kw)

    def over(self, base: SamplingArgs) -> SamplingArgs:
        """These arguments where given, `base`'s elsewhere."""
        return SamplingArgs(
            **{
                f: getattr(self, f) if getattr(self, f) is not None else getattr(base, f)
                for f in SAMPLING_FIELDS
            }
        )

    def given(self) -> dict[str, Any]:
        """The fields that are set, by name."""
        return {f: getattr(self, f) for f in SAMPLING_FIELDS if getattr(self, f) is not None}


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingArgs))


class Expr:
    """Something a program can append to its state. `a + b` appends both, in order."""

    def __add__(self, other: Any) -> Seq:
        return Seq((self, as_expr(other)))

    def __radd__(self, other: Any) -> Seq:
        return Seq((as_expr(other), self))


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Seq(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text into variable `name` (None: unnamed), constrained by at most one of
    `regex`, `json_schema`; `dtype` converts the stored value (the text is constrained by
    the dtype's regex)."""

    name: str | None
    sampling: SamplingArgs
    regex: str | None = None
    json_schema: str | dict | None = None
    dtype: type | None = None

    @property
    def constraint(self) -> tuple[str, Any] | None:
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        return None


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Choose one of `choices` by their log-probabilities after the current text."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    method: Any  # a braid.lang.choices.ChoicesMethod


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class Image(Expr):
    """An image in the prompt: a path, a URL, or raw bytes."""

    source: str | bytes


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class Arg(Expr):
    """While tracing: the value of the program argument `name`, unknown until run."""

    name: str


@dataclass(frozen=True, eq=False)
class VarRef(Expr):
    """While tracing: the value of the variable `name`, generated at run time."""

    name: str


ROLES = ("system", "user", "assistant")


def as_expr(value: Any) -> Expr:
    """What appending `value` means; `ValueError` for things a program cannot append."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Text(str(value))
    raise ValueError(
        f"cannot append a {type(value).__name__} to a program state: append text, gen(...), "
        "select(...), a role, or image(...)"
    )


def flatten(expr: Expr) -> list[Expr]:
    """`expr` as the list of leaf nodes it appends, in order."""
    if isinstance(expr, Seq):
        out: list[Expr] = []
        for item in expr.items:
            out += flatten(item)
        return out
    return [expr]
