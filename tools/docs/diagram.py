"""Draws a box-and-arrow diagram from a plain-text spec (the format is described at the top of
docs/diagrams/architecture.txt) into an SVG with matplotlib, so the picture is built from a
reviewable text file and needs no Graphviz or browser-side renderer.

    python tools/docs/diagram.py docs/diagrams/architecture.txt /tmp/architecture.svg
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

COL_W = 3.9  # width of one grid column, in drawing units
ROW_H = 1.5  # height of one grid row
BOX_H = 0.95
GAP = 0.3  # between boxes in neighbouring columns
COLORS = {"entry": "#eeeeee", "frontend": "#dbe8f7", "core": "#fbe5cc", "worker": "#dcefd9"}


@dataclass(frozen=True)
class Box:
    id: str
    col0: int
    col1: int
    row: int
    kind: str
    label: str

    @property
    def left(self) -> float:
        return self.col0 * COL_W + GAP / 2

    @property
    def right(self) -> float:
        return (self.col1 + 1) * COL_W - GAP / 2

    @property
    def top(self) -> float:
        return -self.row * ROW_H

    @property
    def bottom(self) -> float:
        return self.top - BOX_H

    @property
    def cy(self) -> float:
        return self.top - BOX_H / 2


@dataclass(frozen=True)
class Arrow:
    src: str
    dst: str
    side: str
    label: str


@dataclass(frozen=True)
class Group:
    col0: int
    col1: int
    row0: int
    row1: int
    label: str


@dataclass
class Diagram:
    boxes: dict[str, Box] = field(default_factory=dict)
    arrows: list[Arrow] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)


_SPAN = r"(\d+)(?:-(\d+))?"
_BOX = re.compile(rf"box (\w+) {_SPAN} (\d+) (\w+): (.+)")
_ARROW = re.compile(r"arrow (\w+) -> (\w+)(?: (down|left|right))?(?:: (.*))?")
_GROUP = re.compile(rf"group {_SPAN} {_SPAN}: (.+)")


def parse(text: str) -> Diagram:
    """The diagram `text` describes; a line that is none of the forms, an unknown box kind or
    an arrow to an unknown box is a `ValueError` naming the line."""
    d = Diagram()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if m := _BOX.fullmatch(line):
            bid, c0, c1, row, kind, label = m.groups()
            if kind not in COLORS:
                raise ValueError(f"line {n}: box kind {kind!r} is not one of {sorted(COLORS)}")
            c1 = c1 or c0
            d.boxes[bid] = Box(bid, int(c0), int(c1), int(row), kind, label.replace("\\n", "\n"))
        elif m := _ARROW.fullmatch(line):
            src, dst, side, label = m.groups()
            d.arrows.append(Arrow(src, dst, side or "down", label or ""))
        elif m := _GROUP.fullmatch(line):
            c0, c1, r0, r1, label = m.groups()
            d.groups.append(Group(int(c0), int(c1 or c0), int(r0), int(r1 or r0), label))
        else:
            raise ValueError(f"line {n}: cannot read {line!r}")
    for a in d.arrows:
        for end in (a.src, a.dst):
            if end not in d.boxes:
                raise ValueError(f"arrow {a.src} -> {a.dst}: no box {end!r}")
    return d


def render(d: Diagram, out: Path) -> None:
    """Draw `d` into `out` (SVG: text kept as text; the same spec gives the same file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    plt.rcParams["svg.fonttype"] = "none"
    plt.rcParams["svg.hashsalt"] = "braid"
    cols = max(b.col1 for b in d.boxes.values()) + 1
    rows = max(b.row for b in d.boxes.values()) + 1
    width, height = cols * COL_W + 1.2, rows * ROW_H + 0.2
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.2, width - 0.2)
    ax.set_ylim(-height + 0.3, 0.5 - 0.4)
    ax.set_axis_off()

    for g in d.groups:
        x0, x1 = g.col0 * COL_W + 0.02, (g.col1 + 1) * COL_W - 0.02
        y0, y1 = -g.row0 * ROW_H + 0.32, -g.row1 * ROW_H - BOX_H - 0.1
        ax.add_patch(Rectangle((x0, y1), x1 - x0, y0 - y1, fill=False, ls="--", ec="#888888"))
        ax.text(x0 + 0.08, y0 - 0.04, g.label, va="top", size=8, style="italic", color="#555")

    for b in d.boxes.values():
        ax.add_patch(
            FancyBboxPatch(
                (b.left, b.bottom),
                b.right - b.left,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=0.12",
                fc=COLORS[b.kind],
                ec="#333333",
            )
        )
        head, _, rest = b.label.partition("\n")
        ax.text(
            (b.left + b.right) / 2,
            b.cy + 0.17,
            head,
            ha="center",
            va="center",
            size=10,
            weight="bold",
        )
        if rest:
            ax.text((b.left + b.right) / 2, b.cy - 0.17, rest, ha="center", va="center", size=8)

    style = {"arrowstyle": "-|>", "color": "#333333", "lw": 1.2, "shrinkA": 0, "shrinkB": 0}
    for a in d.arrows:
        src, dst = d.boxes[a.src], d.boxes[a.dst]
        if a.side == "down":
            lo, hi = max(src.left, dst.left), min(src.right, dst.right)
            x0 = x1 = (lo + hi) / 2 if lo < hi else None
            if x0 is None:
                x0, x1 = (src.left + src.right) / 2, (dst.left + dst.right) / 2
            ax.annotate("", (x1, dst.top), (x0, src.bottom), arrowprops=style)
            if a.label:
                # Near the source: a frame drawn around the target's process starts lower.
                ax.text((x0 + x1) / 2 + 0.08, src.bottom - 0.1, a.label, va="center", size=8)
        else:
            sign = 1 if a.side == "right" else -1
            edge = (lambda b: b.right) if sign > 0 else (lambda b: b.left)
            far = (max if sign > 0 else min)(edge(src), edge(dst)) + sign * 0.45
            ax.plot([edge(src), far, far], [src.cy, src.cy, dst.cy], color="#333333", lw=1.2)
            ax.annotate("", (edge(dst), dst.cy), (far, dst.cy), arrowprops=style)
            if a.label:
                ym = (src.cy + dst.cy) / 2
                ax.text(
                    far + sign * 0.08, ym, a.label, rotation=90, ha="center", va="center", size=8
                )
    fig.savefig(out, format=out.suffix.lstrip(".") or "svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.txt OUT.svg")
    render(parse(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
