"""mkdocs hooks (mkdocs.yml `hooks:`): the generated parts of the site, made at every build and
never committed.

- reference/server-api.md: from the OpenAPI document of the app `braid serve` runs;
- reference/python-api.md: from the signatures and docstrings of braid's exports;
- img/architecture.svg: drawn from docs/diagrams/architecture.txt;
- img/bench/*.png: benchmarks/plot.py over benchmarks/results/*.json.

A page that links a generated file that was not made (a plot whose results are missing) is a
broken link, which `mkdocs build --strict` fails on.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
log = logging.getLogger("mkdocs.hooks.braid")


def _load(path: Path) -> ModuleType:
    """The module at `path` (these scripts are not in a package)."""
    spec = importlib.util.spec_from_file_location(f"braid_docs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the braid package, when mkdocs is not run from .venv
    t0 = time.perf_counter()
    reference = _load(HERE / "reference.py")
    diagram = _load(HERE / "diagram.py")
    plot = _load(ROOT / "benchmarks" / "plot.py")

    def add(uri: str, content: str | bytes) -> None:
        files.append(File.generated(config, uri, content=content))

    add("reference/server-api.md", reference.render_server_api(reference.server_openapi()))
    add("reference/python-api.md", reference.render_python_api())
    with tempfile.TemporaryDirectory() as tmp:
        svg = Path(tmp) / "architecture.svg"
        diagram.render(diagram.parse((ROOT / "docs/diagrams/architecture.txt").read_text()), svg)
        add("img/architecture.svg", svg.read_bytes())
        for png in plot.render(Path(tmp) / "bench", log=log.info):
            add(f"img/bench/{png.name}", png.read_bytes())
    log.info("generated references, diagram and plots in %.1f s", time.perf_counter() - t0)
    return files
