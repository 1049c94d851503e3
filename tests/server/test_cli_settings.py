"""`braid serve`'s settings checked before the model loads: what an operator mistypes ends the
start with one line naming it (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from braid.runtime.tokenizer.tokenizer import read_chat_template


def test_a_chat_template_is_a_file_or_jinja_text_that_parses(tmp_path):
    path = tmp_path / "tpl.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    # A mistyped path used to become the template's text: every prompt was "tpl.jinj".
    with pytest.raises(ValueError, match=r"--chat-template: '.*tpl\.jinj' is not a file"):
        read_chat_template(str(tmp_path / "tpl.jinj"))
    with pytest.raises(ValueError, match="chatml"):
        read_chat_template("chatml")
    with pytest.raises(ValueError, match="does not parse: .*line 1"):
        read_chat_template("{% for m in messages %}{{ m.content }")
    # transformers' own tags parse (its environment adds {% generation %}).
    marked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert read_chat_template(marked) == marked
    with pytest.raises(ValueError, match="unknown tag 'nope'"):
        read_chat_template("{% nope %}")


def test_serve_ends_at_a_bad_chat_template_before_loading_the_model(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "braid", "serve", "--chat-template", str(tmp_path / "x.jinj")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "x.jinj' is not a file" in run.stderr
    assert "KV cache" not in run.stderr and "Traceback" not in run.stderr


def test_braid_log_level_sets_serves_level_unless_the_flag_is_given(tmp_path):
    """$BRAID_LOG_LEVEL was overridden by --log-level's default (info)."""
    import os

    def run(*flags: str) -> str:
        env = {**os.environ, "BRAID_LOG_LEVEL": "critical"}
        argv = [sys.executable, "-m", "braid", "serve", "--chat-template", "nope", *flags]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2
        return done.stderr

    assert "is not a file" not in run()  # an error line, below critical
    assert "is not a file" in run("--log-level", "error")


BAD_VALUES = [
    (["--header-timeout", "-1"], "--header-timeout must be a positive number of seconds"),
    (["--keep-alive-timeout", "0"], "--keep-alive-timeout must be a positive number"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be a positive number"),
    (["--health-timeout", "inf"], "--health-timeout must be a positive number"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be positive, got 0"),
    (["--api-key", ""], "--api-key is empty (an unset variable?)"),
    (["--max-total-tokens", "0"], "--kv-tokens (--max-total-tokens) must be a positive"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout must be a positive number, got 0"),
]


def test_bad_values_end_the_start_naming_the_flag_before_the_model_loads():
    """Each was taken before (a server whose /health failed for ever, every POST a 413, auth
    off for an unset variable) or refused after the model loaded, naming a field."""
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "braid", "serve", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flags, _ in BAD_VALUES
    ]
    for run, (flags, message) in zip(runs, BAD_VALUES):
        _, err = run.communicate(timeout=120)
        assert run.returncode == 2, (flags, err)
        assert message in err, (flags, err)
        assert "KV cache" not in err and "Traceback" not in err, (flags, err)


def test_ctrl_c_during_start_up_is_one_line_and_exit_130():
    """It was a 30-line KeyboardInterrupt traceback, often from inside transformers' import."""
    import signal
    import time

    import psutil

    run = subprocess.Popen(
        [sys.executable, "-m", "braid", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A pytest-xdist worker ignores SIGINT, and a child would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not (children := psutil.Process(run.pid).children(recursive=True)):
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.05)  # until the runtime's processes start (the model loads after)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "interrupted during start-up" in err, err
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive  # none left behind
