"""braid: a structured-generation language for LLMs and the serving runtime built for it."""

from __future__ import annotations

from braid._logging import configure_logging
from braid.runtime.engine import LLM, Engine
from braid.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from braid.runtime.sampling_params import SamplingParams

configure_logging()

__all__ = [
    "LLM",
    "Engine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"
