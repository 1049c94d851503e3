"""The prompts `LLM.generate` and `LLM.embed` take, vLLM's way: a string, token ids, or a dict
with "prompt" or "prompt_token_ids", and optionally "multi_modal_data" ({"image": one image or
a list; a string naming an existing file is read as that file}) and "cache_salt" (only prompts
with the same salt share this one's cached KV). A dict key braid does not know is refused by
name, never dropped."""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from braid.runtime.errors import ParamError
from braid.runtime.multimodal.media import only_a_path

if TYPE_CHECKING:
    from braid.runtime.multimodal.frontend import MediaFrontend
    from braid.runtime.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "cache_salt")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")
# As the server's cache_salt: a short non-empty string.
MAX_SALT_CHARS = 256


@dataclass(frozen=True)
class Prompt:
    """A prompt ready to submit: its text (None for token ids), ids, its images' sources and
    its cache salt."""

    text: str | None
    ids: list[int]
    sources: list[Any] = field(default_factory=list)
    cache_salt: str | None = None


def prompt_list(prompts: Any) -> list[PromptInput]:
    """`prompts` as a list of prompts (one prompt alone becomes a list of one)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts: the list is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise ValueError(
        f"prompts must be a string, token ids, or a list of them, got {type(prompts).__name__}"
    )


def read_prompt(
    prompt: PromptInput, i: int, encode: Callable[[str], list[int]], media: MediaFrontend
) -> Prompt:
    """Prompt `i` tokenized (`encode`, for a text) with its images and salt; a `ValueError`
    names what is wrong with it."""
    sources: list[Any] = []
    salt = None
    if isinstance(prompt, dict):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise ParamError(
                f"prompt {i}", f"prompt {i}: unknown key(s) {unknown} (a prompt dict takes "
                f"{', '.join(PROMPT_KEYS)})"
            )  # fmt: skip
        mm = prompt.get("multi_modal_data")
        if mm is not None:
            if not isinstance(mm, dict) or set(mm) - {"image"}:
                raise ValueError(
                    f"prompt {i}: multi_modal_data takes {{'image': image or list}} "
                    f"(got {sorted(mm) if isinstance(mm, dict) else type(mm).__name__})"
                )
            images = mm.get("image")
            sources = list(images) if isinstance(images, (list, tuple)) else [images]
            try:
                sources = [_caller_file(s) for s in sources]
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            media.check_count(len(sources), f"prompt {i}")
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT_CHARS):
            raise ParamError(
                f"prompt {i}", f"prompt {i}: cache_salt must be a non-empty string of at most "
                f"{MAX_SALT_CHARS} characters, got {salt!r:.40}"
            )  # fmt: skip
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"prompt {i}: a dict takes one of 'prompt' and 'prompt_token_ids'")
        key, want = ("prompt", str) if "prompt" in prompt else ("prompt_token_ids", (list, tuple))
        prompt = prompt[key]
        if not isinstance(prompt, want):
            what = "a string" if key == "prompt" else "a list of token ids"
            raise ValueError(f"prompt {i}: {key} must be {what}, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {i}: the prompt is empty")
        return Prompt(prompt, encode(prompt), sources, salt)
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError(f"prompt {i}: the prompt is empty")
        types = set(map(type, prompt))  # a quarter of an isinstance loop's time
        if types <= {int}:
            return Prompt(None, list(prompt), sources, salt)
        # Other integer types (numpy's, an IntEnum) become ints; bools and floats are not
        # token ids.
        if any(t is bool or not issubclass(t, numbers.Integral) for t in types):
            raise ValueError(f"prompt {i}: token ids must be integers")
        return Prompt(None, [operator.index(t) for t in prompt], sources, salt)
    raise ValueError(f"prompt {i}: expected a string or token ids, got {type(prompt).__name__}")


def _caller_file(source: Any) -> Any:
    """An image source the caller wrote in `multi_modal_data`: a string naming a file that
    exists becomes its `Path`, which the offline `LLM` reads wherever it is (a string in a chat
    message, which may come from anyone, never does)."""
    if isinstance(source, str) and "://" not in source[:16] and not source.startswith("data:"):
        try:
            if os.path.isfile(source):
                return Path(source)
        except (OSError, ValueError):  # too long, or a NUL: not a file name
            return source
        absolute = os.path.isabs(source)  # a relative one may name a file under an allowed dir
        if (absolute and only_a_path(source)) or Path(source).suffix.lower() in IMAGE_SUFFIXES:
            raise ValueError(f"image file {source!r} does not exist")
    return source


def truncated(item: Prompt, params: SamplingParams, index: int, context_length: int) -> Prompt:
    """`item` with its prompt cut to its last `params.truncate_prompt_tokens` tokens; a
    `ParamError` for a prompt with images (a cut would split an image's tokens)."""
    try:
        ids = params.prompt_tail(item.ids, context_length, bool(item.sources))
    except ParamError as e:
        raise ParamError(e.param, f"prompt {index}: {e}") from None
    return replace(item, ids=ids)


def progress(use_tqdm: bool | Callable[..., Any], total: int, desc: str) -> Any:
    """The call's progress bar: tqdm's (off with `use_tqdm=False`), or, as vLLM takes it, one
    made by `use_tqdm` itself when it is a callable (a tqdm class or factory)."""
    make = use_tqdm if callable(use_tqdm) else tqdm
    return make(total=total, desc=desc, unit="req", disable=not use_tqdm)


def priorities(priority: Any, n: int, schedule_policy: str) -> list[int]:
    """`LLM.generate`'s `priority` (vLLM's: one int per prompt, or None: all 0) as a list;
    `ValueError` naming it when it is not that (`check_priority`)."""
    from braid.runtime.scheduler.policies import check_priority

    if priority is None:
        return [0] * n
    if not isinstance(priority, (list, tuple)) or len(priority) != n:
        raise ParamError.at("priority", f"must be a list of {n} integers (one per prompt)")
    return [check_priority(v, schedule_policy, f"priority[{i}]") for i, v in enumerate(priority)]
