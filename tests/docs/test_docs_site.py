"""The docs site's sources: the nav covers every page, every plot is drawn from the committed
results (and a missing input is skipped, not faked), the diagram spec reads, the server
reference is generated from the document a running server serves, and the quickstarts'
self-contained examples run.

`make test` also builds the whole site with `mkdocs build --strict`; these tests hold the
parts that build cannot see.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
# Pages the build hook makes (tools/docs/hooks.py): in the nav, never committed.
GENERATED = {"reference/server-api.md", "reference/python-api.md"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"test_docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plot() -> ModuleType:
    return _load(ROOT / "benchmarks" / "plot.py")


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    return _load(ROOT / "tools" / "docs" / "reference.py")


@pytest.fixture(scope="module")
def diagram() -> ModuleType:
    return _load(ROOT / "tools" / "docs" / "diagram.py")


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_nav_lists_every_page_once_and_generated_pages_are_not_committed():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - set(nav) == set(), "pages missing from mkdocs.yml's nav"
    assert set(nav) - on_disk == GENERATED, "nav entries that are neither a page nor generated"
    assert not on_disk & GENERATED, "a generated page was committed"


def _run_plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_plot_script_draws_every_plot_from_the_committed_results(tmp_path, plot):
    run = _run_plot("--out", str(tmp_path))
    assert "skipped" not in run.stdout
    names = {p.name for p in plot.PLOTS}
    assert {p.stem for p in tmp_path.iterdir()} == names
    for name in names:
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, f"{name}.png is suspiciously small"


def test_every_plot_the_docs_show_is_one_the_script_draws(plot):
    shown = {
        m
        for page in DOCS.rglob("*.md")
        for m in re.findall(r"img/bench/(\w+)\.png", page.read_text())
    }
    assert shown, "no page shows a plot"
    assert shown <= {p.name for p in plot.PLOTS}


def test_a_plot_whose_input_is_missing_is_skipped_with_the_reason(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("logs"))
    (results / "gpu_offline_cuda.json").unlink()
    (results / "gpu_decode_no_overlap_cuda.json").unlink()
    out = tmp_path / "out"
    run = _run_plot("--results", str(results), "--out", str(out))
    assert "plot offline_h200: skipped, no gpu_offline_cuda.json" in run.stdout
    assert not (out / "offline_h200.png").exists()
    # An optional input only takes its part out of the plot.
    assert "plot decode_roofline: no gpu_decode_no_overlap_cuda.json" in run.stdout
    assert (out / "decode_roofline.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "prefix_cpu.png").exists()


def test_serving_plot_reads_every_run_of_the_result(plot):
    result = json.loads((RESULTS / "serving_cpu.json").read_text())
    runs = plot.serving_runs(result)
    assert runs == result["runs"] and len({r["concurrency"] for r in runs}) > 1
    assert {r["mode"] for r in runs} == {"offline", "stream", "whole"}
    with pytest.raises(ValueError, match="no 'runs'"):
        plot.serving_runs({"concurrency": 32, "served": {"output_tok_s": 1.0}})


def test_architecture_spec_draws_every_box_as_text(tmp_path, diagram):
    d = diagram.parse((DOCS / "diagrams" / "architecture.txt").read_text())
    out = tmp_path / "a.svg"
    diagram.render(d, out)
    svg = out.read_text()
    for box in d.boxes.values():
        assert box.label.split("\n")[0].replace("&", "&amp;") in svg, box.id


def test_diagram_spec_errors_name_the_line(diagram):
    with pytest.raises(ValueError, match="line 2"):
        diagram.parse("box a 0 0 entry: A\nbox b 0 1 nonsense: B")
    with pytest.raises(ValueError, match="no box 'c'"):
        diagram.parse("box a 0 0 entry: A\narrow a -> c")


@pytest.mark.slow
def test_server_reference_is_the_document_a_running_server_serves(tmp_path, reference):
    from tests.server.conftest import start_server

    built = json.loads(json.dumps(reference.server_openapi()))
    s = start_server(tmp_path)
    try:
        served = httpx.get(f"{s.url}/openapi.json", timeout=30).json()
    finally:
        s.stop()
    assert built == served
    page = reference.render_server_api(built)
    for path, item in served["paths"].items():
        for method in item:
            assert f"### {method.upper()} `{path}`" in page
    for name in served["components"]["schemas"]:
        assert f"### {name} {{#" in page


def _runnable_quickstart_blocks() -> list[tuple[str, str]]:
    """(page, code) of each Python block in a quickstart that runs on its own: it starts
    braid's runtime on the embedded model (the others need a server or a vision model)."""
    found = []
    for page in sorted((DOCS / "quickstart").glob("*.md")):
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            if re.search(r"braid\.(LLM|Engine)\(\)", code):
                found.append((page.name, code))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "page,code", _runnable_quickstart_blocks(), ids=lambda x: x if x.endswith(".md") else ""
)
def test_quickstart_example_runs_on_the_embedded_model(tmp_path, page, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's braid
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, f"{page}: {run.stderr[-2000:]}"
    assert run.stdout.strip(), f"{page}: printed nothing"
