"""Start `braid serve` as a subprocess and wait until it is ready (for tests, benchmarks and
scripts that need a real server)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from braid.runtime.ipc.sockets import free_port


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> str:
        """The log once a line matches regex `pattern` (lines about a request are written as
        it ends, after its client may have had the answer); `TimeoutError` with the log's
        tail if none does within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            if any(re.search(pattern, line) for line in text.splitlines()):
                return text
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no log line matches {pattern!r}; the log ends:\n{text[-2000:]}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(
    log_dir: str | Path, *args: str, kv_tokens: int = 8192, timeout: float = 180.0
) -> ServerProcess:
    """`python -m braid serve --port <free> --max-total-tokens <kv_tokens> *args`, ready."""
    port = free_port()
    log_path = str(Path(log_dir) / f"serve-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "braid",
                "serve",
                "--port",
                str(port),
                "--max-total-tokens",
                str(kv_tokens),
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = ServerProcess(proc, port, log_path)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"braid serve exited early:\n{server.log()}")
        if "ready at http://" in server.log():
            return server
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"braid serve did not become ready:\n{server.log()}")
