"""`ParamError`: a refused request value that names its field as data.

The checks of a request's values that the server and `LLM` share (`SamplingParams`,
constraint specs, tools, chat messages and templates, images, embedding options, and the
`TokenizerManager`'s context and vocabulary checks) raise it, so that the server can put the
field in an OpenAI-style error body's `param` as it was raised, and a Python caller can read
it from the exception, without either parsing it out of the message. The scheduler's
refusals carry it across processes as a `Refusal`.
"""

from __future__ import annotations

from typing import Any


class ParamError(ValueError):
    """A request value braid refuses. `param` is the field at fault as the request spells it
    ("temperature", "tools[0].function.name", "prompt[1]"; for `LLM`'s arguments their name,
    "prompt 1"), or None when no one field is; `str(e)` is the message, which starts with the
    field too."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def at(cls, param: str, problem: str) -> ParamError:
        """The error "`param`: `problem`", naming `param`."""
        return cls(param, f"{param}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        # An exception pickles as its class and `args` (the message alone): keep the param.
        return type(self), (self.param, str(self))


def error_param(e: BaseException) -> str | None:
    """The field `e` names: its `param` if it is a `ParamError`, else None."""
    return e.param if isinstance(e, ParamError) else None
