"""What the front end needs from a model's files: its path, config, tokenizer, generation
defaults and EOS ids. Shared by `LLM` and `braid serve`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from braid.runtime.models.config import ModelConfig, read_json
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
    def load(
        cls,
        model: str | os.PathLike | None,
        *,
        with_tokenizer: bool = True,
        revision: str | None = None,
        gguf_file: str | None = None,
    ) -> ModelAssets:
        """The assets of `model` (as `resolve_model` takes it, with its `revision` and
        `gguf_file`). Everything but the tokenizer is read from small JSON files; the tokenizer
        (which imports transformers) can be loaded later with `load_tokenizer()`, e.g. while
        the runtime processes start."""
        path = resolve_model(model, revision=revision, gguf_file=gguf_file)
        config = ModelConfig.from_dir(path)
        gen_path = path / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
        eos: set[int] = set()
        for src in (gen.get("eos_token_id"), config.raw.get("eos_token_id")):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, list):
                eos.update(i for i in src if isinstance(i, int))
        tok_eos = _tokenizer_eos_id(path)
        if tok_eos is not None:
            eos.add(tok_eos)
        assets = cls(path, config, None, gen, frozenset(eos))
        if with_tokenizer:
            assets.load_tokenizer()
        return assets

    def load_tokenizer(self) -> None:
        if self.tokenizer is None and has_tokenizer(self.path):
            self.tokenizer = load_tokenizer(self.path)

    def default_sampling_params(self, source: str = "auto") -> SamplingParams:
        """braid's defaults, overridden by generation_config.json unless `source="braid"`."""
        if source == "braid":
            return SamplingParams()
        return SamplingParams(**defaults_from_generation_config(self.generation_config))


def _tokenizer_eos_id(path: Path) -> int | None:
    """The tokenizer's EOS id, read from tokenizer_config.json and tokenizer.json without
    loading the tokenizer."""
    cfg_path, tok_path = path / "tokenizer_config.json", path / "tokenizer.json"
    if not cfg_path.is_file() or not tok_path.is_file():
        return None
    eos = read_json(cfg_path).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    tok = read_json(tok_path)
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return added["id"]
    vocab = tok.get("model", {}).get("vocab")
    return vocab.get(eos) if isinstance(vocab, dict) else None
