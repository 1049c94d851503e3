"""Llama 3.1+ JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`."""

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

PYTHON_TAG = "<|python_tag|>"


@PARSERS.register
class Llama3Parser(ToolParser):
    """A call is a JSON object with `name` and `parameters` (`arguments` is accepted too).
    A call is recognised where one may start: at the very beginning of the output (after
    whitespace), right after `<|python_tag|>`, and after a `;` that follows a call. Elsewhere
    a `{` is ordinary content, as is an object that is not a call of a function in `tools`.
    `<|python_tag|>` is a special token: with `skip_special_tokens` it never reaches the text,
    and the calls then begin the output."""

    def __init__(self, tools) -> None:
        super().__init__(tools)
        # start: beginning of output; content; tag: after the python tag, awaiting `{`;
        # object: inside a call object; after: just after a call; sep: after `;`.
        self._state = "start"
        self._pending = ""  # content held back: a possible start of the python tag
        self._region = ""  # text of the object (and what led to it) not yet decided
        self._obj_at = 0  # where the object starts in `_region`
        self._brackets = Brackets()

    def _consume(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _open(self, prefix: str, ch: str) -> None:
        """Start an object; `prefix` (the tag or the `;`) is dropped if it is a call."""
        self._state, self._region, self._obj_at = "object", prefix + ch, len(prefix)
        self._brackets = Brackets()
        self._brackets.push(ch)

    def _fail(self, ch: str) -> None:
        """What was held was text after all; `ch` starts afresh as content."""
        self._content(self._region)
        self._region, self._state = "", "content"
        self._step(ch)

    def _step(self, ch: str) -> None:
        st = self._state
        if st == "start":
            if ch.isspace():
                self._content(ch)
            elif ch == "{":
                self._open("", ch)
            else:
                self._state = "content"
                self._step(ch)
        elif st == "content":
            self._pending += ch
            if self._pending.endswith(PYTHON_TAG):
                self._content(self._pending[: -len(PYTHON_TAG)])
                self._pending, self._region, self._state = "", PYTHON_TAG, "tag"
                return
            keep = held_prefix_len(self._pending, (PYTHON_TAG,))
            self._content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
        elif st in ("tag", "sep"):
            if ch.isspace():
                self._region += ch
            elif ch == "{":
                self._open(self._region, ch)
            else:
                self._fail(ch)
        elif st == "object":
            self._region += ch
            if self._brackets.push(ch):
                found = call_from_json(loads_or_none(self._region[self._obj_at :]), self.names)
                args = dumps_arguments(found[1]) if found else None
                if found is None or args is None:
                    self._content(self._region)
                    self._region, self._state = "", "content"
                else:
                    self._call(found[0], args)
                    self._region, self._state = "", "after"
        elif st == "after":
            if ch.isspace():
                self._content(ch)  # dropped: whitespace next to a call
            elif ch == ";":
                self._region, self._state = ";", "sep"
            else:
                self._state = "content"
                self._step(ch)

    def _end(self) -> None:
        self._content(self._region + self._pending)
        self._region = self._pending = ""
