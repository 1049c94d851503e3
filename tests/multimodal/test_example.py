"""`examples/multimodal_pipeline.py` runs as a user would run it (a tiny random Qwen2.5-VL on
the CPU): every stage prints, each image goes through the vision tower once although its
program asks five questions of it, and the trace is printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multimodal_pipeline.py"


def test_multimodal_pipeline_example_runs_and_encodes_each_image_once():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--images", "2"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.count("caption:") == 2 and text.count("answers:") == 2
    categories = re.findall(r"category: (\w+)", text)
    assert len(categories) == 2 and set(categories) <= {"animal", "landscape", "object", "person"}
    records = re.findall(r"record:   '(.*)'", text)
    assert len(records) == 2 and all(re.match(r'\{\s*"label"\s*:', r) for r in records)
    assert "vision tower runs: 2 for 2 images" in text
    assert "RequestGraph inspect_image" in text
