"""Tool calls, the deltas a stream of them is sent as, and the base class of every parser.

A parser is a state machine over characters: `feed(delta_text)` returns the deltas that the
text seen so far decides, `finish()` releases what is still held at the end of the output.
Because every decision depends only on the characters (never on how they were split into
pieces), the deltas of a stream reassemble to exactly what `parse(text, tools)` returns for
the whole text.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


def new_call_id() -> str:
    """A fresh tool-call id, `call_` and 24 hex digits (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object as text (what OpenAI sends)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ContentDelta:
    """Plain text outside any call."""

    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call number `index`: the first piece of a call carries its `id` and `name`
    (and empty `arguments`); later pieces carry only argument text, and the arguments of a
    call are the concatenation of its pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
            entry["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            entry["function"] = {"arguments": self.arguments}
        return {"tool_calls": [entry]}


Delta = ContentDelta | ToolCallDelta


def assemble(deltas: Sequence[Delta]) -> tuple[str, list[ToolCall]]:
    """The content and the calls that a sequence of deltas spells."""
    content: list[str] = []
    heads: dict[int, ToolCallDelta] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif d.id is not None:
            heads[d.index] = d
            args[d.index] = [d.arguments]
        else:
            args[d.index].append(d.arguments)
    calls = [
        ToolCall(heads[i].id or "", heads[i].name or "", "".join(args[i])) for i in sorted(heads)
    ]
    return "".join(content), calls


def function_names(tools: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The function names of OpenAI-style tools (`{"type": "function", "function": {...}}`)."""
    names = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def call_from_json(
    obj: Any, names: frozenset[str], arg_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a decoded `{"name": ..., "arguments": {...}}` object, or None if it
    is not a call of a known function. Arguments given as a JSON string are decoded; missing
    arguments mean a call without any."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args: Any = {}
    for k in arg_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        args = loads_or_none(args)
    if not isinstance(args, dict):
        return None
    return name, args


def loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def dumps_arguments(args: dict[str, Any]) -> str | None:
    """Arguments as strict JSON text, or None if they have no JSON form (NaN, bytes, ...)."""
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


class Brackets:
    """Finds where one bracketed value ends by counting brackets outside string literals
    (whose quote characters are `quotes`). It checks no syntax: the caller decodes the value."""

    def __init__(self, quotes: str = '"') -> None:
        self.quotes = quotes
        self.depth = 0
        self.quote: str | None = None
        self.escape = False

    def push(self, ch: str) -> bool:
        """Take one character; True when it closes the outermost bracket."""
        if self.quote is not None:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == self.quote:
                self.quote = None
            return False
        if ch in self.quotes:
            self.quote = ch
        elif ch in "{[(":
            self.depth += 1
        elif ch in "}])":
            self.depth -= 1
            return self.depth <= 0
        return False


def held_prefix_len(pending: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `pending` that is a proper start of some marker: text that
    cannot be sent as content yet, because the next characters may complete the marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(pending)), best, -1):
            if pending.endswith(m[:k]):
                best = k
                break
    return best


class ToolCallStream(ABC):
    """Model text in, OpenAI-style deltas out.

    Content deltas carry the text outside calls, with whitespace tidied where calls were cut
    out: whitespace around calls collapses to the whitespace that preceded the first of them
    (none at the start or end of the output), so "Sure.\n<call>\nDone." gives "Sure.\nDone."
    and a bare call gives no content. A call is sent as a header delta (index, id, name)
    followed by argument deltas.
    """

    def __init__(self) -> None:
        self._out: list[Delta] = []
        self._calls = 0
        self._ws = ""  # whitespace held back: it may touch a call
        self._gap = ""  # whitespace that preceded the latest run of calls
        self._after_call = False
        self._any_content = False
        self._finished = False
        # parallel_tool_calls false: calls the model writes past the first are dropped.
        self.max_calls: int | None = None

    @property
    def num_calls(self) -> int:
        """Calls sent so far."""
        return self._calls

    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of model text; returns the deltas it decides."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._consume(text)
        return self._take()

    def finish(self) -> list[Delta]:
        """The output ended: release whatever is still held back (an unfinished call is sent
        as content). Further calls return nothing."""
        if not self._finished:
            self._finished = True
            self._end()
            if self._ws and not self._calls:
                self._out.append(ContentDelta(self._ws))
            self._ws = ""
        return self._take()

    @abstractmethod
    def _consume(self, text: str) -> None: ...

    @abstractmethod
    def _end(self) -> None: ...

    # ---- emitting ----------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if not text:
            return
        text = self._ws + text
        body = text.rstrip()
        if not body:
            self._ws = text
            return
        self._ws = text[len(body) :]
        if self._after_call:
            body = self._gap + body.lstrip()
            self._gap = ""
            self._after_call = False
        self._any_content = True
        self._out.append(ContentDelta(body))

    def _header(self, name: str) -> int:
        index = self._calls
        self._calls += 1
        if not self._after_call:
            self._gap = self._ws if self._any_content else ""
        self._ws = ""
        self._after_call = True
        self._out.append(ToolCallDelta(index, new_call_id(), name, ""))
        return index

    def _arguments(self, index: int, text: str) -> None:
        if text:
            self._out.append(ToolCallDelta(index, arguments=text))

    def _call(self, name: str, arguments: str) -> None:
        if self.max_calls is not None and self._calls >= self.max_calls:
            return
        self._arguments(self._header(name), arguments)

    def _take(self) -> list[Delta]:
        """The pending deltas, with neighbouring content and argument pieces merged."""
        merged: list[Delta] = []
        for d in self._out:
            prev = merged[-1] if merged else None
            if isinstance(d, ContentDelta) and isinstance(prev, ContentDelta):
                merged[-1] = ContentDelta(prev.text + d.text)
            elif (
                isinstance(d, ToolCallDelta)
                and d.id is None
                and isinstance(prev, ToolCallDelta)
                and prev.id is None
                and prev.index == d.index
            ):
                merged[-1] = ToolCallDelta(d.index, arguments=prev.arguments + d.arguments)
            else:
                merged.append(d)
        self._out = []
        return merged


class ToolParser(ToolCallStream):
    """A model's tool-call format. Subclasses implement the state machine and are registered
    under their format's name (`braid.runtime.function_call.PARSERS`).

    Only calls of functions named in `tools` become tool calls: a call of any other function,
    and a call whose text is malformed, is content, sent as the model wrote it. A call is sent
    once its text is complete (so a malformed call is never half-sent); its arguments are
    re-serialized as compact-spaced JSON (`json.dumps`).
    """

    # Whether the format's markers are special tokens that must survive detokenization.
    needs_special_tokens: ClassVar[bool] = False
    # Where a call starts in free text, for holding strict tools' calls to their schemas
    # (`call_structure`); None: the format's calls cannot be constrained that way.
    trigger: ClassVar[str | None] = None

    @classmethod
    def call_structure(cls, name: str) -> tuple[str, str]:
        """The text before and after a call's JSON arguments, for a call of `name`."""
        raise NotImplementedError(f"{cls.__name__} has no call structure")

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        super().__init__()
        self.names = function_names(tools)

    @classmethod
    def parse(cls, text: str, tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[ToolCall]]:
        """Non-streaming: (content, calls) of a whole model output."""
        p = cls(tools)
        return assemble(p.feed(text) + p.finish())
