"""Tracing: run a program symbolically and record its `RequestGraph`.

Arguments the trace is not given are placeholders: appending them (`s += question`,
`s += "Q: " + question`) records an `arg` node; using them in Python (an f-string, `str()`,
`if`, iteration) raises `TraceError` saying what to do. Variables read back (`s["x"]`) are
placeholders the same way. The trace runs no model.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from braid.lang.ir import (
    Arg,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Seq,
    Text,
    VarRef,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    flatten,
)
from braid.runtime.tokenizer.roles import RoleTemplate

# The graph being recorded in this context, if any (a program run inside a trace is an error).
TRACING: contextvars.ContextVar[RequestGraph | None] = contextvars.ContextVar(
    "braid_tracing", default=None
)


class TraceError(ValueError):
    """A program used an unknown value in a way that cannot be traced."""


class _Placeholder(Expr):
    """An unknown value while tracing. Appending it is fine; Python cannot look inside it."""

    def __init__(self, node: Arg | VarRef, what: str) -> None:
        self._node = node
        self._what = what

    def _refuse(self, use: str) -> TraceError:
        name = self._node.name
        return TraceError(
            f"{self._what} is used in {use}, which cannot be traced. Append it instead "
            f'(`s += {name}` or `s += "text" + {name}`), or give its value: '
            f"prog.trace({name}=...)"
        )

    def __str__(self) -> str:
        raise self._refuse("str()")

    def __format__(self, spec: str) -> str:
        raise self._refuse("an f-string or format()")

    def __bool__(self) -> bool:
        raise self._refuse("a condition (if/while/bool)")

    def __iter__(self):
        raise self._refuse("a loop or unpacking")

    def __len__(self) -> int:
        raise self._refuse("len()")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self._refuse(f"an attribute access (.{attr})")

    def __getitem__(self, key):
        raise self._refuse("indexing")

    def __eq__(self, other):
        raise self._refuse("a comparison")

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<unknown {self._what}>"


def _expr(value: Any) -> Expr:
    if isinstance(value, _Placeholder):
        return value._node
    if isinstance(value, Seq):
        return Seq(tuple(_expr(i) for i in value.items))
    return as_expr(value)


@dataclass
class GraphNode:
    id: int
    kind: str  # text, arg, var, role_begin, role_end, gen, select, image, scope_begin,
    # scope_end, separate_reasoning, fork, join
    branch: tuple[int, ...]  # fork member indices from the root, () for the main line
    node: Any = None
    label: str = ""
    graph: RequestGraph | None = field(default=None, repr=False, compare=False)

    def print_graph_dfs(self) -> str:
        """SGLang's tracer view: one line per node this one depends on (itself last), each
        as `%id = %previous + node`, forks and joins by their inputs."""
        assert self.graph is not None
        g = self.graph
        seen: set[int] = set()
        order: list[int] = []
        stack = [self.id]
        while stack:
            gid = stack.pop()
            if gid in seen:
                continue
            seen.add(gid)
            order.append(gid)
            stack.extend(g.predecessors(gid))
        lines = []
        for gid in sorted(order):
            n = g.nodes[gid]
            preds = g.predecessors(gid)
            what = f"{n.kind}({n.label})" if n.label else n.kind
            if n.kind == "join":
                lines.append(f"%{gid} = join({', '.join(f'%{p}' for p in preds)}, {n.label})")
            elif preds:
                lines.append(f"%{gid} = %{preds[0]} + {what}")
            else:
                lines.append(f"%{gid} = {what}")
        return "\n".join(lines) + "\n"


_KIND = {
    Text: "text",
    Arg: "arg",
    VarRef: "var",
    RoleBegin: "role_begin",
    RoleEnd: "role_end",
    Gen: "gen",
    Select: "select",
    Image: "image",
    VarScopeBegin: "scope_begin",
    VarScopeEnd: "scope_end",
    SeparateReasoning: "separate_reasoning",
}


def _label(node: Expr) -> str:
    if isinstance(node, Text):
        v = node.value if len(node.value) <= 40 else node.value[:37] + "..."
        return repr(v)
    if isinstance(node, (Arg, VarRef, VarScopeBegin, VarScopeEnd)):
        return node.name
    if isinstance(node, (RoleBegin, RoleEnd)):
        return node.role
    if isinstance(node, Gen):
        extra = ", ".join(f"{k}={v!r}" for k, v in node.sampling.given().items())
        if node.constraint:
            extra += (", " if extra else "") + node.constraint[0]
        if node.dtype:
            extra += (", " if extra else "") + f"dtype={node.dtype.__name__}"
        return f"{node.name!r}" + (f" ({extra})" if extra else "")
    if isinstance(node, Select):
        return f"{node.name!r} choices={list(node.choices)}"
    if isinstance(node, Image):
        return "<image>"
    if isinstance(node, SeparateReasoning):
        return f"{list(node.names)} ({node.model_type or 'deepseek-r1'})"
    return ""


@dataclass
class RequestGraph:
    """A program's shape: nodes in program order, edges from each node to the next, a `fork`
    node with an edge to the first node of each branch, and a `join` node with edges from the
    last node of each branch."""

    name: str = "program"
    nodes: list[GraphNode] = field(default_factory=list)
    edges: list[tuple[int, int]] = field(default_factory=list)
    variables: set[str] = field(default_factory=set)

    def add(self, kind: str, branch: tuple[int, ...], after: list[int], node=None, label="") -> int:
        gid = len(self.nodes)
        self.nodes.append(GraphNode(gid, kind, branch, node, label, self))
        self.edges += [(a, gid) for a in after]
        return gid

    def of_kind(self, kind: str) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind == kind]

    def count(self, kind: str) -> int:
        return len(self.of_kind(kind))

    def successors(self, gid: int) -> list[int]:
        return [b for a, b in self.edges if a == gid]

    def predecessors(self, gid: int) -> list[int]:
        return [a for a, b in self.edges if b == gid]

    @property
    def last_node(self) -> GraphNode | None:
        """The last node on the main line (SGLang's `tracer.last_node`)."""
        main = [n for n in self.nodes if not n.branch]
        return main[-1] if main else None

    def flatten_nodes(self) -> list[Expr]:
        """The IR nodes in program order (SGLang's `tracer.flatten_nodes()`); fork and join
        points, which are not IR nodes, are left out."""
        return [n.node for n in self.nodes if n.node is not None]

    def constant_prefix(self) -> list[Expr]:
        """The leading text and role boundaries on the main line, before anything that
        depends on arguments or generation: what every run of the program starts with."""
        out: list[Expr] = []
        for n in self.nodes:
            if n.branch or n.kind not in ("text", "role_begin", "role_end"):
                break
            out.append(n.node)
        return out

    def __str__(self) -> str:
        lines = [f"RequestGraph {self.name}: {len(self.nodes)} nodes, {len(self.edges)} edges"]
        for n in self.nodes:
            indent = "  " * (1 + len(n.branch))
            where = f"[{'.'.join(map(str, n.branch))}] " if n.branch else ""
            lines.append(f"{indent}{n.id:>3} {where}{n.kind} {n.label}".rstrip())
        return "\n".join(lines)


class TracingState:
    """Stands in for `ProgramState` while tracing: records instead of running."""

    def __init__(self, graph: RequestGraph, branch: tuple[int, ...], last: list[int]) -> None:
        self._graph = graph
        self._branch = branch
        self._last = last

    def _add(self, expr: Expr) -> None:
        for leaf in flatten(expr):
            kind = _KIND.get(type(leaf))
            if kind is None:
                raise TraceError(f"cannot trace a {type(leaf).__name__}")
            gid = self._graph.add(kind, self._branch, self._last, leaf, _label(leaf))
            self._last = [gid]
            if isinstance(leaf, (Gen, Select)) and leaf.name is not None:
                self._graph.variables.add(leaf.name)
            if isinstance(leaf, VarScopeEnd):
                self._graph.variables.add(leaf.name)

    def __iadd__(self, other: Any) -> TracingState:
        self._add(_expr(other))
        return self

    def _role(self, role: str, expr: Any):
        if expr is None:
            return self._scope(RoleBegin(role), RoleEnd(role))
        self._add(Seq((RoleBegin(role), _expr(expr), RoleEnd(role))))
        return None

    @contextmanager
    def _scope(self, begin: Expr, end: Expr) -> Iterator[None]:
        self._add(begin)
        yield
        self._add(end)

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def var_scope(self, name: str):
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    def __getitem__(self, name: str) -> _Placeholder:
        if name not in self._graph.variables:
            raise TraceError(f"variable {name!r} is read before any gen/select/var_scope sets it")
        return _Placeholder(VarRef(name), f"variable {name!r}")

    get_var = __getitem__
    get_value = __getitem__

    def __setitem__(self, name: str, value: Any) -> None:
        self._graph.variables.add(name)  # set in Python: its value is not part of the graph

    set_var = __setitem__

    def __contains__(self, name: str) -> bool:
        return name in self._graph.variables

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TracingForkGroup:
        n = size
        if not isinstance(n, int) or n < 1:
            raise TraceError(f"fork: size must be a positive integer, got {n!r}")
        gid = self._graph.add("fork", self._branch, self._last, None, f"n={n}")
        self._last = [gid]
        members = [TracingState(self._graph, self._branch + (i,), [gid]) for i in range(n)]
        return TracingForkGroup(self, members)

    def _unavailable(self, what: str):
        raise TraceError(f"{what} has no value while tracing: prog.trace() records the shape only")

    def text(self) -> str:
        self._unavailable("s.text()")

    def messages(self):
        self._unavailable("s.messages()")

    def get_meta_info(self, name: str):
        self._unavailable("s.get_meta_info()")

    def sync(self) -> None:
        return None

    def error(self) -> None:
        return None

    @contextmanager
    def copy(self) -> Iterator[TracingState]:
        group = self.fork(1)
        yield group[0]
        group.join()


class TracingForkGroup:
    def __init__(self, parent: TracingState, members: list[TracingState]) -> None:
        self.parent = parent
        self.members = members

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i: int) -> TracingState:
        return self.members[i]

    def __iter__(self):
        return iter(self.members)

    def __setitem__(self, i: int, value: TracingState) -> None:
        if value is not self.members[i]:
            raise TraceError("fork group: members cannot be replaced; append to forks[i]")

    def __iadd__(self, other: Any) -> TracingForkGroup:
        for i, m in enumerate(self.members):
            if isinstance(other, (list, tuple)):
                m += other[i]
            else:
                m += other(i) if callable(other) and not isinstance(other, Expr) else other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        last = [g for m in self.members for g in m._last]
        p = self.parent
        p._last = [p._graph.add("join", p._branch, last, None, mode)]


def trace(program, given: dict[str, Any], placeholders: set[str] | None = None) -> RequestGraph:
    """Record `program`'s graph. Arguments in `given` are used as they are; the others (and
    those in `placeholders`) are unknown."""
    graph = RequestGraph(program.__name__)
    sig = inspect.signature(program.func)
    kwargs: dict[str, Any] = {}
    for name in program.arg_names:
        param = sig.parameters[name]
        if name in given and name not in (placeholders or set()):
            kwargs[name] = given[name]
        elif param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        elif param.default is not param.empty and name not in (placeholders or set()):
            kwargs[name] = param.default
        else:
            kwargs[name] = _Placeholder(Arg(name), f"argument {name!r}")
    state = TracingState(graph, (), [])
    token = TRACING.set(graph)
    try:
        program.func(state, **kwargs)
    except TraceError as e:
        e.graph = graph  # what was recorded before the untraceable use
        raise
    finally:
        TRACING.reset(token)
    return graph


def render_constant(nodes: list[Expr], template: RoleTemplate) -> str:
    """The text of constant nodes (text and role boundaries) under `template`."""
    text, first = "", True
    for node in nodes:
        if isinstance(node, Text):
            text += node.value
        elif isinstance(node, RoleBegin):
            try:
                text += template.begin(node.role, first and not text)
            except KeyError:
                return text
        elif isinstance(node, RoleEnd):
            text += template.end(node.role)
        first = False if isinstance(node, RoleEnd) else first
    return text
