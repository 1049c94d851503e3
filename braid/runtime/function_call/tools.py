"""What a request's `tools`, `tool_choice` and `parallel_tool_calls` mean: which tools the
chat template sees, which JSON schema constrains decoding, and how the output becomes calls.

tool_choice:
- "none": no tool calls. The tools are not given to the chat template (so the model is not
  prompted to write calls that would then come back as text) and nothing is parsed.
- "auto" (the default when tools are given): the model decides; its text is parsed with the
  configured parser. Without a parser the text is returned as content, unparsed.
- "required": decoding is constrained to a JSON array of 1..n calls (one when
  `parallel_tool_calls` is false), each `{"name": <a tool>, "arguments": <its parameters>}`,
  so every call is well formed and its arguments match that tool's schema.
- {"type": "function", "function": {"name": NAME}}: decoding is constrained to NAME's
  parameters object, which becomes the arguments of one call of NAME.
The constrained modes need no format parser.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from braid.runtime.errors import ParamError
from braid.runtime.function_call.base import (
    Brackets,
    ToolCall,
    ToolCallStream,
    assemble,
    loads_or_none,
)

if TYPE_CHECKING:
    from braid.runtime.sampling_params import SamplingParams

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
Mode = Literal["none", "auto", "required", "named"]


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Validated OpenAI tools (`[{"type": "function", "function": {"name", "description",
    "parameters"}}]`); a `ParamError` naming the offending field."""
    if not isinstance(tools, list):
        raise ParamError.at("tools", "must be a list of {'type': 'function', 'function': {...}}")
    seen: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping):
            raise ParamError.at(where, "must be an object")
        if t.get("type", "function") != "function":
            raise ParamError.at(f"{where}.type", "only 'function' tools are supported")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise ParamError.at(f"{where}.function", "required, an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ParamError.at(f"{where}.function.name", "required, a non-empty string")
        if not _NAME_RE.fullmatch(name):
            raise ParamError.at(
                f"{where}.function.name", f"{name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if name in seen:
            raise ParamError.at(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise ParamError.at(f"{where}.function.strict", "must be true or false")
        params = fn.get("parameters")
        if params is not None and (
            not isinstance(params, Mapping) or params.get("type", "object") != "object"
        ):
            raise ParamError.at(
                f"{where}.function.parameters", "must be a JSON schema of an object"
            )
        out.append({"type": "function", "function": dict(fn)})
    return out


def parameters_of(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (an empty object schema if it takes none)."""
    params = tool["function"].get("parameters")
    return copy.deepcopy(dict(params)) if params else dict(_EMPTY_PARAMETERS)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of tool_choice "required": an array of 1..n (1 unless `parallel`) calls,
    each one tool's name with that tool's parameters as `arguments`. `$defs`/`definitions`
    of the tools move to the root, where their `#/...` references point."""
    hoisted: dict[str, dict[str, Any]] = {}
    branches = []
    for t in tools:
        params = parameters_of(t)
        for key in ("$defs", "definitions"):
            for def_name, d in (params.pop(key, None) or {}).items():
                have = hoisted.setdefault(key, {})
                if def_name in have and have[def_name] != d:
                    raise ParamError.at(
                        "tools",
                        f"two tools define {key}/{def_name} differently; "
                        "rename one to use tool_choice 'required'",
                    )
                have[def_name] = d
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "arguments": params,
                },
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(hoisted)
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """The meaning of one request's tool fields; build it with `ToolPlan.resolve`."""

    tools: tuple[dict[str, Any], ...]
    mode: Mode
    function: str | None = None  # the named function (mode "named")
    parallel: bool = True
    parser: str | None = None  # the format parser (mode "auto")

    @classmethod
    def resolve(
        cls,
        tools: Any,
        tool_choice: Any = None,
        parallel_tool_calls: Any = True,
        parser: str | None = None,
    ) -> ToolPlan | None:
        """Validate the fields; None when the request involves no tools. A `ParamError`
        naming the offending field (tools[i]..., tool_choice...)."""
        checked = check_tools(tools) if tools is not None else []
        if not isinstance(parallel_tool_calls, bool):
            raise ParamError.at("parallel_tool_calls", "must be true or false")
        if parser is not None:
            from braid.runtime.function_call import get_parser

            get_parser(parser)
        if tool_choice is None:
            tool_choice = "auto" if checked else "none"
        names = [t["function"]["name"] for t in checked]
        if isinstance(tool_choice, str):
            if tool_choice not in ("none", "auto", "required"):
                raise ParamError.at(
                    "tool_choice",
                    f"{tool_choice!r} is not 'none', 'auto', 'required' or "
                    "{'type': 'function', 'function': {'name': ...}}",
                )
            if tool_choice == "required" and not checked:
                raise ParamError.at("tool_choice", "'required' needs at least one tool in tools")
            if not checked:
                return None
            mode: Mode = tool_choice  # type: ignore[assignment]
            return cls(tuple(checked), mode, None, parallel_tool_calls, parser)
        if not isinstance(tool_choice, Mapping):
            raise ParamError.at("tool_choice", "must be a string or {'type': 'function', ...}")
        if tool_choice.get("type") != "function":
            raise ParamError.at("tool_choice.type", "must be 'function'")
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ParamError.at("tool_choice.function.name", "required, a non-empty string")
        if name not in names:
            raise ParamError.at(
                "tool_choice.function.name", f"{name!r} is not one of the tools (have {names})"
            )
        return cls(tuple(checked), "named", name, parallel_tool_calls, parser)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none for tool_choice "none")."""
        return None if self.mode == "none" else [dict(t) for t in self.tools]

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The schema decoding is constrained to (modes "required" and "named")."""
        if self.mode == "required":
            return required_schema(list(self.tools), self.parallel)
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function)
            return parameters_of(tool)
        return None

    @property
    def skip_special_tokens(self) -> bool | None:
        """False when the parser's markers are special tokens that must reach the text."""
        if self.mode != "auto" or self.parser is None:
            return None
        from braid.runtime.function_call import get_parser

        return False if get_parser(self.parser).needs_special_tokens else None

    @property
    def strict(self) -> bool:
        """Whether a tool asks for its calls to match its parameters (OpenAI's `strict`)."""
        return any(t["function"].get("strict") is True for t in self.tools)

    def strict_tag(self) -> dict[str, Any] | None:
        """For "auto" with strict tools: a structural tag that holds every call the parser's
        format starts to its tool's parameters (free text elsewhere); None where the format
        has no such structure."""
        from braid.runtime.function_call import get_parser

        parser = get_parser(self.parser) if self.parser is not None else None
        if parser is None or parser.trigger is None:
            return None
        structures = []
        for t in self.tools:
            begin, end = parser.call_structure(t["function"]["name"])
            structures.append({"begin": begin, "schema": parameters_of(t), "end": end})
        return {"structures": structures, "triggers": [parser.trigger]}

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with this plan's output constraint (modes "required" and "named", and
        "auto" with strict tools) and special-token setting; a `ParamError` naming the field
        when they cannot combine."""
        if self.mode == "auto" and self.strict:
            tag = self.strict_tag()
            if tag is None:
                raise ParamError.at(
                    "tools",
                    f"strict tools with tool_choice 'auto' are held to their schemas in the "
                    f"hermes call format only, not with the {self.parser or 'no'} parser: set "
                    "strict false (the OpenAI Agents SDK: strict_mode=False), or use "
                    "tool_choice 'required' or a named function",
                )
            if params.constraint is not None:
                raise ParamError.at(
                    "tools",
                    "strict tools constrain the calls in the output; do not combine them "
                    "with response_format, json_schema, regex or choice",
                )
            params = params.replace(structural_tag=tag)
        if self.mode in ("required", "named"):
            if params.constraint is not None:
                raise ParamError.at(
                    "tool_choice",
                    "'required' or a named function constrains the output itself; "
                    "do not combine it with response_format, json_schema, regex or choice",
                )
            if params.min_tokens:
                raise ParamError.at(
                    "min_tokens",
                    "cannot be combined with tool_choice 'required' or a named function",
                )
            try:
                params = params.replace(json_schema=self.json_schema)
            except ValueError as e:
                raise ParamError.at(
                    "tools", f"their parameters cannot constrain decoding: {e}"
                ) from None
        if self.skip_special_tokens is not None:
            params = params.replace(skip_special_tokens=self.skip_special_tokens)
        return params

    def stream(self) -> ToolCallStream | None:
        """A fresh stream for one sample's output; None when the text is plain content."""
        if self.mode == "required":
            return RequiredCallStream()
        if self.mode == "named":
            assert self.function is not None
            return NamedCallStream(self.function)
        if self.mode == "auto" and self.parser is not None:
            from braid.runtime.function_call import get_parser

            parser = get_parser(self.parser)(list(self.tools))
            parser.max_calls = None if self.parallel else 1
            return parser
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of one whole output."""
        s = self.stream()
        if s is None:
            return text, []
        return assemble(s.feed(text) + s.finish())


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason: "tool_calls" when calls were made and the output ended by
    itself; a cut-off ("length") or an abort keeps its own reason."""
    return "tool_calls" if num_calls and reason == "stop" else reason


class NamedCallStream(ToolCallStream):
    """Output constrained to one function's arguments: the whole text is the arguments of
    one call, streamed as it comes (a cut-off output leaves them incomplete)."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function
        self._index: int | None = None

    def _consume(self, text: str) -> None:
        if not text:
            return
        if self._index is None:
            self._index = self._header(self.function)
        self._arguments(self._index, text)

    def _end(self) -> None:
        pass


# Everything of a call object before its arguments value, as the "required" schema orders it.
_HEAD_RE = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class RequiredCallStream(ToolCallStream):
    """Output constrained to the "required" schema (`[{"name": ..., "arguments": {...}},
    ...]`): each call's header is sent once its name is complete, and its arguments stream
    as they are written. If the output ends before any call's name is complete (a cut-off
    output), the whole text is sent as content at the end instead."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "array"  # array: between calls; head: before arguments; args; tail
        self._head = ""
        self._index = 0
        self._brackets = Brackets()
        self._text: list[str] | None = []  # all text, kept until the first call is sent

    def _consume(self, text: str) -> None:
        if self._text is not None:
            self._text.append(text)
        piece: list[str] = []  # this feed's argument text of the current call
        for ch in text:
            if self._state == "array":
                if ch == "{":
                    self._state, self._head = "head", ch
            elif self._state == "head":
                if not ch.isspace() and _HEAD_RE.fullmatch(self._head):
                    m = _HEAD_RE.fullmatch(self._head)
                    assert m is not None
                    name = loads_or_none(m.group(1))
                    self._index = self._header(name if isinstance(name, str) else "")
                    self._text = None
                    self._state, self._brackets = "args", Brackets()
                    piece = []
                    self._take_arg(ch, piece)
                else:
                    self._head += ch
            elif self._state == "args":
                self._take_arg(ch, piece)
            elif ch == "}":  # tail: the call object closes
                self._state = "array"
            if self._state != "args" and piece:
                self._arguments(self._index, "".join(piece))
                piece = []
        if piece:
            self._arguments(self._index, "".join(piece))

    def _take_arg(self, ch: str, piece: list[str]) -> None:
        piece.append(ch)
        if self._brackets.push(ch):
            self._state = "tail"

    def _end(self) -> None:
        if self._text is not None:
            self._content("".join(self._text))
            self._text = None
