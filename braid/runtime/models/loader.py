"""Strict weight loading from safetensors: every checkpoint key must be consumed and every
parameter (every shard of a fused one) filled exactly once; anything else is an error."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from braid.runtime.models import get_model_class
from braid.runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def _target(model: nn.Module, key: str) -> tuple[str, str | None]:
    """Map a checkpoint key to (braid parameter name, shard)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in model.stacked_params:
            fused, shard = model.stacked_params[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return key, None


def load_weights(model: nn.Module, model_dir: Path, *, progress: bool = True) -> None:
    params = dict(model.named_parameters())
    expected = {(name, s) for name, p in params.items() for s in p.shard_names}
    filled: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    files = _checkpoint_files(model_dir)
    tied = getattr(getattr(model, "lm_head", None), "tied", False)
    # A model whose checkpoints name its weights in more than one layout (a VLM saved by
    # transformers 4 or 5) maps each key to its own name first (None: a key with no weights).
    rename = getattr(model, "checkpoint_key", None)
    with tqdm(desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for stored in f.keys():
                    bar.update(1)
                    key = rename(stored) if rename is not None else stored
                    if key is None or key.endswith(model.ignored_key_suffixes):
                        continue
                    if tied and key == "lm_head.weight":
                        # Some tied checkpoints store the head too; it is the embedding.
                        continue
                    name, shard = _target(model, key)
                    param = params.get(name)
                    if param is None:
                        unexpected.append(key)
                        continue
                    if (name, shard) in filled:
                        raise ValueError(f"checkpoint key {key} fills {name} twice")
                    try:
                        param.weight_loader(param, f.get_tensor(stored), shard)
                    except ValueError as e:
                        raise ValueError(f"checkpoint key {key}: {e}") from None
                    filled.add((name, shard))
    if unexpected:
        raise ValueError(
            f"checkpoint keys that no parameter consumes: {sorted(unexpected)[:10]}"
            + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else "")
        )
    missing = sorted(expected - filled, key=str)
    if missing:
        shown = [f"{n}" + (f"[{s}]" if s else "") for n, s in missing[:10]]
        raise ValueError(f"parameters the checkpoint did not fill: {shown}")


def build_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    progress: bool = True,
) -> nn.Module:
    """Build the model for `cfg` and fill it from `model_dir` (or randomly with
    `load_format="dummy"`)."""
    t0 = time.perf_counter()
    cls = get_model_class(cfg.architecture)
    # Parameters are created with torch.empty (no init cost); buffers such as the rotary tables
    # are computed on the target device.
    with torch.device(device):
        model = cls(cfg, dtype, max_positions)
    if load_format == "dummy":
        # Random weights drawn on the target device (an 8B model draws in seconds on a GPU).
        gen = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02, generator=gen)
    elif load_format == "auto":
        if model_dir is None:
            raise ValueError("load_format='auto' needs a model directory")
        load_weights(model, model_dir, progress=progress)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "model %s loaded: %.1f MB of weights in %.2f s",
        cfg.architecture,
        nbytes / 1e6,
        time.perf_counter() - t0,
    )
    return model
