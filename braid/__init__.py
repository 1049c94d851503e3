"""braid: a structured-generation language for LLMs and the serving runtime built for it.

The public names are imported on first use, so that a runtime child process importing one
submodule (the detokenizer needs no torch) does not pay for the whole package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from braid._logging import configure_logging

configure_logging()

_EXPORTS = {
    "LLM": "braid.runtime.engine",
    "Engine": "braid.runtime.engine",
    "SamplingParams": "braid.runtime.sampling_params",
    "PoolingParams": "braid.runtime.pooling",
    "BeamSearchParams": "braid.runtime.beam_search",
    "RequestOutput": "braid.runtime.outputs",
    "CompletionOutput": "braid.runtime.outputs",
    "Logprob": "braid.runtime.outputs",
}
# The language (SGLang's frontend names): resolved through braid.lang.
_LANG = (
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "image",
    "video",
    "separate_reasoning",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "get_server_info",
    "set_default_backend",
    "get_default_backend",
    "global_config",
    "using_backend",
    "sampling_defaults",
    "ProgramState",
    "ProgramError",
    "RequestGraph",
    "TraceError",
    "Runtime",
    "RuntimeEndpoint",
    "OpenAI",
    "Anthropic",
    "LiteLLM",
    "VertexAI",
    "ChoicesSamplingMethod",
    "ChoicesDecision",
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
)
_EXPORTS.update({name: "braid.lang" for name in _LANG})
__all__ = [  # noqa: F822 - resolved lazily by __getattr__
    "LLM",
    "Engine",
    "SamplingParams",
    "PoolingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    *_LANG,
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from braid.runtime.beam_search import BeamSearchParams
    from braid.runtime.engine import LLM, Engine
    from braid.runtime.outputs import CompletionOutput, Logprob, RequestOutput
    from braid.runtime.pooling import PoolingParams
    from braid.runtime.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'braid' has no attribute {name!r}")


def __dir__() -> list[str]:
    # PEP 562: list the lazily exported names too (tab completion, tools that copy names).
    return sorted(set(globals()) | set(_EXPORTS))
