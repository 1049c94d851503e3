"""The package's shape: dependencies between its units point one way (no import cycle), and no
file is past the size at which it is two files.

A unit is a package directly under `braid/` (`braid.lang`, `braid.kernels`) or directly under
`braid/runtime/` (`braid.runtime.scheduler`), or else one module file (`braid.runtime.engine`,
`braid.utils`, the top package's `__init__` as `braid`). Every import statement counts, at
module level, inside functions and under `if TYPE_CHECKING:` alike; names given to
`importlib.import_module` as strings (the lazy registries) are not import statements.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "braid"
MAX_LINES = 600

# One edge of the unit graph: (from unit, to unit) -> where an import makes it.
Edges = dict[tuple[str, str], str]


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package's `__init__`)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def unit_of(module: str) -> str:
    """The unit a module belongs to (see the module docstring)."""
    parts = module.split(".")
    depth = 3 if parts[:2] == ["braid", "runtime"] else 2
    head = parts[:depth]
    if len(parts) >= depth and ROOT.joinpath(*head).is_dir():
        return ".".join(head)
    return module


def _imported_modules(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The braid modules an import statement names (`from pkg import sub` names `pkg.sub`
    when that is a module, else `pkg`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "braid"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "braid":
        return []
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    return subs or [target]


def unit_edges() -> Edges:
    """Every edge between two different units, with the first `file:line` that makes it."""
    parsed = [(path, *_module_name(path)) for path in _files()]
    known = {module for _, module, _ in parsed}
    edges: Edges = {}
    for path, module, is_package in parsed:
        src = unit_of(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported_modules(node, module, is_package, known):
                dst = unit_of(target)
                if dst != src:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    edges.setdefault((src, dst), where)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one unit, each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)
        graph[dst]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_unit_of_follows_the_package_layout():
    assert unit_of("braid") == "braid"
    assert unit_of("braid.lang.backends.base") == "braid.lang"
    assert unit_of("braid.kernels") == "braid.kernels"
    assert unit_of("braid.kernels.norm") == "braid.kernels"
    assert unit_of("braid.runtime") == "braid.runtime"
    assert unit_of("braid.runtime.scheduler.scheduler") == "braid.runtime.scheduler"
    assert unit_of("braid.runtime.engine") == "braid.runtime.engine"
    assert unit_of("braid.runtime.registry") == "braid.runtime.registry"


def test_cycle_finder_reports_every_unit_of_a_cycle_and_nothing_else():
    edges = {("a", "b"): "", ("b", "c"): "", ("c", "a"): "", ("c", "d"): "", ("e", "d"): ""}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({("a", "b"): "", ("b", "c"): ""}) == []


def test_no_import_cycle_between_units():
    edges = unit_edges()
    assert ("braid.runtime.layers", "braid.kernels") in edges  # the walk sees imports at all
    lines = []
    for component in cycles(edges):
        lines.append("cycle: " + ", ".join(component))
        members = set(component)
        for (src, dst), where in sorted(edges.items()):
            if src in members and dst in members:
                lines.append(f"    {src} -> {dst}  ({where})")
    assert not lines, "import cycles between units:\n" + "\n".join(lines)


def test_no_file_is_over_600_lines():
    long = {}
    for path in _files():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long[str(path.relative_to(ROOT))] = n
    assert not long, f"files over {MAX_LINES} lines (split each in two): {long}"
