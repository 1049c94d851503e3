"""What every benchmark script shares: the machine description and the JSON result file."""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info(device: str) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return info


def write_result(benchmark: str, device: str, out: str | None, fields: dict) -> Path:
    """Write `fields` with the benchmark's name, date, command and machine as JSON (default:
    results/<benchmark>_<device>.json) and return the path."""
    result = {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", f"benchmarks/{benchmark}.py", *sys.argv[1:]]),
        "device": device,
        "machine": machine_info(device),
        **fields,
    }
    path = Path(out) if out else RESULTS / f"{benchmark}_{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
