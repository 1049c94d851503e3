"""Language tests run their programs on the session's SmolLM2 engine (greedy)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def backend(smollm2):
    from braid.lang.backends.engine import EngineBackend

    return EngineBackend(smollm2)
