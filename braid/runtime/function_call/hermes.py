"""Hermes / Qwen 2.5 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json

from braid.runtime.function_call import PARSERS
from braid.runtime.function_call.base import (
    ToolParser,
    call_from_json,
    dumps_arguments,
    held_prefix_len,
    loads_or_none,
)

START, END = "<tool_call>", "</tool_call>"


@PARSERS.register
class HermesParser(ToolParser):
    """Each `<tool_call>...</tool_call>` block holds one JSON object with `name` and
    `arguments` (`parameters` is accepted too). Text outside blocks is content. A block whose
    body is not such an object, or names a function not in `tools`, is content as written.
    A block the output ends inside counts as a call if its body is already a complete call
    (models sometimes stop before the closing tag)."""

    trigger = START

    @classmethod
    def call_structure(cls, name: str) -> tuple[str, str]:
        return f'{START}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{END}"

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._pending = ""  # content that may be the start of START
        self._block: str | None = None  # the block's text so far, START included
        self._opened = False  # the body's `{` was seen
        self._quote = False  # inside a JSON string in the body
        self._escape = False

    def _consume(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        if self._block is None:
            self._pending += ch
            if self._pending.endswith(START):
                self._content(self._pending[: -len(START)])
                self._pending = ""
                self._block, self._opened, self._quote, self._escape = START, False, False, False
                return
            keep = held_prefix_len(self._pending, (START,))
            self._content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return
        if not self._opened:
            if ch.isspace():
                self._block += ch
                return
            if ch != "{":  # not a JSON object: the block was text; `ch` starts afresh
                self._release()
                self._step(ch)
                return
            self._opened = True
        self._block += ch
        if self._quote:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._quote = False
        elif ch == '"':
            self._quote = True
        elif self._block.endswith(END):
            body = self._block[len(START) : -len(END)]
            if not self._try_call(body):
                self._content(self._block)
            self._block = None

    def _try_call(self, body: str) -> bool:
        found = call_from_json(loads_or_none(body.strip()), self.names)
        args = dumps_arguments(found[1]) if found else None
        if found is None or args is None:
            return False
        self._call(found[0], args)
        return True

    def _release(self) -> None:
        assert self._block is not None
        self._content(self._block)
        self._block = None

    def _end(self) -> None:
        if self._block is not None:
            if self._opened and self._try_call(self._block[len(START) :]):
                self._block = None
            else:
                self._release()
        self._content(self._pending)
        self._pending = ""
