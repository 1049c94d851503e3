"""The constructors a program is written with: `gen`, `select`, roles, `image`,
`separate_reasoning`, and the `@function` decorator; plus SGLang's module-level helpers
(`flush_cache`, `get_server_info`). SGLang's names, signatures and positional order, so
`import braid as sgl` runs SGLang programs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from braid.lang.choices import ChoicesSamplingMethod, token_length_normalized
from braid.lang.images import check_source
from braid.lang.ir import (
    DTYPE_NAMES,
    ROLES,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    SamplingArgs,
    Select,
    SeparateReasoning,
    Seq,
    as_expr,
    check_sampling_values,
    flatten,
)
from braid.lang.program import Program


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None, **opts):
    """Decorate a program: `@function` or `@function(...)`. The first parameter is the state.
    `num_api_spec_tokens` (SGLang's API speculative execution for OpenAI models) is accepted
    and ignored: braid sends every gen as its own request."""
    del num_api_spec_tokens
    if opts:
        raise ValueError(f"function: unknown option(s) {sorted(opts)}")
    if func is None:
        return lambda f: Program(f)
    return Program(func)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    ebnf: str | None = None,
    **extra: Any,
) -> Expr:
    """Generate into variable `name` (SGLang's `gen`, same parameters in the same order).

    The variable is the generated text (a list of texts with `n > 1`). `dtype` in (int,
    float, str, bool, or their names) constrains the text to a literal of that type, whose
    converted value `state.get_value(name)` returns; `regex` / `json_schema` / `ebnf` (a GBNF
    grammar, root rule `root`) constrain it (at most one constraint); `choices` makes it a
    `select`, which takes only `temperature`, `choices_method` and `return_logprob=True` (any
    other argument is a `ValueError`). `max_tokens=0` generates nothing. A bad `n`,
    `temperature` or `seed` is a `ValueError` here, not when the gen runs.
    `max_new_tokens` / `min_new_tokens` are accepted as SGLang's names; any other keyword is a
    `ValueError`."""
    where = f"gen({name!r})"
    given = {
        k: v
        for k, v in dict(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            n=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            stop_regex=stop_regex,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        ).items()
        if v is not None
    }
    args = SamplingArgs.from_kwargs({**given, **extra}, where)
    constraints = (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf))
    if choices is not None:
        if any(v is not None for _, v in constraints) or dtype is not None:
            raise ValueError(
                f"{where}: choices cannot be combined with regex/json_schema/ebnf/dtype"
            )
        _refuse_unused_by_select({**given, **extra}, where)
        t = 0.0 if args.temperature is None else args.temperature
        return select(name, choices=choices, temperature=t, choices_method=choices_method)
    if choices_method is not None:
        raise ValueError(f"{where}: choices_method needs choices")
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{where}: dtype must be int, float, str or bool, got {dtype!r}")
        dtype = DTYPE_NAMES[dtype]
    named = [k for k, v in (*constraints, ("dtype", dtype)) if v is not None]
    if len(named) > 1:
        raise ValueError(f"{where}: give only one of {named}")
    if dtype is not None and dtype not in (int, float, str, bool):
        raise ValueError(f"{where}: dtype must be int, float, str or bool, got {dtype!r}")
    _check_args(args, where)
    for kind, spec in constraints:
        if spec is not None:
            from braid.runtime.constrained.spec import check_spec

            check_spec(kind, spec)  # a malformed spec fails here, naming the field
    return Gen(name, args, regex, json_schema, dtype, ebnf)


def _refuse_unused_by_select(given: dict[str, Any], where: str) -> None:
    """A gen with `choices` is a `select`, which takes `temperature` (and `choices_method`) and
    nothing else: it scores the choices in one request, so no sampling argument applies, and
    its meta info holds the choices' logprobs whether asked or not (`return_logprob=True`
    changes nothing; False cannot be honoured). `ValueError` naming what it cannot honour."""
    unused = sorted(
        k
        for k, v in given.items()
        if k != "temperature" and not (k == "return_logprob" and v is True)
    )
    if unused:
        raise ValueError(
            f"{where}: with choices, gen is a select, which takes only temperature and "
            f"choices_method (its meta info always holds the choices' logprobs); it cannot "
            f"honour {unused}: drop them, or gen without choices"
        )


def _check_args(args: SamplingArgs, where: str) -> None:
    """The checks of a gen's own arguments that `SamplingArgs.from_kwargs` leaves (the rest are
    checked by the runtime's `SamplingParams` when the gen runs)."""
    top = args.top_logprobs_num
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
        raise ValueError(f"{where}: top_logprobs_num must be an integer >= 0, got {top!r}")


def gen_int(name: str | None = None, max_tokens: int | None = None, **sampling: Any) -> Expr:
    """`gen(name, dtype=int)`: the text is an integer; `state.get_value(name)` is the int."""
    return gen(name, max_tokens, dtype=int, **sampling)


def gen_string(name: str | None = None, max_tokens: int | None = None, **sampling: Any) -> Expr:
    """`gen(name, dtype=str)`: the text is a double-quoted string."""
    return gen(name, max_tokens, dtype=str, **sampling)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod | None = token_length_normalized,
) -> Expr:
    """Choose one of `choices` (scored by log-probability in one batched request) into
    variable `name`. `choices_method` is any `ChoicesSamplingMethod` (SGLang's protocol);
    `temperature > 0` samples among the choices by the method's scores (braid's methods); a
    temperature that is not a finite number >= 0 is a `ValueError` (the runtime's rule)."""
    if (
        not isinstance(choices, (list, tuple))
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError(f"select({name!r}): choices must be a non-empty list of non-empty strings")
    method = token_length_normalized if choices_method is None else choices_method
    if not isinstance(method, ChoicesSamplingMethod):
        raise ValueError(
            f"select({name!r}): choices_method must be a braid.lang.choices."
            f"ChoicesSamplingMethod, got {type(method).__name__}"
        )
    check_sampling_values({"temperature": temperature}, f"select({name!r})")
    if temperature > 0 and not hasattr(method, "sample"):
        raise ValueError(
            f"select({name!r}): temperature > 0 needs a method with scores to sample from; "
            f"{type(method).__name__} only decides greedily"
        )
    return Select(name, tuple(choices), float(temperature), method)


def _role(role: str, expr: Any = None) -> Expr:
    # As SGLang: with no content, an empty message (`with s.user():` opens one instead).
    if expr is None:
        return Seq((RoleBegin(role), RoleEnd(role)))
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


def image(source: Any) -> Expr:
    """An image in the prompt, where it is appended (`s += user(image(p) + "What is this?")`):
    a path (str or `pathlib.Path`), the encoded file's bytes, a PIL image, or an http(s) or
    `data:image/...` URL. SGLang's `image`. The backend's model must take images (a
    vision-language model; with `OpenAI`, one the server serves). `ValueError` for another
    type, an empty value or a path that is no file; content that is not an image fails when
    the program sends it (see `braid.lang.images`)."""
    from braid.lang.tracer import TRACING

    if TRACING.get() is not None and isinstance(source, Expr):
        # An argument while tracing: the graph records where the image goes.
        return Image(source)
    return Image(check_source(source))


def video(path: str, num_frames: int) -> Expr:
    """SGLang's `video`: braid has no video models; refused at once."""
    raise ValueError("video(): braid serves no video models; send frames as image(...) parts")


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    """`expr`, then split the reasoning out of each gen in it: after it runs, variable `name`
    and the program text hold the answer, `<name>_reasoning_content` the reasoning
    (`model_type`: "deepseek-r1", the default, or "qwen3")."""
    from braid.runtime.reasoning import reasoning_format

    reasoning_format(model_type)  # an unknown format fails here, not mid-program
    if expr is None:
        return Seq(())
    inner = as_expr(expr)
    names = tuple(n.name for n in flatten(inner) if isinstance(n, (Gen, Select)))
    if any(name is None for name in names):
        raise ValueError("separate_reasoning: every gen inside needs a name")
    return Seq((inner, SeparateReasoning(model_type, names)))


def flush_cache(backend: Any = None) -> bool:
    """Empty the prefix cache of `backend` (default: the default backend); whether it did."""
    from braid.lang.program import resolve_backend

    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The runtime state and counters of `backend` (default: the default backend)."""
    from braid.lang.program import resolve_backend

    return resolve_backend(backend).get_server_info()


def _unavailable(name: str, hint: str):
    def backend(*args: Any, **kwargs: Any):
        raise ValueError(f"{name}: braid has no {name} backend; {hint}")

    backend.__name__ = name
    return backend


_HINT = "use OpenAI(model, base_url=...) against an OpenAI-compatible endpoint"
Anthropic = _unavailable("Anthropic", _HINT)
LiteLLM = _unavailable("LiteLLM", _HINT)
VertexAI = _unavailable("VertexAI", _HINT)


__all__ = [
    "ROLES",
    "Anthropic",
    "LiteLLM",
    "VertexAI",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "image",
    "select",
    "separate_reasoning",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
    "video",
]
