"""The language's intermediate representation: plain-data nodes that a program appends to its
state (`s += gen("x")`), and the sampling arguments every backend receives.

Nodes carry no behaviour beyond `+` (which builds a `Seq`): the interpreter runs them, the
tracer records them, the backends never see them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from braid.runtime.errors import ParamError
from braid.runtime.sampling_params import SamplingParams

# SGLang's patterns, for programs that pass them as `regex=` (with stop=[" ", "\n"], as its
# examples do): a number may end with spaces or newlines.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
# A JSON string without escapes: any character but the quote, the backslash and control
# characters (SGLang's REGEX_STR, `"[\w\d\s]*"`, refuses punctuation and lets tabs through,
# which JSON does not allow).
REGEX_STR = r'"[^"\\\x00-\x1f]*"'


@dataclass(frozen=True)
class DtypeRule:
    """How `gen(dtype=...)` constrains and ends a typed value.

    A number may be followed by whatever the model writes next (" hours", ".", "\n"): the
    first character that cannot continue the number (`stop_regex` matches the last digit and
    it) ends the gen, and `value` takes the number from the text. A model that splits digits
    into single tokens (SmolLM2) would otherwise have to choose between a bare space token and
    one more digit, and writes 240000000000. Strings and booleans end by themselves; a string
    that max_tokens cuts off is closed."""

    regex: str
    value: str  # the typed text, matched at the start of what was generated
    stop_regex: str | None = None
    # Appended to a value cut off by max_tokens before it ended (a string's closing quote), so
    # the text stays a literal of its type (a JSON document built from it stays valid).
    close: str = ""


_INT = r"[-+]?[0-9]+"
_FLOAT = r"[-+]?([0-9]+(\.[0-9]+)?|\.[0-9]+)"
DTYPE_RULES: dict[type, DtypeRule] = {
    int: DtypeRule(_INT + r"([^0-9].*)?", _INT, r"[0-9][^0-9]"),
    float: DtypeRule(_FLOAT + r"([^0-9.].*)?", _FLOAT, r"[0-9][^0-9.]"),
    bool: DtypeRule(REGEX_BOOL, REGEX_BOOL),
    str: DtypeRule(REGEX_STR, REGEX_STR, close='"'),
}
DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingArgs:
    """The sampling keyword arguments of `gen`, `run` and `run_batch`, defined once.

    Every field is optional: None means "not given here", so a gen's arguments can be laid
    over the run's (`over`). Names are SGLang's frontend names (vLLM's `max_tokens`; SGLang's
    `max_new_tokens` / `min_new_tokens` are accepted where a user passes keywords,
    `from_kwargs`). `n` samples several completions (the variable is then their list);
    `return_logprob` adds the output tokens' log-probabilities to the meta info,
    `top_logprobs_num` the most likely alternatives at each, `logprob_start_len` the prompt's
    from that position (`input_token_logprobs`). `seed` (vLLM's and OpenAI's name) makes a
    gen's sampling reproducible: which random draws it gets no longer depends on the order
    requests reach the runtime in (without it, each request takes the next seed of the
    runtime's stream); the samples of `n > 1` get seeds derived from it. A seed given to `run`
    (or by `sampling_defaults`) gives each gen of the run a seed derived from it and the gen's
    place in the run (its fork branch and call position), so a fork's branches sample
    independently and the run repeats exactly; a gen's own `seed` is sent as it is."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    seed: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], where: str) -> SamplingArgs:
        """Sampling arguments from keywords; `ValueError` naming an unknown keyword, or a
        value of `CHECKED_WHEN_GIVEN` that the runtime refuses (`check_sampling_values`)."""
        kw = dict(kwargs)
        for alias, name in SAMPLING_ALIASES.items():
            if alias in kw:
                if kw.get(name) is not None:
                    raise ValueError(f"{where}: give {name} or {alias}, not both")
                kw[name] = kw.pop(alias)
        unknown = sorted(set(kw) - SAMPLING_FIELDS)
        if unknown:
            raise ValueError(
                f"{where}: unknown sampling argument(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}"
            )
        check_sampling_values(
            {k: kw[k] for k in CHECKED_WHEN_GIVEN if kw.get(k) is not None}, where
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

    def with_stop_regex(self, pattern: str | None) -> SamplingArgs:
        """These arguments with `pattern` added to `stop_regex`."""
        if pattern is None:
            return self
        given = self.stop_regex
        patterns = [given] if isinstance(given, str) else list(given or [])
        return dataclasses.replace(self, stop_regex=[*patterns, pattern])


# SGLang's keyword names -> braid's.
SAMPLING_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingArgs))
# The sampling arguments the runtime's `SamplingParams` judges each on its own (not against
# another field, nor one the run may still give): refused where they are given, so a bad value
# fails at `gen(...)`, `run(...)` or `sampling_defaults(...)`, not when a gen runs. (A run's
# seed is not sent, only seeds derived from it, but it is held to the same rule.)
CHECKED_WHEN_GIVEN = ("n", "temperature", "seed")


def check_sampling_values(values: dict[str, Any], where: str) -> None:
    """A `ParamError` (a `ValueError`) naming the first of `values` (`SamplingParams` fields,
    each judged alone) that the runtime's `SamplingParams` refuses, its message after `where`:
    the same rule as when a gen runs, applied when the value is given. While tracing, a
    program argument that is still unknown passes (it is checked when the program runs)."""
    from braid.lang.tracer import TRACING  # here: the tracer imports this module

    tracing = TRACING.get() is not None
    for name, value in values.items():
        if tracing and isinstance(value, Expr):
            continue
        try:
            SamplingParams(**{name: value})
        except ParamError as e:
            raise ParamError(name, f"{where}: {e}") from None


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
    `regex`, `json_schema`, `ebnf`; `dtype` converts the stored value (the text is constrained
    by the dtype's regex)."""

    name: str | None
    sampling: SamplingArgs
    regex: str | None = None
    json_schema: str | dict | None = None
    dtype: type | None = None
    ebnf: str | None = None

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """(kind, spec) as the backends send it (a `SamplingParams` field and its value)."""
        for kind in ("regex", "json_schema", "ebnf"):
            if getattr(self, kind) is not None:
                return (kind, getattr(self, kind))
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
    """An image in the prompt: a `Path`, bytes, a PIL image, or an http(s) / data URL (as
    `braid.lang.images.check_source` returns it)."""

    source: Any


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class SeparateReasoning(Expr):
    """After the gens named in `names` have run, split each one's text into its reasoning
    (variable `<name>_reasoning_content`) and its answer (the variable and the program text keep
    the answer only), with the reasoning format of `model_type` ("deepseek-r1", "qwen3")."""

    model_type: str | None
    names: tuple[str, ...]


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
