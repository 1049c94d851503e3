"""`LLM`'s keywords as engine settings: each `EngineConfig` field under its name and the Python
spelling of its aliases (SGLang's and vLLM's names), and vLLM's `speculative_config` dict as
the speculative settings it holds."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from braid.runtime.config import EngineConfig
from braid.runtime.config_fields import python_name

logger = logging.getLogger(__name__)


def keyword_names() -> dict[str, str]:
    """Every keyword `LLM` accepts for an engine setting, to the field it sets: each field's
    name and the Python spelling of each of its aliases."""
    names: dict[str, str] = {}
    for f in fields(EngineConfig):
        names[f.name] = f.name
        for alias in f.metadata["aliases"]:
            names[python_name(alias)] = f.name
    return names


# vLLM's `speculative_config` keys -> the settings they give.
_SPECULATIVE_CONFIG_KEYS = {
    "method": "speculative_algorithm",
    "model": "speculative_draft_model_path",
    "num_speculative_tokens": "speculative_num_steps",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
}


def speculative_settings(spec: Any) -> dict[str, Any]:
    """vLLM's `speculative_config` dict (`method`, `model`, `num_speculative_tokens`,
    `prompt_lookup_min`, `prompt_lookup_max`) as `EngineConfig` settings; `ValueError` naming
    an unknown key. Without a `method`, a `model` means a draft model."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key {unknown[0]!r} (have "
            f"{sorted(_SPECULATIVE_CONFIG_KEYS)})"
        )
    if spec and spec.get("method") is None and spec.get("model") is None:  # as vLLM's
        raise ValueError("speculative_config needs a method or a model (a draft model's path)")
    out = {_SPECULATIVE_CONFIG_KEYS[k]: v for k, v in spec.items()}
    if "speculative_algorithm" not in out and "speculative_draft_model_path" in out:
        out["speculative_algorithm"] = "DRAFT"
    return out


_UNSET = object()


def _given(given: Mapping[str, Any], field: str) -> Any:
    """The value `given` holds for `field` under any of its keywords, else `_UNSET`."""
    names = keyword_names()
    return next((v for k, v in given.items() if names.get(k) == field), _UNSET)


def _flag(key: str, value: Any) -> bool:
    """A vLLM on/off keyword's value; None (vLLM's default: the engine decides) is on."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{key} must be true, false or None, got {value!r}")
    return value is not False


def _switch(key: str, field: str, off: Any) -> Callable[[Any, Mapping[str, Any]], dict]:
    """A vLLM on/off keyword whose off is braid's `field` at `off`; on is braid's default,
    and an explicit on beside `field` at `off` is a contradiction."""

    def take(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if not _flag(key, value):
            return {field: off}
        if value is True and _given(given, field) == off:
            raise ValueError(f"{key}=True contradicts {field}={off!r}: give one of them")
        return {}

    return take


def _trust_remote_code(value: Any, _given: Mapping[str, Any]) -> dict[str, Any]:
    # braid runs its own model implementations, never a checkpoint's code: permission to run
    # it changes nothing.
    _flag("trust_remote_code", value)
    return {}


def _swap_space(value: Any, _given: Mapping[str, Any]) -> dict[str, Any]:
    # vLLM's CPU memory for swapped-out KV: braid recomputes a retracted request instead of
    # swapping its KV out, so it holds none.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {value!r}")
    return {}


def _same_model(a: Any, b: Any) -> bool:
    """Whether `a` and `b` name one model: the embedded one (None or its name), one local
    path however spelled, or one hub id."""
    from braid.runtime.models.source import EMBEDDED_MODEL_NAME

    a, b = (EMBEDDED_MODEL_NAME if x is None else str(x) for x in (a, b))
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a.lower().rstrip("/") == b.lower().rstrip("/")


def _tokenizer(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    model = _given(given, "model")
    if value is None or _same_model(value, None if model is _UNSET else model):
        return {}
    raise ValueError(
        f"tokenizer {str(value)!r}: the tokenizer is the model directory's own (a separate "
        "one is not supported); leave it out, or name the model"
    )


def _gpu_memory_utilization(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's share of GPU memory the engine may take, weights included: braid's
    mem_fraction_static on CUDA; on the CPU, where it means nothing (vLLM's CPU backend
    ignores it too), one log line says what sizes the KV cache there."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
    if _given(given, "mem_fraction_static") is not _UNSET:
        raise ValueError(
            "gpu_memory_utilization and mem_fraction_static are the same share on CUDA: give one"
        )
    device = given.get("device")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda"):
        logger.info(
            "gpu_memory_utilization %s left aside on the CPU: the KV cache takes "
            "mem_fraction_static of available RAM there (or kv_tokens)",
            value,
        )
        return {}
    if value == 1:
        raise ValueError(
            "gpu_memory_utilization 1 leaves nothing for activations and CUDA graphs: braid "
            "takes a share below 1 (0.95, say)"
        )
    return {"mem_fraction_static": value}


# vLLM's keywords whose values braid has as other settings, or that change nothing in braid:
# keyword -> (its value, every keyword given) -> the settings it gives.
TRANSLATED = {
    "enable_prefix_caching": _switch("enable_prefix_caching", "disable_radix_cache", True),
    "enable_chunked_prefill": _switch("enable_chunked_prefill", "chunked_prefill_size", -1),
    "trust_remote_code": _trust_remote_code,
    "swap_space": _swap_space,
    "tokenizer": _tokenizer,
    "gpu_memory_utilization": _gpu_memory_utilization,
}


# Other engines' settings that braid has under no name, because its nearest setting means
# something else or none is needed: what to do instead (said where the keyword or the flag is
# refused; a close spelling match could point at a setting of another meaning).
OTHER_ENGINES = {
    "max_num_batched_tokens": "vLLM's token budget of a step; braid's nearest are "
    "chunked_prefill_size (a long prompt's chunk) and max_prefill_tokens (the new tokens of "
    "one prefill batch)",
    "data_parallel_size": "one LLM is one engine; data parallelism is `braid serve --dp-size N`",
    # Taken as `LLM` keywords (TRANSLATED); these say what to do instead of the flags.
    "enable_prefix_caching": "braid's prefix cache is always on; --disable-radix-cache turns it "
    "off",
    "enable_chunked_prefill": "braid chunks long prompts by default; --chunked-prefill-size -1 "
    "turns it off",
    "trust_remote_code": "braid runs its own model implementations, never a checkpoint's code: "
    "leave it out",
    "tokenizer": "the tokenizer is the model directory's own (a separate one is not supported)",
    "tokenizer_path": "the tokenizer is the model directory's own (a separate one is not "
    "supported)",
    "gpu_memory_utilization": "braid's --mem-fraction-static is the same share on CUDA "
    "(weights included), but on the CPU the share of available RAM for the KV cache alone",
    "disable_log_stats": "the offline LLM logs no periodic statistics, and braid serve's "
    "throughput line goes with --log-level warning",
    "compilation_config": "braid does not use torch.compile; enforce_eager turns CUDA graphs off",
}


def other_engines_hint(key: str) -> str | None:
    """What to do instead of another engine's setting `key` (a keyword or a flag's name)."""
    return OTHER_ENGINES.get(key.removeprefix("--").replace("-", "_"))


def resolve_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`LLM`'s keywords to `EngineConfig` field names (values untouched). `ValueError` names
    a keyword that is no setting, with the close matches, or a field given under two names.
    vLLM's `speculative_config` dict stands for the speculative settings it holds, and the
    keywords in `TRANSLATED` for the settings their values give."""
    names = keyword_names()
    resolved: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    items = [
        (k, k, v) for k, v in overrides.items() if k != "speculative_config" and k not in TRANSLATED
    ]
    for key in [k for k in overrides if k in TRANSLATED]:
        items += [(f, key, v) for f, v in TRANSLATED[key](overrides[key], overrides).items()]
    if "speculative_config" in overrides:
        spec = speculative_settings(overrides["speculative_config"])
        by_field = {v: k for k, v in _SPECULATIVE_CONFIG_KEYS.items()}
        items += [
            (f, f"speculative_config[{by_field.get(f, 'model')!r}]", v) for f, v in spec.items()
        ]
    for key, shown, value in items:
        name = names.get(key)
        if name is None and other_engines_hint(key):
            raise ValueError(f"unknown engine setting {key!r}: {other_engines_hint(key)}")
        if name is None:
            close = difflib.get_close_matches(key, names, n=3)
            hint = (
                "did you mean " + " or ".join(repr(c) for c in close) + "?"
                if close
                else "the settings are " + ", ".join(f.name for f in fields(EngineConfig))
            )
            raise ValueError(f"unknown engine setting {key!r}: {hint}")
        if name in given_as:
            raise ValueError(f"{name} is given twice: as {given_as[name]} and {shown}")
        given_as[name] = shown
        resolved[name] = value
    return resolved
