"""Embeddings: how a prompt's final hidden states become one vector.

The front end resolves a request into an `EmbedSpec` (`PoolingConfig.spec`): the pooling
method and normalization come from the model's sentence-transformers files when it has them
(`modules.json`, `1_Pooling/config.json`), else from the `pooling` setting (default "last",
normalized, as vLLM's embed task does); a request may ask for `normalize` and, from a
Matryoshka model, fewer `dimensions`. The scheduler pools the hidden states of an embedding
request's prefill (`Pooled`, one per request, fed chunk by chunk) and finishes the vector
(`finish_vector`: truncate, then normalize; `to_wire`: float32 bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from braid.runtime.errors import ParamError
from braid.runtime.ipc.to_scheduler import EmbedSpec

POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json flags -> braid's method names.
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_POOLING = "sentence_transformers.models.Pooling"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None


def sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool | None, str | None]:
    """(method, normalize, why not) from a sentence-transformers model directory: the method
    its Pooling module uses, whether a Normalize module follows; (None, None, None) when there
    is no `modules.json`. A Pooling mode braid does not implement gives (None, normalize, the
    reason)."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None, None, None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path}: must be a list of modules")
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    normalize = _ST_NORMALIZE in types
    pooling = next(
        (m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None
    )
    if pooling is None:
        return None, normalize, None
    cfg_path = model_dir / str(pooling.get("path", "1_Pooling")) / "config.json"
    if not cfg_path.is_file():
        return None, normalize, None
    cfg = _read_json(cfg_path)
    chosen = [m for flag, m in _ST_MODES.items() if cfg.get(flag)]
    others = [
        k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES
    ]
    if others or len(chosen) != 1:
        modes = others + [k for k in _ST_MODES if cfg.get(k)]
        return (
            None,
            normalize,
            f"the model's pooling ({', '.join(modes) or 'none'}) is not supported",
        )
    return chosen[0], normalize, None


@dataclass
class PoolingParams:
    """vLLM's `PoolingParams` for `LLM.embed(pooling_params=...)`: `truncate_prompt_tokens`
    (keep the prompt's last k tokens; -1: as many as the context takes), `dimensions`
    (Matryoshka), `normalize`, and `use_activation`, vLLM's newer name for `normalize` on an
    embedding (None: the model's default)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    @classmethod
    def merge(cls, params: Any, **given: Any) -> dict[str, Any]:
        """`params` (a `PoolingParams` or None) merged with the call's keywords (`merged`)."""
        if params is None:
            params = cls()
        if not isinstance(params, cls):
            raise ParamError.at(
                "pooling_params",
                f"must be one PoolingParams for every prompt, got {type(params).__name__}",
            )
        return params.merged(**given)

    def merged(self, **given: Any) -> dict[str, Any]:
        """These fields with the call's keywords of the same names (None: not given); a
        `ParamError` for a field given two different ways."""
        own = {
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "dimensions": self.dimensions,
            "normalize": self.normalize,
        }
        if self.use_activation is not None:
            if self.normalize is not None and self.normalize != self.use_activation:
                raise ParamError.at(
                    "normalize", "pooling_params: normalize and use_activation disagree"
                )
            own["normalize"] = self.use_activation
        out = {}
        for name, value in own.items():
            other = given.get(name)
            if value is not None and other is not None and other != value:
                raise ParamError.at(
                    name, f"given as {other!r} and as pooling_params.{name}={value!r}"
                )
            out[name] = value if other is None else other
        return out


def prompt_keep(k: Any, context_length: int) -> int | None:
    """How many of a prompt's last tokens an embedding keeps for `truncate_prompt_tokens` `k`
    (None: all; -1: the context length); a `ParamError` for another value, or one past the
    context length (as vLLM's)."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
        raise ParamError.at(
            "truncate_prompt_tokens",
            f"must be an integer >= 1, -1 (the most the context takes) or null, got {k!r}",
        )
    if k > context_length:
        raise ParamError.at(
            "truncate_prompt_tokens", f"{k} is greater than the context length ({context_length})"
        )
    return context_length if k == -1 else k


@dataclass(frozen=True)
class PoolingConfig:
    """A model's embedding defaults and limits, resolved once by the front end.

    `unsupported`: why this model's embeddings cannot be served (a sentence-transformers
    pooling braid lacks), or None. `matryoshka`: None when the model is not trained for
    truncation, () when any size is fine, else the sizes it was trained for."""

    method: str
    normalize: bool
    hidden_size: int
    matryoshka: tuple[int, ...] | None = None
    unsupported: str | None = None

    @classmethod
    def from_model(
        cls, model_dir: Path, hidden_size: int, raw_config: dict[str, Any], override: str | None
    ) -> PoolingConfig:
        """`override` (the `pooling` setting) wins over the sentence-transformers config."""
        try:
            st_method, st_normalize, why = sentence_transformers_pooling(model_dir)
        except ValueError as e:  # generation still works; embeddings say why they cannot
            st_method, st_normalize, why = None, None, str(e)
        method = override or st_method or "last"
        if override is not None:
            why = None
        dims = raw_config.get("matryoshka_dimensions")
        matryoshka = None
        if isinstance(dims, list) and all(isinstance(d, int) for d in dims) and dims:
            matryoshka = tuple(sorted(dims))
        elif raw_config.get("is_matryoshka") is True:
            matryoshka = ()
        normalize = True if st_normalize is None else st_normalize
        return cls(method, normalize, hidden_size, matryoshka, why)

    def spec(self, normalize: bool | None = None, dimensions: int | None = None) -> EmbedSpec:
        """The `EmbedSpec` of one request; a `ParamError` naming the field it refuses."""
        if self.unsupported is not None:
            raise ParamError.at("input", f"this model cannot embed: {self.unsupported}")
        if dimensions is not None:
            if isinstance(dimensions, bool) or not isinstance(dimensions, int):
                raise ParamError.at("dimensions", f"must be an integer, got {dimensions!r}")
            if self.matryoshka is None:
                raise ParamError.at(
                    "dimensions",
                    "this model does not support Matryoshka truncation (its "
                    "config.json has no matryoshka_dimensions or is_matryoshka)",
                )
            if not 1 <= dimensions <= self.hidden_size:
                raise ParamError.at(
                    "dimensions", f"must be in [1, {self.hidden_size}], got {dimensions}"
                )
            if self.matryoshka and dimensions not in self.matryoshka:
                raise ParamError.at(
                    "dimensions",
                    f"{dimensions} is not one of the model's matryoshka_dimensions "
                    f"{list(self.matryoshka)}",
                )
            if dimensions == self.hidden_size:
                dimensions = None
        if normalize is not None and not isinstance(normalize, bool):
            raise ParamError.at("normalize", f"must be a boolean, got {normalize!r}")
        return EmbedSpec(
            self.method, self.normalize if normalize is None else normalize, dimensions
        )


class Pooled:
    """One embedding request's pooling in progress: fed the final hidden states of each
    chunk of its prompt in order (`add`), it keeps what its method needs (a running float32
    sum for "mean", the first row for "cls", the latest last row for "last")."""

    def __init__(self, method: str) -> None:
        if method not in POOLING_METHODS:
            raise ValueError(f"pooling: must be one of {list(POOLING_METHODS)}, got {method!r}")
        self.method = method
        self.value: torch.Tensor | None = None
        self.rows = 0

    def add(self, start: int, hidden: torch.Tensor) -> None:
        """The hidden states [n, hidden] of prompt positions [start, start + n)."""
        if self.method == "mean":
            # Every position counts once: mean pooling never starts from a cache hit.
            assert start == self.rows, "mean pooling needs every prompt position, in order"
            part = hidden.float().sum(dim=0)
            self.value = part if self.value is None else self.value + part
        elif self.method == "cls":
            if start == 0:  # a copy: a view would keep the whole batch's hidden states
                self.value = hidden[0].to(torch.float32, copy=True)
        else:
            self.value = hidden[-1].to(torch.float32, copy=True)
        self.rows = start + hidden.shape[0]

    def result(self) -> torch.Tensor:
        assert self.value is not None, "nothing pooled"
        return self.value / self.rows if self.method == "mean" else self.value


def finish_vector(vec: torch.Tensor, spec: EmbedSpec) -> torch.Tensor:
    """A pooled vector as the request asked for it: truncated to `spec.dimensions`, then
    scaled to unit norm if `spec.normalize` (so a truncated Matryoshka vector is unit length
    too); float32, on the vector's device."""
    if spec.dimensions is not None:
        vec = vec[: spec.dimensions]
    if spec.normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
    return vec.float()


def to_wire(vectors: list[torch.Tensor]) -> list[bytes]:
    """Each vector as little-endian float32 bytes, all copied to the host at once (one
    device synchronisation per step, not one per request)."""
    if not vectors:
        return []
    flat = torch.cat(vectors).to("cpu").numpy().astype("<f4")
    out, at = [], 0
    for v in vectors:
        out.append(flat[at : at + v.numel()].tobytes())
        at += v.numel()
    return out


def floats(data: bytes) -> list[float]:
    """A vector's wire bytes as Python floats."""
    import numpy as np

    return np.frombuffer(data, dtype="<f4").tolist()
