"""Running programs: `ProgramState` (the `s` a program appends to), its executor, fork/join,
streaming.

Appending is asynchronous: `s += gen("x")` queues the node and returns at once; a worker
thread per state runs the queue in order against the backend. The program blocks only when it
reads a result (`s["x"]`, `s.text()`), so independent states (forks, a batch) run at the same
time and the runtime batches their requests. A failure stops the state's queue and is raised,
with the program line that queued the failing node, on the next read (and by `run`).
"""

from __future__ import annotations

import asyncio
import linecache
import os
import queue
import random
import re
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from braid.lang.backends.base import Backend, Prompt
from braid.lang.ir import (
    DTYPE_RULES,
    DtypeRule,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    SamplingArgs,
    Select,
    SeparateReasoning,
    Seq,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    flatten,
)

_LANG_DIR = os.path.dirname(os.path.abspath(__file__))


class ProgramError(RuntimeError):
    """A program failed; the message starts with the program line that queued the failing
    step. The original exception is the `__cause__`."""


class UnknownVariable(KeyError, ValueError):
    """A program read a variable that nothing set."""

    def __str__(self) -> str:
        return str(self.args[0])


def caller_location() -> str:
    """`file:line in function: code` of the nearest frame outside braid.lang."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(
        os.path.abspath(frame.f_code.co_filename)
    ).startswith(_LANG_DIR):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    name = os.path.basename(frame.f_code.co_filename)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}: {code}"


_END = object()


@dataclass
class _Join:
    """Queued on the parent when a fork group joins."""

    group: ForkGroup
    mode: str


@dataclass
class _Sessions:
    """The program sessions of one program run (the root state's and its forks'), closed when
    the run ends."""

    backend: Backend
    open: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, session: str) -> None:
        with self.lock:
            self.open.append(session)

    def close(self, session: str) -> None:
        with self.lock:
            if session not in self.open:
                return
            self.open.remove(session)
        self.backend.close_session(session)


class _Executor:
    """Runs one state's queue of nodes in a worker thread."""

    def __init__(
        self,
        backend: Backend,
        defaults: SamplingArgs,
        session: str | None,
        sessions: _Sessions | None,
        parent: _Executor | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.session = session
        self.sessions = sessions
        if session is not None and sessions is not None:
            sessions.add(session)
        self.text = parent.text if parent else ""
        self.messages: list[dict[str, Any]] = [dict(m) for m in parent.messages] if parent else []
        self.open_role = parent.open_role if parent else None
        self.role_start = parent.role_start if parent else 0
        self.images: list[str | bytes] = list(parent.images) if parent else []
        # A variable is the text generated (SGLang's contract); `values` holds the converted
        # value of a typed gen (dtype=int, ...), `spans` where each gen's text lies in `text`.
        self.variables: dict[str, Any] = dict(parent.variables) if parent else {}
        self.values: dict[str, Any] = dict(parent.values) if parent else {}
        self.spans: dict[str, tuple[int, int]] = dict(parent.spans) if parent else {}
        self.meta: dict[str, dict[str, Any]] = dict(parent.meta) if parent else {}
        self.scopes: list[tuple[str, int]] = []
        self.error: ProgramError | None = None
        self.ended = False
        self._end_queued = False
        # The stream log: (variable or None, text piece or None for "variable done", meta).
        self.chunks: list[tuple[str | None, str | None, dict[str, Any]]] = []
        self.children: list[_Executor] = []
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="braid-program", daemon=True)
        self._thread.start()

    # ---- queue --------------------------------------------------------------------------
    def submit(self, node: Any, where: str) -> None:
        with self._cond:
            if self.ended:
                raise ProgramError(f"{where}: the program has ended; this state takes no more")
            self._pending += 1
        self._queue.put((node, where))

    def end(self) -> None:
        """Queue the end: after the queued nodes run, close the session and any forks."""
        with self._cond:
            if self._end_queued:
                return
            self._end_queued = True
            self._pending += 1
        self._queue.put((_END, ""))

    def _work(self) -> None:
        while True:
            node, where = self._queue.get()
            if node is _END:
                for child in self.children:
                    child.end()
                    child.wait_ended()
                if self.session is not None and self.sessions is not None:
                    try:
                        self.sessions.close(self.session)
                    except Exception as e:  # the runtime died: the run reports it below
                        self._fail("program end", e)
                with self._cond:
                    self.ended = True
                    self._pending -= 1
                    self._cond.notify_all()
                return
            if self.error is None:
                try:
                    self._run(node)
                except Exception as e:
                    self._fail(where, e)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _fail(self, where: str, e: Exception) -> None:
        if isinstance(e, ProgramError):
            err = ProgramError(str(e))
        else:
            err = ProgramError(f"{where}: {type(e).__name__}: {e}")
        err.__cause__ = e
        with self._cond:
            self.error = err
            self._cond.notify_all()

    def sync(self) -> None:
        """Wait until everything queued has run; raise the state's error, if any."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0 or self.ended)
        if self.error is not None:
            raise self.error

    def wait_ended(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.ended)

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(
                lambda: name in self.variables or self.error is not None or self._pending == 0
            )
            if name in self.variables:
                return self.variables[name]
        if self.error is not None:
            raise self.error
        known = sorted(self.variables)
        raise UnknownVariable(f"variable {name!r} is not set by this program (set: {known})")

    # ---- running nodes ------------------------------------------------------------------
    def _append(self, text: str) -> None:
        if not text:
            return
        self.text += text
        self._log(None, text, {})

    def _log(self, var: str | None, piece: str | None, meta: dict[str, Any]) -> None:
        with self._cond:
            self.chunks.append((var, piece, meta))
            self._cond.notify_all()

    def _set_var(self, name: str, value: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self._cond.notify_all()

    def prompt(self) -> Prompt:
        content = self.text[self.role_start :] if self.open_role else ""
        return Prompt(
            self.text, list(self.messages), self.open_role, content, list(self.images), self.session
        )

    def _run(self, node: Any) -> None:
        if isinstance(node, _Join):
            self._join(node)
            return
        for leaf in flatten(node):
            self._run_leaf(leaf)

    def _run_leaf(self, node: Expr) -> None:
        if isinstance(node, Text):
            self._append(node.value)
        elif isinstance(node, RoleBegin):
            self._role_begin(node.role)
        elif isinstance(node, RoleEnd):
            self._role_end(node.role)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, SeparateReasoning):
            self._separate_reasoning(node)
        elif isinstance(node, VarScopeBegin):
            self.scopes.append((node.name, len(self.text)))
        elif isinstance(node, VarScopeEnd):
            if not self.scopes or self.scopes[-1][0] != node.name:
                raise ValueError(f"var_scope({node.name!r}) ends but was not the innermost scope")
            name, start = self.scopes.pop()
            self._set_var(name, self.text[start:])
        elif isinstance(node, Image):
            if not self.backend.supports_images:
                raise ValueError(
                    "image(): this backend's model takes text only; images need a multimodal model"
                )
            self.images.append(node.source)
        else:
            raise ValueError(f"cannot run {type(node).__name__} in a program")

    def _role_begin(self, role: str) -> None:
        if self.open_role is not None:
            raise ValueError(f"{role}(): begun inside the unfinished {self.open_role}() role")
        template = self.backend.role_template
        first = not self.messages and not self.text
        try:
            opening = template.begin(role, first)
        except KeyError:
            raise ValueError(f"{role}(): this model's chat template has no {role} role") from None
        self._append(opening)
        self.open_role, self.role_start = role, len(self.text)

    def _role_end(self, role: str) -> None:
        if self.open_role != role:
            raise ValueError(f"{role}() ends but the open role is {self.open_role!r}")
        content = self.text[self.role_start :]
        self._append(self.backend.role_template.end(role))
        self.messages.append({"role": role, "content": content})
        self.open_role = None

    def _gen(self, node: Gen) -> None:
        sampling = node.sampling.over(self.defaults)
        constraint = node.constraint
        rule = None
        if node.dtype is not None and constraint is None:
            rule = DTYPE_RULES[node.dtype]
            constraint = ("regex", rule.regex)
            sampling = sampling.with_stop_regex(rule.stop_regex)
        sent = 0

        def on_delta(piece: str, meta: dict[str, Any]) -> None:
            # Each chunk carries the logprobs of its own tokens (SGLang's incremental stream
            # meta), and how many there are so far.
            nonlocal sent
            chunk = dict(meta)
            if "output_token_logprobs" in meta:
                total = len(meta["output_token_logprobs"])
                chunk["output_token_logprobs"] = meta["output_token_logprobs"][sent:total]
                if "output_top_logprobs" in meta:
                    chunk["output_top_logprobs"] = meta["output_top_logprobs"][sent:total]
                chunk["output_token_logprobs_length"] = total
                sent = total
            if piece:
                self._log(node.name, piece, chunk)

        # A typed value is cut to its literal when it ends, so it streams whole, at the end.
        out = self.backend.generate(
            self.prompt(), sampling, constraint, on_delta if rule is None else None
        )
        text, value = out.text, out.texts if out.texts is not None else out.text
        if rule is not None:
            text = _literal(text, rule)
            value = [_literal(t, rule) for t in value] if out.texts else text
            self._log(node.name, text, out.meta)
        start = len(self.text)
        self.text += text
        if node.name is not None:
            self.meta[node.name] = out.meta
            self.spans[node.name] = (start, len(self.text))
            if node.dtype is not None:
                self.values[node.name] = _Typed(value, node.dtype, node.name)
            self._log(node.name, None, out.meta)
            self._set_var(node.name, value)

    def _select(self, node: Select) -> None:
        method = node.method
        scores = self.backend.score_choices(
            self.prompt(), list(node.choices), method.requires_unconditional_logprobs
        )
        for choice, toks in zip(node.choices, scores.tokens):
            if not toks:
                raise ValueError(f"select: choice {choice!r} has no scored tokens")
        args = dict(
            choices=list(node.choices),
            normalized_prompt_logprobs=[sum(lp) / len(lp) for lp in scores.conditional],
            input_token_logprobs=scores.tokens,
            output_token_logprobs=[[] for _ in node.choices],
            unconditional_token_logprobs=scores.unconditional,
        )
        if node.temperature > 0:
            decision = method.sample(node.temperature, random.Random(), **args)
        else:
            decision = method(**args)
        choice = decision.decision
        if choice not in node.choices:
            raise ValueError(
                f"select: choices method {method!r} decided {choice!r}, which is not a choice"
            )
        self._append(choice)
        if node.name is not None:
            meta = dict(decision.meta_info or {})
            meta.update(scores.meta)
            meta["choice_index"] = node.choices.index(choice)
            if hasattr(method, "scores"):
                meta["scores"] = method.scores(scores.tokens, scores.unconditional)
            self.meta[node.name] = meta
            self.spans[node.name] = (len(self.text) - len(choice), len(self.text))
            self._log(node.name, choice, meta)
            self._log(node.name, None, meta)
            self._set_var(node.name, choice)

    def _separate_reasoning(self, node: SeparateReasoning) -> None:
        from braid.runtime.reasoning import split_reasoning

        # Later gens first: replacing a gen's text shifts only what comes after it.
        for name in sorted(node.names, key=lambda n: self.spans[n][0], reverse=True):
            value = self.variables[name]
            if not isinstance(value, str):
                raise ValueError(f"separate_reasoning: {name!r} has several samples (n > 1)")
            reasoning, answer = split_reasoning(value, node.model_type)
            start, end = self.spans[name]
            self.text = self.text[:start] + answer + self.text[end:]
            self.spans[name] = (start, start + len(answer))
            self._set_var(f"{name}_reasoning_content", reasoning)
            self._set_var(name, answer)

    def _join(self, join: _Join) -> None:
        for member in join.group.members:
            member._ex.sync()
        start = join.group.fork_text_len
        if join.mode == "gather_variable":
            names = {
                k
                for m in join.group.members
                for k, v in m._ex.variables.items()
                if k not in join.group.parent_vars or join.group.parent_vars[k] is not v
            }
            for name in sorted(names):
                self._set_var(name, [m._ex.variables.get(name) for m in join.group.members])
        elif join.mode == "concate_and_append":
            self._append("".join(m._ex.text[start:] for m in join.group.members))
        for member in join.group.members:
            member._ex.end()


def _literal(text: str, rule: DtypeRule) -> str:
    """The typed literal at the start of `text`; a text that is no whole literal (cut off by
    max_tokens) gets the rule's closing characters if they complete one, else stays as it
    is."""
    m = re.match(rule.value, text)
    if m is not None and (m.end() == len(text) or not rule.close):
        return m.group(0)
    if rule.close and re.fullmatch(rule.value, text + rule.close):
        return text + rule.close
    return m.group(0) if m else text


@dataclass(frozen=True)
class _Typed:
    """A typed gen's text, converted when asked (`ProgramState.get_value`): a text the type
    does not parse (a gen cut off by max_tokens) fails then, not the program."""

    text: str | list[str]
    dtype: type
    name: str

    def value(self) -> Any:
        if isinstance(self.text, list):
            return [_Typed(t, self.dtype, self.name).value() for t in self.text]
        t = self.text.strip()
        if self.dtype is bool:
            return t == "True"
        if self.dtype is str:
            return t[1:-1] if len(t) >= 2 and t[0] == t[-1] == '"' else t
        try:
            return self.dtype(t)
        except ValueError:
            raise ValueError(
                f"gen({self.name!r}): {self.text!r} is not a {self.dtype.__name__}"
            ) from None


class ProgramState:
    """The state a program appends to (`s`), and what `run` returns. SGLang's `ProgramState`:
    `s[name]` / `get_var` read a variable (the generated text), `s[name] = v` / `set_var` set
    one, `get_value` the converted value of a typed gen, `get_meta_info` its meta info,
    `text()`, `messages()`, `error()`, the streaming iterators. See the module docstring for
    when calls block."""

    def __init__(self, executor: _Executor) -> None:
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
            ex.backend.cache_prefix(ex.text)
        members = []
        for _ in range(n):
            session = f"{ex.session}.{len(ex.children)}" if ex.session else None
            child = _Executor(ex.backend, ex.defaults, session, ex.sessions, parent=ex)
            ex.children.append(child)
            members.append(ProgramState(child))
        return ForkGroup(self, members, len(ex.text), dict(ex.variables))

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
        typed = self._ex.values.get(name)
        if typed is None or typed.text is not var:
            return var
        return typed.value()

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
        braid's `choice_index` and `scores`."""
        self._ex.get_var(name)
        self._ex.sync()
        return dict(self._ex.meta[name])

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
        parent_vars: dict[str, Any],
    ) -> None:
        self.parent = parent
        self.members = members
        self.fork_text_len = fork_text_len
        self.parent_vars = parent_vars

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
        self.parent._ex.submit(_Join(self, mode), caller_location())
