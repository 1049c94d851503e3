"""A real `braid serve` subprocess on a free port, per test module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(tmp_path, *extra: str, timeout: float = 120.0) -> Server:
    port = free_port()
    log_path = str(tmp_path / f"serve-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "braid",
            "serve",
            "--port",
            str(port),
            "--max-total-tokens",
            "8192",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    server = Server(proc, port, log_path)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"braid serve exited early:\n{server.log()}")
        if "ready at http://" in server.log():
            return server
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"braid serve did not become ready:\n{server.log()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


def wait_idle(url: str, timeout: float = 20.0, headers=None) -> dict:
    """Wait until nothing runs; returns the scheduler stats."""
    deadline = time.time() + timeout
    while True:
        stats = httpx.get(f"{url}/get_server_info", headers=headers).json()["stats"]
        if stats["running_requests"] == 0 and stats["queued_requests"] == 0:
            return stats
        if time.time() > deadline:
            raise AssertionError(f"requests still running: {stats}")
        time.sleep(0.2)
