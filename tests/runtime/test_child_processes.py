"""The runtime's children (`ipc.children.runtime_process`): started from a fork server that has
the runtime's modules imported, with the caller's environment and working directory as they are
at the start, and killed when the caller dies even while busy (the fork server, their parent,
outlives the caller while they run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from braid.runtime.ipc.children import CHILD_PRELOAD, runtime_process, start_children

ROOT = Path(__file__).resolve().parents[2]


def _report(path: str) -> None:
    """A child's entry: write what it sees on arrival (before importing anything itself)."""
    Path(path).write_text(
        json.dumps(
            {
                "env": os.environ.get("BRAID_TEST_CHILD"),
                "cwd": os.getcwd(),
                "preloaded": [m for m in CHILD_PRELOAD if m in sys.modules],
                "torch": "torch" in sys.modules,
                "ppid": os.getppid(),
                "braid": sys.modules["braid"].__file__,
            }
        )
    )
    print("a line from the child", file=sys.stderr, flush=True)


def _run(out: Path) -> dict:
    p = runtime_process(_report, (str(out),), "braid-test-child")
    start_children([p])
    p.join(60)
    assert p.exitcode == 0
    return json.loads(out.read_text())


def test_a_child_has_the_callers_environment_and_directory_and_the_preloaded_modules(
    tmp_path, monkeypatch
):
    # Start the fork server first (an earlier test may have), then change what the child must
    # see: a fork server's child would otherwise have the server's environment.
    _run(tmp_path / "warm.json")
    monkeypatch.setenv("BRAID_TEST_CHILD", "set after the server started")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    seen = _run(tmp_path / "child.json")
    assert seen["env"] == "set after the server started"
    assert seen["cwd"] == str(work)
    assert seen["preloaded"] == list(CHILD_PRELOAD) and seen["torch"]
    assert seen["ppid"] != os.getpid()  # the fork server's child, not this process's

    monkeypatch.setenv("BRAID_START_METHOD", "spawn")
    spawned = _run(tmp_path / "spawned.json")
    assert spawned["env"] == "set after the server started"
    assert spawned["preloaded"] == [] and not spawned["torch"]
    assert spawned["ppid"] == os.getpid()


def test_a_child_whose_caller_changed_a_variable_read_at_import_is_spawned(tmp_path, monkeypatch):
    _run(tmp_path / "warm.json")
    monkeypatch.setenv("OMP_NUM_THREADS", str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1))
    seen = _run(tmp_path / "child.json")
    assert seen["ppid"] == os.getpid() and not seen["torch"]  # spawned: torch's threads obey


def test_a_childs_output_goes_where_the_callers_went_at_its_start(tmp_path):
    _run(tmp_path / "warm.json")  # the fork server runs, its stderr whatever it was then
    log = tmp_path / "stderr.log"
    saved = os.dup(2)
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 2)
        _run(tmp_path / "child.json")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert "a line from the child" in log.read_text()


def _caller_run(tmp_path: Path, prelude: str = "", **env: str) -> tuple[dict, str]:
    """Start a child from a fresh caller process (its braid from its sys.path, after `prelude`)
    in `tmp_path`, with `env` added; what the child saw and the caller's stderr."""
    out = tmp_path / "child.json"
    caller = textwrap.dedent(
        f"""
        import sys
        {prelude}
        sys.path.insert(0, {str(ROOT)!r})
        from braid.runtime.ipc.children import runtime_process, start_children
        from tests.runtime.test_child_processes import _report

        p = runtime_process(_report, ({str(out)!r},), "braid-test-child")
        start_children([p])
        p.join(60)
        sys.exit(p.exitcode)
        """
    )
    full = {k: v for k, v in os.environ.items() if k != "BRAID_START_METHOD"} | env
    done = subprocess.run(
        [sys.executable, "-c", caller], cwd=tmp_path, env=full, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stderr


def test_the_fork_server_imports_the_callers_braid_not_one_in_its_directory(tmp_path):
    # A caller started in a directory that holds another `braid` package: the fork server
    # (Python 3.11's ignores the caller's sys.path) must not import that one.
    (tmp_path / "braid").mkdir()
    (tmp_path / "braid" / "__init__.py").write_text("raise ImportError('the wrong braid')\n")
    seen, stderr = _caller_run(tmp_path)
    assert seen["braid"] == str(ROOT / "braid" / "__init__.py")
    assert seen["preloaded"] == list(CHILD_PRELOAD)
    assert "could not import" not in stderr


def test_a_child_the_server_could_not_preload_for_runs_and_says_so(tmp_path):
    # The server's path has a `zmq` that fails to import; the caller removed it from its own.
    fake = tmp_path / "fake"
    (fake / "zmq").mkdir(parents=True)
    (fake / "zmq" / "__init__.py").write_text("raise ImportError('not this zmq')\n")
    path = os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))
    seen, stderr = _caller_run(tmp_path, f"sys.path.remove({str(fake)!r})", PYTHONPATH=path)
    assert seen["preloaded"] == []
    assert "the fork server could not import braid.runtime.scheduler.process" in stderr


def test_an_unknown_start_method_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("BRAID_START_METHOD", "fork")
    with pytest.raises(ValueError, match="BRAID_START_METHOD must be forkserver or spawn"):
        runtime_process(_report, ("unused",), "braid-test-child")


# A caller that starts a busy child (it never polls for its parent) from a thread that ends
# while the child runs, as `TokenizerManager.spawn_early`'s does, and prints its pid.
CALLER = textwrap.dedent(
    """
    import os, sys, threading, time
    sys.path.insert(0, {root!r})
    from braid.runtime.ipc.children import runtime_process, start_children
    from tests.runtime.test_child_processes import _busy

    p = runtime_process(_busy, (os.getpid(),), "braid-test-busy")

    def start():
        start_children([p])
        time.sleep(1.0)  # the child is running its target when this thread ends

    t = threading.Thread(target=start)
    t.start()
    t.join()
    print(p.pid, flush=True)
    time.sleep(600)
    """
)


def _busy(parent_pid: int) -> None:
    from braid.runtime.ipc.children import die_with_parent

    die_with_parent(parent_pid)
    while True:
        sum(range(10_000))


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_busy_child_lives_with_its_caller_and_dies_when_it_is_killed(method):
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER.format(root=str(ROOT))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "BRAID_START_METHOD": method},
    )
    child = psutil.Process(int(caller.stdout.readline()))
    server = child.parent()
    try:
        # The fork server's child, or the caller's own (whose starting thread has ended).
        assert (server.pid != caller.pid) == (method == "forkserver")
        time.sleep(1.0)
        assert child.status() != psutil.STATUS_ZOMBIE, "the child died with its caller alive"
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 10
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child outlived its caller by 10 s"
            time.sleep(0.1)
    finally:
        for p in {caller.pid, child.pid, server.pid} - {os.getpid()}:
            try:
                psutil.Process(p).kill()
            except psutil.NoSuchProcess:
                pass
