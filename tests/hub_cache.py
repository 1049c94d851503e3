"""A Hugging Face hub cache built on disk the way `huggingface_hub` lays out its downloads
(`models--org--name/blobs/<hash>`, `snapshots/<commit>/<file>` as relative symlinks to the
blobs, `refs/<branch>` holding the commit), so tests load hub model ids with no hub at all.
Also the tiny chat model those tests serve: a random Llama with a byte-level BPE tokenizer
and a ChatML template."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_snapshot(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes | Path],
    *,
    refs: tuple[str, ...] = ("main",),
    commit: str | None = None,
) -> str:
    """Put `files` (repo path -> content, or a file whose content it is) into the cache at
    `cache` (what HF_HUB_CACHE names) as one commit of `repo_id`, which each of `refs` then
    points at. Large-file blobs are named by their sha256 (as the hub's LFS files are), the
    others by their git blob hash. Returns the commit hash."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    contents = {
        name: data if isinstance(data, bytes) else Path(data).read_bytes()
        for name, data in files.items()
    }
    if commit is None:
        digest = hashlib.sha1(repo_id.encode())
        for name in sorted(contents):
            digest.update(name.encode() + hashlib.sha256(contents[name]).digest())
        commit = digest.hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for name, data in contents.items():
        if name.endswith((".safetensors", ".gguf")):
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


def dir_files(path: Path) -> dict[str, Path]:
    """Every file under directory `path`, by its path relative to it."""
    return {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*")) if p.is_file()}


def build_tiny_chat_model(path: Path, seed: int = 1234) -> Path:
    """A tiny random Llama (tests/conftest.py's) with a byte-level BPE tokenizer and a ChatML
    template, saved to `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_config
    from tests.runtime.tiny_tokenizers import build_byte_level_bpe

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config("llama"), dtype=torch.float32)
    model.save_pretrained(str(path))
    build_byte_level_bpe(path)
    (path / "chat_template.jinja").write_text(CHATML)
    return path
