"""The braid language: `@function` programs with `gen`, `select`, roles and `fork`, traced to a
`RequestGraph` and run on a backend (braid's `Engine`, a `RuntimeEndpoint`, or `OpenAI`).

    import braid as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        with s.assistant():
            s += sgl.gen("answer", max_tokens=64)

    sgl.set_default_backend(sgl.Engine())
    print(qa.run(question="What is the capital of France?")["answer"])
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "function": "braid.lang.api",
    "gen": "braid.lang.api",
    "gen_int": "braid.lang.api",
    "gen_string": "braid.lang.api",
    "select": "braid.lang.api",
    "image": "braid.lang.api",
    "video": "braid.lang.api",
    "separate_reasoning": "braid.lang.api",
    "system": "braid.lang.api",
    "user": "braid.lang.api",
    "assistant": "braid.lang.api",
    "system_begin": "braid.lang.api",
    "system_end": "braid.lang.api",
    "user_begin": "braid.lang.api",
    "user_end": "braid.lang.api",
    "assistant_begin": "braid.lang.api",
    "assistant_end": "braid.lang.api",
    "flush_cache": "braid.lang.api",
    "get_server_info": "braid.lang.api",
    "Anthropic": "braid.lang.api",
    "LiteLLM": "braid.lang.api",
    "VertexAI": "braid.lang.api",
    "Program": "braid.lang.program",
    "set_default_backend": "braid.lang.program",
    "get_default_backend": "braid.lang.program",
    "global_config": "braid.lang.config",
    "using_backend": "braid.lang.config",
    "sampling_defaults": "braid.lang.config",
    "ProgramState": "braid.lang.interpreter",
    "ProgramError": "braid.lang.interpreter",
    "ForkGroup": "braid.lang.interpreter",
    "RequestGraph": "braid.lang.tracer",
    "TraceError": "braid.lang.tracer",
    "RuntimeEndpoint": "braid.lang.backends.endpoint",
    "Runtime": "braid.lang.backends.endpoint",
    "OpenAI": "braid.lang.backends.openai",
    "ChoicesSamplingMethod": "braid.lang.choices",
    "ChoicesDecision": "braid.lang.choices",
    "token_length_normalized": "braid.lang.choices",
    "greedy_token_selection": "braid.lang.choices",
    "unconditional_likelihood_normalized": "braid.lang.choices",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'braid.lang' has no attribute {name!r}")


def __dir__() -> list[str]:
    # PEP 562: list the lazily exported names too (tab completion, `from braid.lang import *`).
    return sorted(set(globals()) | set(_EXPORTS))
