"""Pythonic calls (Llama 3.2 / 4 style): `[get_weather(city="Paris"), add(a=1, b=2)]`."""

from __future__ import annotations

import ast
from typing import Any

from braid.runtime.function_call import PARSERS
from braid.runtime.function_call.base import Brackets, ToolParser, dumps_arguments


def _literal(node: ast.expr) -> Any:
    """The value of a literal expression (strings, numbers, True/False/None, and lists,
    tuples and dicts of them); ValueError for anything else (names, calls, operators)."""
    value = ast.literal_eval(node)
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise ValueError("no JSON form")
    return value


@PARSERS.register
class PythonicParser(ToolParser):
    """A Python list of calls with keyword arguments, parsed with `ast` (never evaluated):
    argument values must be literals. The list is all or nothing: if any element is not a
    call of a function in `tools` with literal keyword arguments, the whole list is content as
    written. A list is recognised wherever `[` is followed by a name and `(`; anything else
    starting with `[` is released as content as soon as it cannot be such a list."""

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._region: str | None = None  # the candidate list so far, from its `[`
        self._head = ""  # before the first `(`: "ws" (after `[`), "name", "ws2" (after name)
        self._brackets: Brackets | None = None

    def _consume(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        if self._region is None:
            if ch == "[":
                self._region, self._head, self._brackets = ch, "ws", None
            else:
                self._content(ch)
            return
        if self._brackets is None:
            if self._head_accepts(ch):
                self._region += ch
                if ch == "(":
                    self._brackets = Brackets(quotes="'\"")
                    for c in self._region:
                        self._brackets.push(c)
                return
            self._content(self._region)  # not a call list after all; `ch` starts afresh
            self._region = None
            self._step(ch)
            return
        self._region += ch
        if self._brackets.push(ch):
            if not self._try_calls(self._region):
                self._content(self._region)
            self._region = None

    def _head_accepts(self, ch: str) -> bool:
        """Whether `ch` continues `[ name (`, advancing the head state."""
        if self._head == "ws":
            if ch.isspace():
                return True
            if ch.isalpha() or ch == "_":
                self._head = "name"
                return True
            return False
        if ch.isalnum() or ch in "_.":
            return self._head == "name"
        if ch.isspace():
            self._head = "ws2"
            return True
        return ch == "("

    def _try_calls(self, text: str) -> bool:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return False
        calls = []
        for node in tree.body.elts:
            if (
                not isinstance(node, ast.Call)
                or not isinstance(node.func, ast.Name)
                or node.func.id not in self.names
                or node.args
            ):
                return False
            kwargs: dict[str, Any] = {}
            for kw in node.keywords:
                if kw.arg is None:  # **spread
                    return False
                try:
                    kwargs[kw.arg] = _literal(kw.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    return False
            args = dumps_arguments(kwargs)
            if args is None:
                return False
            calls.append((node.func.id, args))
        for name, args in calls:
            self._call(name, args)
        return True

    def _end(self) -> None:
        if self._region is not None:
            self._content(self._region)
            self._region = None
