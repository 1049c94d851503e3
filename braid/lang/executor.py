"""The worker behind each `ProgramState`: `Executor` runs one state's queue of nodes, in
order, in a thread of its own, against the backend; `Sessions` tracks the program sessions of
one run.

`Executor.submit` returns at once; readers (`sync`, `get_var`) wait on the executor's condition
until what they need has run. A node that fails stops the queue: its error is kept, with the
program line that queued it, and raised on the next read.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import queue
import random
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    Text,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
)

if TYPE_CHECKING:
    from braid.lang.interpreter import ForkGroup


class ProgramError(RuntimeError):
    """A program failed; the message starts with the program line that queued the failing
    step. The original exception is the `__cause__`."""


class UnknownVariable(KeyError, ValueError):
    """A program read a variable that nothing set."""

    def __str__(self) -> str:
        return str(self.args[0])


_END = object()


@dataclass
class Join:
    """Queued on the parent when a fork group joins."""

    group: ForkGroup
    mode: str


@dataclass
class Sessions:
    """The program sessions of one program run (the root state's and its forks'), closed when
    the run ends, and the run's `program` id (sent with every request, sessions or not)."""

    backend: Backend
    program: str | None = None
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


def gen_seed(seed: int, path: str, position: int) -> int:
    """The seed of the gen at `position` of the state at fork `path` in a run given `seed`."""
    digest = hashlib.sha256(f"{seed}|{path}|{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a signed 64-bit value, as sent


class Executor:
    """Runs one state's queue of nodes in a worker thread."""

    def __init__(
        self,
        backend: Backend,
        defaults: SamplingArgs,
        session: str | None,
        sessions: Sessions | None,
        parent: Executor | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.session = session
        self.sessions = sessions
        if session is not None and sessions is not None:
            sessions.add(session)
        # The position of this state's next call (gen or select) in the program run: a fork
        # goes on from its parent's (its branches run side by side), a join from the furthest
        # branch (the parent's next call follows them all).
        self.next_position = parent.next_position if parent else 0
        # Where the state stands among the run's forks ("" for the root, ".1" for a fork's
        # second branch, ".1.0" below it): with the call's position it names one gen of the run.
        self.path = f"{parent.path}.{len(parent.children)}" if parent else ""
        self.text = parent.text if parent else ""
        self.messages: list[dict[str, Any]] = [dict(m) for m in parent.messages] if parent else []
        self.open_role = parent.open_role if parent else None
        # The first text (or image) written outside any role, as a message shows it
        # (`Prompt.loose_text`).
        self.loose_text: str | None = parent.loose_text if parent else None
        self.role_start = parent.role_start if parent else 0
        # The prompt's images in order, one per image placeholder in `text`; a fork copies the
        # list, so its requests carry the same images as the prefix it shares.
        self.images: list[Any] = list(parent.images) if parent else []
        # A variable is the text generated (SGLang's contract); `values` holds the converted
        # value of a typed gen (dtype=int, ...), `spans` where each gen's text lies in `text`.
        self.variables: dict[str, Any] = dict(parent.variables) if parent else {}
        self.values: dict[str, Any] = dict(parent.values) if parent else {}
        self.spans: dict[str, tuple[int, int]] = dict(parent.spans) if parent else {}
        self.meta: dict[str, dict[str, Any]] = dict(parent.meta) if parent else {}
        # The names set on this state (a fork branch's: since the fork), which a join gathers.
        self.set_here: set[str] = set()
        self.scopes: list[tuple[str, int]] = []
        self.error: ProgramError | None = None
        self.ended = False
        self._end_queued = False
        # A streamed run's body runs in a thread of its own (`body_thread`, set when it starts):
        # a read from any other thread of a name nothing queued sets waits for the body to end,
        # since the body may yet queue it. A fork inherits both from the state it was made from.
        self.streamed = parent.streamed if parent else False
        self.body_thread: int | None = parent.body_thread if parent else None
        # The stream log: (variable or None, text piece or None for "variable done", meta).
        self.chunks: list[tuple[str | None, str | None, dict[str, Any]]] = []
        self.children: list[Executor] = []
        self._pending = 0
        # Queued nodes that will set a variable, per name, and queued joins (which may set
        # any): a read of a name waits for them, so it sees this turn's value, not an old one.
        self._writes: collections.Counter[str] = collections.Counter()
        self._joins = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="braid-program", daemon=True)
        self._thread.start()

    # ---- queue --------------------------------------------------------------------------
    def submit(self, node: Any, where: str) -> None:
        names = _writes(node)
        with self._cond:
            if self.ended or self._end_queued:  # queued behind its end, it would never run
                raise ProgramError(f"{where}: the program has ended; this state takes no more")
            self._pending += 1
            self._writes.update(names)
            self._joins += isinstance(node, Join)
        self._queue.put((node, where, names))

    def end(self) -> None:
        """Queue the end: after the queued nodes run, close the session and any forks."""
        with self._cond:
            if self._end_queued:
                return
            self._end_queued = True
            self._pending += 1
            self._cond.notify_all()
        self._queue.put((_END, "", []))

    def _work(self) -> None:
        while True:
            node, where, names = self._queue.get()
            if node is _END:
                for child in self.children:
                    child.end()
                    child.wait_ended()
                try:
                    if self.session is not None and self.sessions is not None:
                        self.sessions.close(self.session)
                    elif self.path == "" and self.sessions and self.sessions.program:
                        self.backend.end_program(self.sessions.program)  # no session to close
                except Exception as e:  # the runtime died: the run reports it below
                    self._fail("program end", e)
                with self._cond:
                    self.ended = True
                    self._pending -= 1
                    self._cond.notify_all()
                return
            ran = False
            if self.error is None:
                try:
                    self._run(node)
                    ran = True
                except Exception as e:
                    self._fail(where, e)
            with self._cond:
                self._pending -= 1
                if ran:  # what a failed or skipped node would have set stays unsettled
                    self._writes.subtract(names)
                    self._joins -= isinstance(node, Join)
                self._cond.notify_all()

    def _fail(self, where: str, e: Exception) -> None:
        if isinstance(e, ProgramError):
            err = ProgramError(str(e))
        else:
            err = ProgramError(f"{where}: {type(e).__name__}: {e}")
        err.__cause__ = e
        with self._cond:
            if self.error is None:  # the first error stopped the state; later ones follow it
                self.error = err
            self._cond.notify_all()

    def _body_may_queue(self) -> bool:
        """Whether a streamed run's body, still running in another thread than this one, may
        yet queue nodes on this state (call holding `_cond`)."""
        return self.streamed and not self._end_queued and threading.get_ident() != self.body_thread

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
        """The variable's value once no queued node will set it again (a gen reusing the
        name, a join); waits for it, and raises the state's error if the program failed."""

        def settled() -> bool:
            return name in self.variables and not self._writes[name] and not self._joins

        def ready() -> bool:
            if settled() or self.error is not None or self.ended:
                return True
            return self._pending == 0 and not self._body_may_queue()

        with self._cond:
            self._cond.wait_for(ready)
            if settled():
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

    def _set_var(self, name: str, value: Any, typed: _Typed | None = None) -> None:
        """Set variable `name`; `typed`: its typed gen's value, else it has none."""
        with self._cond:
            self.variables[name] = value
            self.set_here.add(name)
            if typed is None:
                self.values.pop(name, None)
            else:
                self.values[name] = typed
            self._cond.notify_all()

    def prompt(self) -> Prompt:
        """Where the state stands, for its next call (which takes the next position)."""
        content = self.text[self.role_start :] if self.open_role else ""
        position, self.next_position = self.next_position, self.next_position + 1
        return Prompt(
            self.text,
            list(self.messages),
            self.open_role,
            content,
            list(self.images),
            self.session,
            position,
            self.sessions.program if self.sessions is not None else None,
            self.loose_text,
        )

    def _run(self, node: Any) -> None:
        if isinstance(node, Join):
            self._join(node)
            return
        for leaf in flatten(node):
            self._run_leaf(leaf)

    def _run_leaf(self, node: Expr) -> None:
        if isinstance(node, Text):
            if self.open_role is None and self.loose_text is None and node.value.strip():
                text = node.value
                self.loose_text = repr(text if len(text) <= 40 else text[:37] + "...")
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
            placeholder = self.backend.image_placeholder  # ValueError: the model takes text only
            self.images.append(node.source)
            if self.open_role is None and self.loose_text is None:
                self.loose_text = "an image"
            self._append(placeholder)
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
        if node.sampling.seed is None and self.defaults.seed is not None:
            # The run's seed (or sampling_defaults'): each gen of the run gets its own, derived
            # from it and the gen's place, so a fork's branches do not sample the same text.
            sampling = dataclasses.replace(
                sampling, seed=gen_seed(self.defaults.seed, self.path, self.next_position)
            )
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
            typed = _Typed(value, node.dtype, node.name) if node.dtype is not None else None
            self._log(node.name, None, out.meta)
            self._set_var(node.name, value, typed)

    def _select(self, node: Select) -> None:
        method = node.method
        prompt = self.prompt()
        scores = self.backend.score_choices(
            prompt, list(node.choices), method.requires_unconditional_logprobs
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
            # With a run seed, the select's draw is seeded as a gen at its place would be.
            seed = self.defaults.seed
            if seed is not None:
                seed = gen_seed(seed, self.path, prompt.position)
            rng = random.Random(seed)
            decision = method.sample(node.temperature, rng, **args)
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

    def _join(self, join: Join) -> None:
        for member in join.group.members:
            member._ex.sync()
        self.next_position = max(
            [self.next_position] + [m._ex.next_position for m in join.group.members]
        )
        start = join.group.fork_text_len
        if join.mode == "gather_variable":
            members = [m._ex for m in join.group.members]
            for name in sorted(set().union(*(m.set_here for m in members))):
                # Each branch's own: None where it did not set the name (what it holds then is
                # the parent's, from before the fork).
                own = [name in m.set_here for m in members]
                texts = [m.variables[name] if o else None for m, o in zip(members, own)]
                self.meta[name] = [m.meta.get(name) if o else None for m, o in zip(members, own)]
                # Typed values when every branch that set it did so last with a typed gen of
                # one type.
                typed = [m.values.get(name) for m, o in zip(members, own) if o]
                joined = None
                if all(t is not None and t.dtype is typed[0].dtype for t in typed):
                    joined = _Typed(texts, typed[0].dtype, name)
                self._set_var(name, texts, joined)
        elif join.mode == "concate_and_append":
            self._append("".join(m._ex.text[start:] for m in join.group.members))
            # The images the branches added stand in that text, in the same order.
            for m in join.group.members:
                self.images += m._ex.images[join.group.fork_images_len :]
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
        if self.text is None:  # a fork branch that did not set it
            return None
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


def _writes(node: Any) -> list[str]:
    """The variables queued `node` sets (none known for a join, which may set any)."""
    if isinstance(node, Join):
        return []
    names = []
    for leaf in flatten(node):
        if isinstance(leaf, (Gen, Select)) and leaf.name is not None:
            names.append(leaf.name)
        elif isinstance(leaf, VarScopeEnd):
            names.append(leaf.name)
        elif isinstance(leaf, SeparateReasoning):
            names += [n for name in leaf.names for n in (name, f"{name}_reasoning_content")]
    return names
