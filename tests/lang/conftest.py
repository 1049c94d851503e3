"""Language tests run their programs on the session's SmolLM2 engine (greedy), and those that
need a real server share one `braid serve`."""

from __future__ import annotations

import pytest

from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def backend(smollm2):
    from braid.lang.backends.engine import EngineBackend

    return EngineBackend(smollm2)


@pytest.fixture(scope="package")
def served(tmp_path_factory):
    """One `braid serve` (SmolLM2, 8192 KV tokens) for the modules of tests/lang: starting one
    costs 10-15 s of the 2 CI cores. A test that uses it leaves it idle (nothing running or
    queued) and changes no setting, so what a module asserts does not depend on which modules
    ran before it. It serves the float model (`--dequantize-gguf`), as the session's engine
    does, so that a program gives the same tokens on every backend."""
    s = start_server(tmp_path_factory.mktemp("lang-serve"), "--dequantize-gguf")
    yield s
    s.stop()
