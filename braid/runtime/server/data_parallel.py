"""`braid serve --dp-size N`: N `braid serve` workers behind SGLang's router
(`sglang-router`, the SGLang Model Gateway), started and stopped together.

The workers are ordinary `braid serve` processes on 127.0.0.1, one per GPU where there are
GPUs (`CUDA_VISIBLE_DEVICES`), splitting the CPU threads where there are not. Once every
worker answers `/health`, the router starts on the requested host and port with its
cache-aware policy by default (a request goes to the worker whose cache holds the longest
prefix of it, unless the load is out of balance) and its own health checks (a dead worker is
taken out of rotation; a failed request is retried on another). This process then only
watches: SIGTERM or SIGINT stops the router and the workers (SIGKILL after a grace period), and
every child dies with it (PR_SET_PDEATHSIG), so nothing is left behind. The router's URL is the
one the "ready" line prints.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from braid.runtime.server.launcher import free_port

logger = logging.getLogger(__name__)

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
# Flags the supervisor handles itself (each with its value), not passed on to the workers.
# (Their abbreviations, which argparse takes too, are not removed: the flags the supervisor
# appends to a worker's command line come last and override them.)
_OWN_FLAGS = {"--dp-size", "--port", "--host", "--router-policy"}
# The router: SGLang's `launch_router`, given the API key from the environment, where a
# command line (which any user of the machine can read) never shows it.
_ROUTER_MAIN = (
    "import os, sys; from sglang_router.launch_router import main; "
    "key = os.environ.pop('BRAID_ROUTER_API_KEY', ''); "
    "sys.argv += ['--api-key', key] if key else []; main()"
)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_argv(argv: Sequence[str]) -> list[str]:
    """`braid serve`'s command line without the flags the supervisor handles."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path


class DataParallelServer:
    """The workers and the router of one `braid serve --dp-size N`."""

    def __init__(
        self,
        argv: Sequence[str],
        dp_size: int,
        host: str,
        port: int,
        policy: str,
        log_dir: Path,
        tp_size: int = 1,
        api_key: str | None = None,
    ) -> None:
        if dp_size < 2:
            raise ValueError(f"dp_size must be at least 2 for a router, got {dp_size}")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {list(ROUTER_POLICIES)}")
        self.argv = worker_argv(argv)
        self.dp_size = dp_size
        self.host, self.port, self.policy = host, port, policy
        self.log_dir = log_dir
        self.tp_size = tp_size  # devices (and processes) per worker
        # The workers take the key from their own flags; the router and the supervisor's calls
        # to it send it.
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.workers: list[_Child] = []
        self.router: _Child | None = None
        self._stop = threading.Event()

    # ---- start ------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str], url: str) -> _Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        return _Child(name, proc, url, log_path)

    def start(self) -> None:
        """Start the workers, wait until all are healthy, then start the router and wait for
        it; `RuntimeError` (with the failing child's log) if any does not come up."""
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        threads = max(1, (os.cpu_count() or 1) // self.dp_size)
        tp = self.tp_size
        for i in range(self.dp_size):
            port = free_port()
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if gpus:  # worker i: GPUs i*tp .. i*tp + tp - 1 (wrapping round)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str((i * tp + j) % gpus) for j in range(tp))
            else:
                env["OMP_NUM_THREADS"] = str(threads)
            argv = [sys.executable, "-m", "braid", *self.argv]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--dp-size", "1"]
            url = f"http://127.0.0.1:{port}"
            self.workers.append(self._spawn(f"worker-{i}", argv, env, url))
            logger.info("braid serve: data-parallel worker %d starting at %s", i, url)
        for w in self.workers:
            self._wait_ready(w, "/health")
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "--dp-size needs SGLang's router: pip install 'braid[router]' "
                "(the sglang-router package)"
            ) from None
        if self.port == 0:  # --port 0: a free port, named in the ready line
            self.port = free_port()
        argv = [sys.executable, "-c", _ROUTER_MAIN]
        argv += ["--host", self.host, "--port", str(self.port), "--policy", self.policy]
        argv += ["--worker-urls", *(w.url for w in self.workers)]
        argv += ["--health-check-interval-secs", "2", "--log-level", "warn"]
        # The router's own Prometheus exporter: on a free port (its default, 29000, would
        # make a second server on the machine fail at start), on the router's host.
        metrics_port = free_port()
        argv += ["--prometheus-host", self.host, "--prometheus-port", str(metrics_port)]
        url = f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"
        env = dict(os.environ, BRAID_ROUTER_API_KEY=self.api_key or "")
        self.router = self._spawn("router", argv, env, url)
        self._wait_ready(self.router, "/health")
        logger.info(
            "braid serve: the router's metrics at http://%s:%d/metrics", self.host, metrics_port
        )
        logger.warning(
            "braid serve: the router forwards chat and /generate bodies without the fields it "
            "does not know (chat: guided_choice, structured_outputs, json_schema, bad_words, "
            "...; /generate: seed, stop_regex, choice, lark, logit_bias, ...), and refuses "
            "token-id prompts on /v1/completions, which otherwise keeps every field; the whole "
            "list is in docs/parallelism.md"
        )

    def _wait_ready(self, child: _Child, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited at start:\n{_tail(child.log_path)}")
            try:
                if httpx.get(child.url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{child.name} did not become ready:\n{_tail(child.log_path)}")

    # ---- run and stop -----------------------------------------------------------------------
    def wait(self) -> int:
        """Watch the children until SIGTERM / SIGINT (then 0) or the router or every worker
        dies (then 1); stops them all either way."""
        dead: set[str] = set()
        code = 0
        while not self._stop.wait(0.5):
            if self.router is not None and self.router.proc.poll() is not None:
                logger.error("braid serve: the router exited:\n%s", _tail(self.router.log_path))
                code = 1
                break
            for w in self.workers:
                if w.proc.poll() is not None and w.name not in dead:
                    dead.add(w.name)
                    logger.warning(
                        "braid serve: %s exited (%s); the router takes it out of rotation",
                        w.name,
                        w.proc.returncode,
                    )
                    self._remove_from_router(w)
            if len(dead) == len(self.workers):
                logger.error("braid serve: every data-parallel worker exited")
                code = 1
                break
        self.stop()
        return code

    def _remove_from_router(self, worker: _Child) -> None:
        """Take a dead worker out of the router at once (its health checks would take a few
        seconds, and requests routed there meanwhile would fail)."""
        try:
            listed = httpx.get(self.router.url + "/workers", headers=self.headers, timeout=5.0)
            for w in listed.json()["workers"]:
                if w.get("url") == worker.url:
                    r = httpx.delete(
                        f"{self.router.url}/workers/{w['id']}", headers=self.headers, timeout=5.0
                    )
                    r.raise_for_status()
            # (Not listed: the router's health checks took it out first.)
            logger.info("braid serve: %s is out of the router's rotation", worker.name)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            logger.warning("braid serve: could not take %s out of the router: %s", worker.name, e)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def stop(self) -> None:
        """SIGTERM to the router and every worker, SIGKILL to any left after the grace."""
        children = [c for c in [self.router, *self.workers] if c is not None]
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return ""


def serve_data_parallel(argv: Sequence[str], settings, config, api_key: str | None) -> int:
    """Run `braid serve --dp-size N` for the server `settings` and engine `config` (see the
    module docstring; with `config.tp_size` > 1 each worker is a tensor-parallel group of that
    many devices); the process's exit code."""
    import tempfile

    if config.nnodes > 1:
        logger.error("braid serve: --dp-size with --nnodes > 1 is not supported")
        return 2
    dp_size, policy = settings.dp_size, settings.router_policy
    log_dir = Path(tempfile.mkdtemp(prefix="braid-dp-"))
    server = DataParallelServer(
        argv, dp_size, settings.host, settings.port, policy, log_dir, config.tp_size, api_key
    )
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    try:
        server.start()
    except (RuntimeError, ValueError) as e:
        logger.error("braid serve: %s", e)
        server.stop()
        return 1
    if server._stop.is_set():
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
        return 0
    logger.info(
        "braid serve: ready at %s (router, policy %s, %d workers: %s; logs in %s)",
        server.router.url,
        policy,
        dp_size,
        " ".join(w.url for w in server.workers),
        log_dir,
    )
    code = server.wait()
    if code == 0:  # the children's logs are kept where something went wrong
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        logger.info("braid serve: the workers' and router's logs are in %s", log_dir)
    return code
