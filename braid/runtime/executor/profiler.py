"""The torch profiler over the scheduler's forwards, started and stopped by an operator
(`LLM.start_profile` / `stop_profile`, `POST /start_profile` / `/stop_profile`, as in SGLang
and vLLM). While it runs, each forward is a named range: `braid.prefill`, `braid.decode`
(`braid.decode.graph` when a CUDA graph replays it) and, inside a prefill, `braid.vision_tower`.
Stopping writes a Chrome trace (open it in Perfetto) and the profiler's table of totals."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

# Where profiles go when `start_profile` names no directory (SGLang: SGLANG_TORCH_PROFILER_DIR).
PROFILER_DIR_ENV = "BRAID_TORCH_PROFILER_DIR"
TABLE_ROWS = 60


class StepProfiler:
    """One process's profiler; at most one profile runs at a time."""

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None
        self._dir: Path | None = None
        self._started = 0.0
        self.forwards = 0  # forwards recorded by the running profile

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, output_dir: str | None = None) -> None:
        """Start recording CPU and (where there is one) CUDA activity; the files go to
        `output_dir`, else `$BRAID_TORCH_PROFILER_DIR`. `ValueError` if a profile already runs,
        or neither names a directory, or it cannot be created."""
        if self.active:
            raise ValueError("a profile is already running: stop_profile first")
        where = output_dir or os.environ.get(PROFILER_DIR_ENV)
        if not where:
            raise ValueError(
                f"start_profile needs an output directory: pass one, or set {PROFILER_DIR_ENV}"
            )
        try:
            Path(where).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"start_profile: cannot create {where}: {e.strerror}") from None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.start()
        self._dir, self._started, self.forwards = Path(where), time.time(), 0

    def stop(self) -> list[str]:
        """Stop the running profile and write `braid-<pid>-<start time>.trace.json.gz` (the
        trace) and `....txt` (totals per operation and range, by device time where there is a
        device); returns their paths. `ValueError` if none runs."""
        if self._prof is None or self._dir is None:
            raise ValueError("no profile is running: start_profile first")
        prof, self._prof = self._prof, None
        prof.stop()
        when = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self._started))
        stem = self._dir / f"braid-{os.getpid()}-{when}"
        trace, table = f"{stem}.trace.json.gz", f"{stem}.txt"
        prof.export_chrome_trace(trace)
        events = prof.key_averages()
        cuda = torch.cuda.is_available()
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(table, "w") as f:
            f.write(f"{self.forwards} forwards profiled\n")
            f.write(events.table(sort_by=sort, row_limit=TABLE_ROWS))
            f.write("\n\nbraid's ranges (CPU time includes waiting for the device):\n")
            ranges = [e for e in events if e.key.startswith("braid.")]
            for e in sorted(ranges, key=lambda e: e.key):
                device = getattr(e, "device_time_total", 0.0) if cuda else 0.0
                f.write(
                    f"{e.key:<24} count {e.count:>6}  CPU total {e.cpu_time_total / 1e3:10.1f} ms"
                    + (f"  device total {device / 1e3:10.1f} ms" if cuda else "")
                    + "\n"
                )
        return [trace, table]

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """A named range in the profile while one runs; a shared no-op context otherwise (it
        wraps every forward, so the idle case allocates nothing)."""
        if self._prof is None:
            return _IDLE
        if name != "braid.vision_tower":
            self.forwards += 1
        return torch.profiler.record_function(name)


_IDLE = contextlib.nullcontext()

# The scheduler process's profiler (the model runner marks its forwards with it).
PROFILER = StepProfiler()
