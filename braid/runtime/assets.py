"""What the front end needs from a model's files: its path, config, tokenizer, generation
defaults and EOS ids. Shared by `LLM` and `braid serve`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from braid.runtime.models.config import ModelConfig
from braid.runtime.models.source import resolve_model
from braid.runtime.sampling_params import SamplingParams, defaults_from_generation_config
from braid.runtime.tokenizer.tokenizer import has_tokenizer, load_tokenizer


@dataclass
class ModelAssets:
    path: Path
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer, or None for a model without tokenizer files
    generation_config: dict[str, Any]
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, model: str | os.PathLike | None) -> ModelAssets:
        path = resolve_model(model)
        config = ModelConfig.from_dir(path)
        tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        eos: set[int] = set()
        for src in (gen.get("eos_token_id"), config.raw.get("eos_token_id")):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, list):
                eos.update(i for i in src if isinstance(i, int))
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(path, config, tokenizer, gen, frozenset(eos))

    def default_sampling_params(self, source: str = "auto") -> SamplingParams:
        """braid's defaults, overridden by generation_config.json unless `source="braid"`."""
        if source == "braid":
            return SamplingParams()
        return SamplingParams(**defaults_from_generation_config(self.generation_config))
