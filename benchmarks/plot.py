"""Plots of the measured figures: each PNG is drawn from JSON files in benchmarks/results/.

    python benchmarks/plot.py                    # every plot into benchmarks/plots/
    python benchmarks/plot.py --out site/img/bench --only decode_roofline

A plot whose input file is missing is skipped, with a line saying which file it needed; an
optional input that is missing leaves out only its part (and says so). Nothing is estimated or
filled in: every bar and point is a number some benchmark script wrote. The docs build
(tools/docs/hooks.py) calls `render` and puts the PNGs into the site.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

BRAID = "#3b6fb6"
BASELINE = "#a0a0a0"
BOUND = "#c0392b"
OTHER = "#7fa7d9"

Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Plot:
    """One PNG: the result files it needs, the ones it uses when present, how it is drawn."""

    name: str
    needs: tuple[str, ...]
    draw: Callable[[Results, Any], None]
    uses: tuple[str, ...] = ()


def _machine(d: dict[str, Any]) -> str:
    """Where and when `d` was measured, for a title."""
    m = d.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpu', 'CPU')}, {m.get('cpu_threads', '?')} threads"
    return f"{where}, {d['date'][:10]}" if "date" in d else where


def _label_bars(ax: Any, bars: Any, texts: list[str]) -> None:
    for bar, text in zip(bars, texts):
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )


def draw_decode_roofline(r: Results, ax: Any) -> None:
    d = r["gpu_decode_cuda.json"]
    labels, values, colors = [], [], []
    before = r.get("gpu_decode_no_overlap_cuda.json")
    if before is not None:
        labels.append("braid, first run\n(no overlap)")
        values.append(before["braid_tok_s"])
        colors.append(OTHER)
    labels += ["braid\nend to end", "braid\ndecode steps"]
    values += [d["braid_tok_s"], d["braid_decode_tok_s"]]
    colors += [BRAID, BRAID]
    bars = ax.bar(labels, values, color=colors)
    roof = d["roofline_tok_s"]
    _label_bars(ax, bars, [f"{v:.0f} tok/s\n{v / roof:.3f} of roofline" for v in values])
    label = f"roofline {roof:.0f} tok/s (all weight bytes / measured copy rate)"
    ax.axhline(roof, color=BOUND, ls="--", lw=1.5, label=label)
    target = d.get("target_fraction")
    if target:
        ax.axhline(target * roof, color=BOUND, ls=":", lw=1, label=f"target: {target} of roofline")
    ax.set_ylim(0, roof * 1.3)
    ax.legend(loc="upper left")
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"Batch-1 decode, {d['model']} {d['dtype']}, {d['input_len']} in / {d['output_len']} out"
        f" ({_machine(d)})"
    )


def draw_offline_h200(r: Results, ax: Any) -> None:
    d = r["gpu_offline_cuda.json"]
    labels = [f"transformers\nbatch {row['batch_size']}" for row in d["hf_rows"]]
    values = [row["tok_s"] for row in d["hf_rows"]]
    colors = [BASELINE] * len(values)
    labels += ["braid", "bound"]
    values += [d["braid_tok_s"], d["bound_tok_s"]]
    colors += [BRAID, BOUND]
    bars = ax.bar(labels, values, color=colors)
    hf = d["hf_tok_s"]
    _label_bars(ax, bars, [f"{v:,.0f}\n{v / hf:.2f}x hf best" for v in values])
    ax.set_ylim(0, max(values) * 1.2)
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"Offline, {d['num_prompts']} x ({d['input_len']} in, {d['output_len']} out), "
        f"{d['model']} {d['dtype']} ({_machine(d)})\n"
        f"braid = {d['fraction_of_bound']:.3f} of the bound"
    )


def draw_offline_cpu(r: Results, ax: Any) -> None:
    d = r["offline_throughput_cpu.json"]
    _grouped(
        ax,
        [f"batch {row['batch_size']}" for row in d["rows"]],
        [("braid", [row["braid_tok_s"] for row in d["rows"]], BRAID)],
        [("transformers", [row["hf_tok_s"] for row in d["rows"]], BASELINE)],
        [f"{row['speedup']:.2f}x" for row in d["rows"]],
    )
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"Offline, {d['input_len']} in / {d['output_len']} out, SmolLM2-135M float32 "
        f"({_machine(d)})"
    )


def _grouped(
    ax: Any,
    groups: list[str],
    first: list[tuple[str, list[float], str]],
    second: list[tuple[str, list[float], str]],
    ratios: list[str],
) -> None:
    """Two bars per group (`second` drawn left, `first` right), `ratios` above the pair."""
    import numpy as np

    x = np.arange(len(groups))
    w = 0.38
    (name2, v2, c2), (name1, v1, c1) = second[0], first[0]
    ax.bar(x - w / 2, v2, w, label=name2, color=c2)
    bars = ax.bar(x + w / 2, v1, w, label=name1, color=c1)
    _label_bars(ax, bars, ratios)
    ax.set_xticks(x, groups)
    ax.set_ylim(0, max(v1 + v2) * 1.15)
    ax.legend()


def _draw_prefix(d: dict[str, Any], ax: Any, what: str) -> None:
    rows = d["rows"]
    _grouped(
        ax,
        [row["workload"].replace("_", " ") for row in rows],
        [("radix cache", [row["cache"]["wall_s"] for row in rows], BRAID)],
        [("no cache", [row["no_cache"]["wall_s"] for row in rows], BASELINE)],
        [
            f"{row['speedup']:.2f}x, hit {row['cache']['hit_rate']:.2f}"
            f" (best {row['cache']['best_hit_rate']:.2f})"
            for row in rows
        ],
    )
    ax.set_ylabel("wall time (s), lower is better")
    ax.set_title(f"Prefix sharing, {what} ({_machine(d)})")


def draw_prefix_cpu(r: Results, ax: Any) -> None:
    _draw_prefix(r["prefix_sharing_cpu.json"], ax, "SmolLM2-135M float32")


def draw_prefix_h200(r: Results, ax: Any) -> None:
    d = r["gpu_prefix_cuda.json"]
    _draw_prefix(d, ax, f"{d['model']} {d['dtype']}")


def serving_runs(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of a serving result (benchmarks/serving.py's `runs`: concurrency, mode,
    output tok/s); a result without them is refused by name."""
    if "runs" not in d:
        raise ValueError("serving result has no 'runs' (written by an older serving.py)")
    return d["runs"]


def draw_serving_cpu(r: Results, ax: Any) -> None:
    d = r["serving_cpu.json"]
    runs = serving_runs(d)
    colors = {"stream": BRAID, "whole": OTHER, "offline": BASELINE}
    for mode in ("offline", "whole", "stream"):
        pts = sorted((x["concurrency"], x["output_tok_s"]) for x in runs if x["mode"] == mode)
        if not pts:
            continue
        xs, ys = zip(*pts)
        label = {"stream": "served, streamed (SSE)", "whole": "served, whole responses"}
        ax.plot(xs, ys, "o-", color=colors[mode], label=label.get(mode, "offline LLM.generate"))
        for x, y in pts:
            ax.annotate(f"{y:.1f}", (x, y), xytext=(6, 0), textcoords="offset points", fontsize=8)
    concurrencies = sorted({x["concurrency"] for x in runs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlim(concurrencies[0] / 2, concurrencies[-1] * 2)
    ax.set_ylim(0, max(x["output_tok_s"] for x in runs) * 1.3)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"Served vs offline, {d['input_len']} in / {d['output_len']} out, "
        f"{d.get('model', 'SmolLM2-135M')} ({_machine(d)})"
    )
    ax.legend()


def draw_constrained_cpu(r: Results, ax: Any) -> None:
    d = r["structured_cpu.json"]
    rows = d["decode"]
    _grouped(
        ax,
        [f"batch {row['batch_size']}" for row in rows],
        [("constrained", [row["constrained_decode_ms_per_token"] for row in rows], BRAID)],
        [("free", [row["free_decode_ms_per_token"] for row in rows], BASELINE)],
        [f"{row['overhead']:+.1%}, mask {row['mask_share_of_free_step']:.1%}" for row in rows],
    )
    ax.set_ylabel("decode ms / token, lower is better")
    ax.set_title(
        f"Constrained decoding ({d.get('grammar_backend', '?')}), SmolLM2-135M ({_machine(d)})"
    )


GPU_BACKENDS = ("llguidance", "xgrammar", "outlines")


def draw_constrained_h200(r: Results, ax: Any) -> None:
    import numpy as np

    runs = [(b, r[f"structured_gpu_{b}_cuda.json"]) for b in GPU_BACKENDS]
    runs = [(b, d) for b, d in runs if d is not None]
    batches = [row["batch"] for row in runs[0][1]["rows"]]
    x = np.arange(len(batches))
    w = 0.8 / len(runs)
    colors = {"llguidance": BRAID, "xgrammar": OTHER, "outlines": BASELINE}
    for i, (backend, d) in enumerate(runs):
        overhead = {row["batch"]: row["overhead"] * 100 for row in d["rows"]}
        values = [overhead.get(b, float("nan")) for b in batches]
        bars = ax.bar(x + (i - (len(runs) - 1) / 2) * w, values, w, label=backend)
        for bar in bars:
            bar.set_color(colors.get(backend, OTHER))
        _label_bars(ax, bars, [f"{v:+.1f}%" for v in values])
    ax.set_xticks(x, [f"batch {b}" for b in batches])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("constrained decode time over free (%)")
    ax.legend(title="grammar backend")
    d = runs[0][1]
    ax.set_title(
        f"Constrained decoding overhead (regex {d['regex']}), {d['model']} ({_machine(d)})"
    )


PLOTS = (
    Plot(
        "decode_roofline",
        ("gpu_decode_cuda.json",),
        draw_decode_roofline,
        ("gpu_decode_no_overlap_cuda.json",),
    ),
    Plot("offline_h200", ("gpu_offline_cuda.json",), draw_offline_h200),
    Plot("offline_cpu", ("offline_throughput_cpu.json",), draw_offline_cpu),
    Plot("prefix_cpu", ("prefix_sharing_cpu.json",), draw_prefix_cpu),
    Plot("prefix_h200", ("gpu_prefix_cuda.json",), draw_prefix_h200),
    Plot("serving_cpu", ("serving_cpu.json",), draw_serving_cpu),
    Plot("constrained_cpu", ("structured_cpu.json",), draw_constrained_cpu),
    Plot(
        "constrained_h200",
        ("structured_gpu_llguidance_cuda.json",),
        draw_constrained_h200,
        ("structured_gpu_xgrammar_cuda.json", "structured_gpu_outlines_cuda.json"),
    ),
)


def render(
    out: Path, results: Path = RESULTS, only: set[str] | None = None, log: Callable = print
) -> list[Path]:
    """Draw every plot (or those named in `only`) whose inputs are in `results` into `out` as
    `<name>.png`; returns the files written. Each skipped plot or left-out part is logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for plot in PLOTS:
        if only is not None and plot.name not in only:
            continue
        missing = [f for f in plot.needs if not (results / f).is_file()]
        if missing:
            log(f"plot {plot.name}: skipped, no {', '.join(missing)} in {results}")
            continue
        data = {f: json.loads((results / f).read_text()) for f in plot.needs}
        for f in plot.uses:
            present = (results / f).is_file()
            data[f] = json.loads((results / f).read_text()) if present else None
            if not present:
                log(f"plot {plot.name}: no {f} in {results}, its part left out")
        fig, ax = plt.subplots(figsize=(9, 4.8), dpi=100)
        plot.draw(data, ax)
        ax.title.set_fontsize(10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        fig.tight_layout()
        path = out / f"{plot.name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=RESULTS.parent / "plots")
    ap.add_argument("--only", default=None, help="comma-separated plot names")
    args = ap.parse_args()
    names = {p.name for p in PLOTS}
    only = set(args.only.split(",")) if args.only else None
    if only is not None and only - names:
        ap.error(f"unknown plots {sorted(only - names)}; known: {sorted(names)}")
    for path in render(args.out, args.results, only):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
