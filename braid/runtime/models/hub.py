"""Model ids as users type them: `org/name`, `org/name@revision`, `org/name:Q4_K_M`, resolved
through `huggingface_hub` and its cache.

A model id names a repository on the Hugging Face hub, optionally a revision (a branch, tag or
commit) after `@`, and optionally a GGUF quantization after `:` (`org/name@v2:Q4_K_M`). Only
the files braid loads are fetched: config, tokenizer and processor files and the top-level
safetensors for a Hugging Face model, or the one GGUF file picked by the quantization tag or
`gguf_file`. Files come from the standard cache (`models--org--name/snapshots/<commit>`,
`refs/<branch>`, `blobs/`), shared with transformers and the `hf` CLI.

The environment is read when a model is resolved, not when `huggingface_hub` was imported (it
freezes its settings then), so a program that sets `HF_HOME` or `HF_HUB_OFFLINE` before it
builds an `LLM` gets what it set: `HF_HUB_CACHE` / `HF_HOME` / `XDG_CACHE_HOME` for the cache,
`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) to never touch the network, `HF_ENDPOINT` for a
mirror, `HF_HUB_ETAG_TIMEOUT` for how long a hub lookup may wait. Tokens come from where
`huggingface_hub` looks (`HF_TOKEN`, `hf auth login`).

When the hub cannot be reached (offline mode, a failed connection, a timeout), a cached
snapshot of the revision is used as it is; with none, resolution fails at once with a
`ValueError` that says the model is not in the cache and how to get it.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# `org/name`, then `@revision` (a branch, tag or commit; may hold "/": refs/pr/1), then
# `:QUANT` (a GGUF file's quantization). Git refs cannot hold ":" or "@{", so the split is exact.
_MODEL_ID = re.compile(
    r"(?P<repo>[^/@:\s]+/[^/@:\s]+)(?:@(?P<revision>[^@:\s]+))?(?::(?P<quant>[^@:/\s]+))?"
)
# What a Hugging Face model directory needs besides its weights (top-level files only).
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template.*",
    "preprocessor_config.json",
    "processor_config.json",
    "quantize_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
)
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_DEFAULT_LOOKUP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelId:
    """A parsed model id: the hub repository, the revision and GGUF quantization it names."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelId | None:
        """The model id `text` spells, or None when it is not one (a path, a bare name)."""
        if text.startswith(("/", ".", "~")) or "\\" in text:
            return None
        m = _MODEL_ID.fullmatch(text)
        if m is None:
            return None
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(m["repo"])
        except ValueError:
            return None
        return cls(m["repo"], m["revision"], m["quant"])


@dataclass(frozen=True)
class HubEnv:
    """The hub settings in force now (see the module doc: read at call time)."""

    cache_dir: Path
    offline: bool
    endpoint: str
    timeout_s: float

    @classmethod
    def current(cls) -> HubEnv:
        env = os.environ
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface",
        )
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or f"{home}/hub"
        flag = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
        try:
            timeout = float(env.get("HF_HUB_ETAG_TIMEOUT") or _DEFAULT_LOOKUP_TIMEOUT_S)
        except ValueError:
            timeout = _DEFAULT_LOOKUP_TIMEOUT_S
        return cls(
            cache_dir=Path(os.path.expandvars(cache)).expanduser(),
            offline=flag.strip().upper() in ("1", "ON", "YES", "TRUE"),
            endpoint=(env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"),
            timeout_s=timeout,
        )


def fetch_model(
    model_id: ModelId, *, revision: str | None = None, gguf_file: str | None = None
) -> Path:
    """The local path of `model_id`'s weights: its snapshot directory (a Hugging Face model),
    or the picked GGUF file inside it. Downloads what is missing unless the hub is out of reach
    (then the cache must hold the revision). `revision` and `gguf_file` are the settings of
    the same names; they may not contradict the id. `ValueError` says what is wrong and what
    to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    name = _display(model_id)
    if revision is not None and model_id.revision not in (None, revision):
        raise ValueError(
            f"model {name!r} names revision {model_id.revision!r} but revision is {revision!r}: "
            "give one"
        )
    if gguf_file is not None and model_id.quant is not None:
        raise ValueError(f"model {name!r} names a quantization and gguf_file is set: give one")
    rev = revision or model_id.revision or "main"
    env = HubEnv.current()
    listed = _hub_listing(model_id.repo_id, rev, env)
    if isinstance(listed, str):
        commit, files = _cached_listing(model_id, rev, env, why=listed)
        local_only = True
        if not env.offline:
            logger.warning("model %s: %s; using cached commit %s", name, listed, commit[:12])
    else:
        commit, files = listed
        local_only = False
    chosen = choose_files(name, files, quant=model_id.quant, gguf_file=gguf_file)
    try:
        folder = snapshot_download(
            model_id.repo_id,
            revision=commit,
            cache_dir=env.cache_dir,
            endpoint=env.endpoint,
            local_files_only=local_only,
            allow_patterns=[glob.escape(f) for f in chosen],
            etag_timeout=env.timeout_s,
        )
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"model {name!r}: the cached snapshot {commit[:12]} lacks files braid needs ({e}); "
            f"{_how_to_get(model_id, chosen)}"
        ) from e
    except (HfHubHTTPError, OSError, _transport_error()) as e:
        raise ValueError(f"model {name!r}: downloading {chosen} failed: {e}") from e
    weights = [f for f in chosen if f.lower().endswith(".gguf")]
    return Path(folder) / weights[0] if weights else Path(folder)


def choose_files(
    name: str, files: list[str], *, quant: str | None = None, gguf_file: str | None = None
) -> list[str]:
    """The files of a repository (repo-relative paths) that braid loads: one GGUF file when
    `gguf_file` or `quant` picks one (or the repository has nothing else), otherwise the
    top-level files of a Hugging Face model directory."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file not in files:
            raise ValueError(
                f"model {name!r} has no file {gguf_file!r} (its GGUF files: {ggufs or 'none'})"
            )
        return [_one_gguf(name, gguf_file)]
    # A vision projector ships beside the language model's GGUF files; it is never the model.
    models = [f for f in ggufs if not os.path.basename(f).lower().startswith("mmproj")]
    if quant is not None:
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
        picked = [f for f in models if tag.search(os.path.basename(f)[: -len(".gguf")])]
        if len(picked) != 1:
            found = "several GGUF files match" if picked else "no GGUF file matches"
            raise ValueError(
                f"model {name!r}: {found} {quant!r} (its GGUF files: {models or 'none'}); "
                "name the file with --gguf-file (gguf_file=)"
            )
        return [_one_gguf(name, picked[0])]
    top = [f for f in files if "/" not in f]
    if any(f.endswith(".safetensors") for f in top):
        if "config.json" not in top:
            raise ValueError(f"model {name!r} has safetensors weights but no config.json")
        return sorted(f for f in top if any(fnmatch.fnmatch(f, p) for p in _MODEL_FILES))
    if len(models) == 1:
        return [_one_gguf(name, models[0])]
    if models:
        raise ValueError(
            f"model {name!r} has {len(models)} GGUF files: pick one with {name}:QUANT (e.g. "
            f"{name}:Q4_K_M) or --gguf-file (gguf_file=): {models}"
        )
    shown = sorted(files)[:20]
    raise ValueError(
        f"model {name!r} has no safetensors or GGUF weights, which braid loads (files: {shown})"
    )


def _one_gguf(name: str, path: str) -> str:
    if _SPLIT_GGUF.search(path):
        raise ValueError(
            f"model {name!r}: {path} is one part of a split GGUF file, which braid does not "
            "load; merge the parts into one file (llama-gguf-split --merge) and pass its path"
        )
    return path


def _display(model_id: ModelId) -> str:
    return model_id.repo_id + (f"@{model_id.revision}" if model_id.revision else "")


def _transport_error() -> type[Exception]:
    # huggingface_hub 2 talks through httpx2; its transport errors are connection failures,
    # timeouts and proxies that did not answer.
    import httpx2

    return httpx2.TransportError


def _hub_listing(repo_id: str, rev: str, env: HubEnv) -> tuple[str, list[str]] | str:
    """The commit `rev` is at and the repository's files, from the hub; or, when the hub cannot
    be reached, why not (then the cache answers). `ValueError` when the hub says the
    repository or revision does not exist."""
    if env.offline:
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi(endpoint=env.endpoint).model_info(repo_id, revision=rev, timeout=env.timeout_s)
    except RevisionNotFoundError as e:
        raise ValueError(f"model {repo_id!r} has no revision {rev!r} on {env.endpoint}") from e
    except RepositoryNotFoundError as e:
        raise ValueError(
            f"model {repo_id!r} is not on {env.endpoint}, or it is private or gated: check the "
            "name; for a private or gated model log in (`hf auth login`) or set HF_TOKEN"
        ) from e
    except OfflineModeIsEnabled:
        return "HF_HUB_OFFLINE is set"
    except (HfHubHTTPError, _transport_error()) as e:
        return f"the hub at {env.endpoint} could not be reached ({type(e).__name__}: {e})"
    if info.sha is None or info.siblings is None:
        raise ValueError(f"model {repo_id!r}: the hub's answer has no commit or file list")
    return info.sha, [s.rfilename for s in info.siblings]


def _cached_listing(model_id: ModelId, rev: str, env: HubEnv, why: str) -> tuple[str, list[str]]:
    """The commit and files of revision `rev` in the local cache, found by
    `huggingface_hub.scan_cache_dir`; `ValueError` saying how to get the model when the cache
    does not hold it."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    name = _display(model_id)
    try:
        repos = scan_cache_dir(env.cache_dir).repos
    except CacheNotFound:
        repos = frozenset()
    repo = next(
        (r for r in repos if r.repo_id == model_id.repo_id and r.repo_type == "model"), None
    )
    if repo is None:
        raise ValueError(
            f"model {name!r} is not in the Hugging Face cache ({env.cache_dir}) and {why}: "
            f"{_how_to_get(model_id)}"
        )
    for cached in repo.revisions:
        if rev in cached.refs or cached.commit_hash == rev:
            files = [f.file_path.relative_to(cached.snapshot_path).as_posix() for f in cached.files]
            return cached.commit_hash, files
    have = sorted(
        f"{', '.join(sorted(r.refs))} ({r.commit_hash[:12]})" if r.refs else r.commit_hash[:12]
        for r in repo.revisions
    )
    raise ValueError(
        f"revision {rev!r} of model {model_id.repo_id!r} is not in the Hugging Face cache "
        f"({env.cache_dir}; cached: {'; '.join(have) or 'none'}) and {why}: "
        f"{_how_to_get(model_id, revision=rev)}"
    )


def _how_to_get(
    model_id: ModelId, files: list[str] | None = None, revision: str | None = None
) -> str:
    rev = revision or model_id.revision
    cmd = f"hf download {model_id.repo_id}"
    if rev:
        cmd += f" --revision {rev}"
    if files:
        cmd += " " + " ".join(files)
    elif model_id.quant:
        cmd += f" --include '*{model_id.quant}*'"
    return (
        f"download it where the hub is reachable (`{cmd}`) into this cache (HF_HOME or "
        "HF_HUB_CACHE choose it), then run again"
    )
