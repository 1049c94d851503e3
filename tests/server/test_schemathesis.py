"""schemathesis over the server's own OpenAPI schema, every check on: no request it can make
gets a 5xx, and every response (status, content type, body) is what the schema documents.

The server is sized so that no generated request can run long: a 64-token context and two
samples per request at most. A body the schema allows can still be refused with a 400 for a
rule JSON Schema cannot state (the prompt must fit the context, token ids the vocabulary, a
regex must compile, exactly one of text and input_ids), so 400 counts as an answer to valid
data too (`positive_data_acceptance`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.conftest import start_server

CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2XX", "400"]

# A response id or model name schemathesis makes up is not there: 404 is the answer to valid
# data on these routes.
[[operations]]
include-path-regex = "^/v1/(responses|models)/"
checks.positive_data_acceptance.expected-statuses = ["2XX", "400", "404"]
"""


def test_schemathesis_finds_no_failure(tmp_path):
    s = start_server(tmp_path, "--context-length", "64", "--max-samples-per-request", "2")
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cli = Path(sys.executable).with_name("schemathesis")
    try:
        spec = httpx.get(f"{s.url}/openapi.json", timeout=30).json()
        operations = sum(
            method in {"get", "head", "post", "put", "delete", "patch"}
            for path in spec["paths"].values()
            for method in path
        )
        run = subprocess.run(
            [
                str(cli),
                "--config-file",
                str(config),
                "run",
                f"{s.url}/openapi.json",
                "--checks",
                "all",
                # One pass of each phase: coverage (every operation's boundary values), then 5
                # fuzzed cases an operation, then the stateful links. A --max-time budget would
                # only repeat fuzzing until it is spent (about 40 s more) and can cut coverage
                # short on a loaded machine.
                "--max-examples",
                "5",
                "--request-timeout",
                "60",
                # A request can decode at most the 64-token context; a loaded 2-core machine
                # takes a few seconds per request, past schemathesis's 10 s default.
                "--max-response-time",
                "60",
                "--generation-deterministic",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,  # fixed work (no --max-time): slower, not cut short, on a busy machine
            cwd=tmp_path,  # its cache (.schemathesis/) stays out of the checkout
        )
    finally:
        s.stop()
    report = run.stdout[-20000:] + run.stderr[-3000:]
    assert operations >= 14, sorted(spec["paths"])
    assert f"Tested: {operations}" in run.stdout, report  # every route was exercised
    assert run.returncode == 0, report
    assert "Traceback" not in s.log() and "internal error" not in s.log(), s.log()[-5000:]
