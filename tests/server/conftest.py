"""A real `braid serve` subprocess on a free port, per test module."""

from __future__ import annotations

import time

import httpx
import pytest

from braid.runtime.server.launcher import ServerProcess
from braid.runtime.server.launcher import start_server as launch


def start_server(tmp_path, *extra: str, timeout: float = 180.0) -> ServerProcess:
    return launch(tmp_path, *extra, kv_tokens=8192, timeout=timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded model's server; its torch profiles (`/start_profile`) go to
    `server.profile_dir`."""
    log_dir = tmp_path_factory.mktemp("serve")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_TORCH_PROFILER_DIR", str(log_dir / "profiles"))
        s = start_server(log_dir, "--log-requests")
    s.profile_dir = log_dir / "profiles"
    yield s
    s.stop()


def wait_idle(url: str, timeout: float = 20.0, headers=None) -> dict:
    """Wait until nothing runs; returns the scheduler stats (fresh ones: a busy scheduler's
    last heartbeat, marked stale, may predate what the test did)."""
    deadline = time.time() + timeout
    while True:
        stats = httpx.get(f"{url}/get_server_info", headers=headers).json()["stats"]
        idle = stats["running_requests"] == 0 and stats["queued_requests"] == 0
        if idle and not stats.get("stale"):
            return stats
        if time.time() > deadline:
            raise AssertionError(f"requests still running: {stats}")
        time.sleep(0.2)


def sse_data(url: str, body: dict, timeout: float = 120.0) -> list[str]:
    """The `data:` payloads of a streamed POST, in order, without the closing `[DONE]`."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return data[:-1]
