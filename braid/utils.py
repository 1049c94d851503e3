"""Helpers SGLang programs and scripts import from `sglang.utils` (and a tokenizer loader they
import from `sglang.srt`), under the same names."""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def download_and_cache_file(url: str, filename: str | None = None) -> str:
    """The path of `url`'s file, downloaded once: by default into `$BRAID_DOWNLOAD_DIR` or
    else the temp directory (where SGLang's helper puts it), under the URL's last path
    component. A file already there is used as it is, so a dataset put in place by hand runs
    offline. `ValueError` if it is not there and cannot be downloaded."""
    if filename is None:
        directory = os.environ.get("BRAID_DOWNLOAD_DIR") or tempfile.gettempdir()
        filename = os.path.join(directory, url.rsplit("/", 1)[-1])
    if os.path.exists(filename):
        return filename
    from tqdm import tqdm

    part = filename + ".part"
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(part, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(
                total=total, unit="B", unit_scale=True, desc=os.path.basename(filename)
            ) as bar:
                while chunk := resp.read(1 << 16):
                    out.write(chunk)
                    bar.update(len(chunk))
    except OSError as e:
        Path(part).unlink(missing_ok=True)
        raise ValueError(f"cannot download {url} to {filename}: {e}") from None
    os.replace(part, filename)
    return filename


def read_jsonl(filename: str) -> Iterator[Any]:
    """The JSON value of each non-empty line of `filename`."""
    with open(filename) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def get_tokenizer(tokenizer_path: str | None = None, **kwargs: Any):
    """The Hugging Face tokenizer of a model directory or .gguf file (None: the embedded
    model), as the runtime loads it. SGLang's keyword options (`tokenizer_mode`,
    `trust_remote_code`, `revision`) are accepted; braid's loader needs none of them."""
    from braid.runtime.models.source import resolve_model
    from braid.runtime.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(tokenizer_path))
