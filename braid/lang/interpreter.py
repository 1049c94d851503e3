"""Running programs: `ProgramState` (the `s` a program appends to), fork/join (`ForkGroup`),
streaming.

Appending is asynchronous: `s += gen("x")` queues the node and returns at once; a worker
thread per state (`braid.lang.executor`) runs the queue in order against the backend. The
program blocks only when it reads a result (`s["x"]`, `s.text()`), so independent states
(forks, a batch) run at the same time and the runtime batches their requests. A failure stops
the state's queue and is raised, with the program line that queued the failing node, on the
next read (and by `run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import linecache
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from braid.lang.executor import Executor, Join, ProgramError, UnknownVariable
from braid.lang.ir import Expr, RoleBegin, RoleEnd, Seq, VarScopeBegin, VarScopeEnd, as_expr

__all__ = ["ForkGroup", "ProgramError", "ProgramState", "UnknownVariable", "caller_location"]

_LANG_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames between a program's line and braid.lang: a `with s.user():` enters and leaves the
# role through contextlib's frames.
_PASSED_THROUGH = (contextlib.__file__,)


def caller_location() -> str:
    """`file:line in function: code` of the nearest frame outside braid.lang (and outside
    contextlib, which a `with` block's role scope goes through)."""
    frame = sys._getframe(1)
    while frame is not None and (
        os.path.dirname(os.path.abspath(frame.f_code.co_filename)).startswith(_LANG_DIR)
        or frame.f_code.co_filename in _PASSED_THROUGH
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    name = os.path.basename(frame.f_code.co_filename)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}: {code}"


class ProgramState:
    """The state a program appends to (`s`), and what `run` returns. SGLang's `ProgramState`:
    `s[name]` / `get_var` read a variable (the generated text), `s[name] = v` / `set_var` set
    one, `get_value` the converted value of a typed gen, `get_meta_info` its meta info,
    `text()`, `messages()`, `error()`, the streaming iterators. See the module docstring for
    when calls block."""

    def __init__(self, executor: Executor) -> None:
        self._ex = executor
        self.ret_value: Any = None  # what the program function returned

    # ---- building -----------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        self._ex.submit(as_expr(other), caller_location())
        return self

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return self._role_scope(role)
        self._ex.submit(Seq((RoleBegin(role), as_expr(expr), RoleEnd(role))), caller_location())
        return None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._ex.submit(RoleBegin(role), caller_location())
        yield
        self._ex.submit(RoleEnd(role), caller_location())

    def system(self, expr: Any = None):
        """`s.system("...")` appends a system message; `with s.system():` opens one."""
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside becomes variable `name`."""
        self._ex.submit(VarScopeBegin(name), caller_location())
        yield
        self._ex.submit(VarScopeEnd(name), caller_location())

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkGroup:
        """`size` copies of this state that run in parallel from here, the prefix computed
        once. (`position_ids_offset`, an SGLang runtime option, is not supported.)"""
        n = size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fork: size must be a positive integer, got {n!r}")
        if position_ids_offset is not None:
            raise ValueError("fork: position_ids_offset is not supported by braid")
        ex = self._ex
        ex.sync()
        if n > 1 and ex.text:
            ex.backend.cache_prefix(ex.text, list(ex.images))
        members = []
        for _ in range(n):
            session = f"{ex.session}.{len(ex.children)}" if ex.session else None
            child = Executor(ex.backend, ex.defaults, session, ex.sessions, parent=ex)
            ex.children.append(child)
            members.append(ProgramState(child))
        return ForkGroup(self, members, len(ex.text), len(ex.images))

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """A fork of one, joined when the block ends (SGLang's `s.copy()`)."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._ex.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def get_var(self, name: str) -> Any:
        """The variable's value: the text a gen produced (a list with `n > 1`), the choice a
        select made, what `set_var` stored."""
        return self._ex.get_var(name)

    def get_value(self, name: str) -> Any:
        """The converted value of a typed gen (`dtype=int` gives an int, `str` the string
        without its quotes, `bool` True or False); for any other variable, `get_var`.
        `ValueError` if the text does not parse as the type (e.g. cut off by max_tokens)."""
        var = self._ex.get_var(name)
        typed = self._ex.values.get(name)  # the name's, if its last setter was a typed gen
        return var if typed is None else typed.value()

    def set_var(self, name: str, value: Any) -> None:
        self._ex.sync()
        self._ex._set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._ex.sync()
        return name in self._ex.variables

    def text(self) -> str:
        self._ex.sync()
        return self._ex.text

    def messages(self) -> list[dict[str, Any]]:
        self._ex.sync()
        return [dict(m) for m in self._ex.messages]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """For variable `name`, SGLang's meta info: `id`, `prompt_tokens`,
        `completion_tokens`, `cached_tokens`, `finish_reason` (`{"type": ...}`), and when
        asked `output_token_logprobs`, `output_top_logprobs`, `input_token_logprobs`,
        `input_top_logprobs`; for a select, `normalized_prompt_logprobs`,
        `input_token_logprobs`, `output_token_logprobs` and the method's own keys, plus
        braid's `choice_index` and `scores`. None for a variable no gen or select set (a
        var_scope, `set_var`), as SGLang; for one gathered by a join, a list with each
        branch's (None where a branch has none)."""
        self._ex.get_var(name)
        self._ex.sync()
        meta = self._ex.meta.get(name)
        return dict(meta) if isinstance(meta, dict) else meta

    def sync(self) -> None:
        self._ex.sync()

    def error(self) -> ProgramError | None:
        """The error that stopped the program, or None (waits for what is queued)."""
        with self._ex._cond:
            self._ex._cond.wait_for(lambda: self._ex._pending == 0 or self._ex.ended)
        return self._ex.error

    def __repr__(self) -> str:
        return f"ProgramState({self.text()})"

    # ---- streaming ----------------------------------------------------------------------
    def _chunks(self, var: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
        ex = self._ex
        i = 0
        while True:
            with ex._cond:
                ex._cond.wait_for(
                    lambda: (
                        len(ex.chunks) > i  # noqa: B023 - the wait ends before i changes
                        or ex.ended
                        or ex.error is not None
                        or (ex._pending == 0 and not ex._thread.is_alive())
                    )
                )
                new = ex.chunks[i:]
                i = len(ex.chunks)
                done = (ex.ended or ex.error is not None) and i == len(ex.chunks)
            for name, piece, meta in new:
                if var is not None and name != var:
                    continue
                if piece is None:
                    if var is not None:
                        return
                    continue
                yield piece, meta
            if done:
                if ex.error is not None:
                    raise ex.error
                if var is not None and var not in ex.variables:
                    raise UnknownVariable(f"variable {var!r} is not set by this program")
                return

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text as it is produced (only variable `var_name`'s, if given)."""
        for piece, _ in self._chunks(var_name):
            yield piece

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for asyncio; with `return_meta_data`, `(piece, meta)` pairs: the meta
        info so far, with `output_token_logprobs` (and `output_top_logprobs`) of this chunk's
        tokens only and `output_token_logprobs_length` counting all so far (when logprobs
        were asked for)."""
        loop = asyncio.get_running_loop()
        it = self._chunks(var_name)
        done = object()
        while True:
            item = await loop.run_in_executor(None, next, it, done)
            if item is done:
                return
            yield item if return_meta_data else item[0]


class ForkGroup:
    """The states made by `fork(n)` (SGLang's `ProgramStateGroup`). `forks += x` appends `x`
    to each (`x` may be a function of the member's index, or a list with one item per member);
    `forks[i] += x` appends to one; `join()` waits for them and merges into the parent."""

    def __init__(
        self,
        parent: ProgramState,
        members: list[ProgramState],
        fork_text_len: int,
        fork_images_len: int = 0,
    ) -> None:
        self.parent = parent
        self.members = members
        self.fork_text_len = fork_text_len
        self.fork_images_len = fork_images_len

    @property
    def states(self) -> list[ProgramState]:
        return self.members

    @property
    def src_state(self) -> ProgramState:
        return self.parent

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i: int) -> ProgramState:
        return self.members[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += x` appends through the member, then assigns the member back.
        if value is not self.members[i]:
            raise ValueError("fork group: members cannot be replaced; append to forks[i]")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.members)

    def __iadd__(self, other: Any | Callable[[int], Any]) -> ForkGroup:
        where = caller_location()
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.members):
                raise ValueError(f"fork group: {len(other)} items for {len(self.members)} members")
            items = list(other)
        elif callable(other) and not isinstance(other, Expr):
            items = [other(i) for i in range(len(self.members))]
        else:
            items = [other] * len(self.members)
        for m, item in zip(self.members, items):
            m._ex.submit(as_expr(item), where)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """`gather_variable`: each variable the members set becomes, in the parent, the list
        of their values; `concate_and_append`: the members' new text is appended to the parent
        in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join: mode must be 'gather_variable' or 'concate_and_append', got {mode!r}"
            )
        self.parent._ex.submit(Join(self, mode), caller_location())
