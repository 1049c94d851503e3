"""Mistral calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

from braid.runtime.function_call import PARSERS
from braid.runtime.function_call.base import (
    Brackets,
    ToolParser,
    call_from_json,
    dumps_arguments,
    held_prefix_len,
    loads_or_none,
)

MARKER = "[TOOL_CALLS]"


@PARSERS.register
class MistralParser(ToolParser):
    """`[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}` objects (a single
    object is accepted too). The array is all or nothing: if any element is not a call of a
    function in `tools`, or the JSON is malformed, the marker and the array are content as
    written. `[TOOL_CALLS]` is a special token, so the server keeps special tokens in the text
    while this parser runs. (The `[TOOL_CALLS]name[ARGS]{...}` form of newer Mistral
    tokenizers is not parsed.)"""

    needs_special_tokens = True

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._pending = ""
        self._region: str | None = None  # marker, whitespace and the array so far
        self._brackets: Brackets | None = None  # set once the array opened

    def _consume(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        if self._region is None:
            self._pending += ch
            if self._pending.endswith(MARKER):
                self._content(self._pending[: -len(MARKER)])
                self._pending, self._region, self._brackets = "", MARKER, None
                return
            keep = held_prefix_len(self._pending, (MARKER,))
            self._content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return
        if self._brackets is None:
            if ch.isspace():
                self._region += ch
                return
            if ch not in "[{":  # no JSON after the marker: it was text; `ch` starts afresh
                self._content(self._region)
                self._region = None
                self._step(ch)
                return
            self._brackets = Brackets()
        self._region += ch
        if self._brackets.push(ch):
            if not self._try_calls(self._region[len(MARKER) :]):
                self._content(self._region)
            self._region = None

    def _try_calls(self, body: str) -> bool:
        items = loads_or_none(body)
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list) or not items:
            return False
        calls = []
        for item in items:
            found = call_from_json(item, self.names)
            args = dumps_arguments(found[1]) if found else None
            if found is None or args is None:
                return False
            calls.append((found[0], args))
        for name, args in calls:
            self._call(name, args)
        return True

    def _end(self) -> None:
        if self._region is not None:
            self._content(self._region)
            self._region = None
        self._content(self._pending)
        self._pending = ""
