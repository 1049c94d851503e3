"""The front end's side of images: a prompt's image sources become the processed images a
`GenerateReq` carries.

An image URL is downloaded on the asyncio loop (`media.fetch`: a slow server holds no thread);
loading (a file, base64, the download), decoding, the checks against the limits and the model's
image processor run in worker threads, never on the loop; the prompt's image placeholders are
then expanded to each image's number of tokens. One per `LLM` or server.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from braid.runtime.config import EngineConfig
from braid.runtime.errors import ParamError
from braid.runtime.image_data import to_wire
from braid.runtime.ipc.to_scheduler import ImageInput
from braid.runtime.models.config import ModelConfig
from braid.runtime.multimodal.media import MediaLimits, describe_source, fetch, is_url, load_image
from braid.runtime.multimodal.processor import ImageProcessor

# Image threads: decoding and resizing release the GIL (Pillow, numpy), so a machine with
# more cores processes more images at once.
WORKERS = max(2, min(8, os.cpu_count() or 2))


class MediaFrontend:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        model_config: ModelConfig,
        tokenizer: Any,
        caller_files: bool = False,
    ) -> None:
        """`caller_files`: prompts may name any file the process can read (the offline `LLM`,
        whose prompts are its caller's) unless `allowed_local_media_path` narrows them."""
        self.model_name = model_dir.name
        self.max_images = config.limit_mm_per_prompt
        self.limits = MediaLimits(
            max_image_bytes=config.max_image_bytes,
            max_pixels=config.max_image_pixels,
            fetch_timeout_s=config.media_fetch_timeout_s,
            allowed_local_media_path=(
                Path(config.allowed_local_media_path) if config.allowed_local_media_path else None
            ),
            caller_files=caller_files,
        )
        # Images travel as the processor's uint8 image and its recipe; a processor braid does
        # not split sends floats, in the dtype the model will run in (`torch_dtype`).
        self.pixel_dtype = config.torch_dtype(model_config.dtype)
        self.processor: ImageProcessor | None = None
        if model_config.is_multimodal and tokenizer is not None:
            self.processor = ImageProcessor.from_model_dir(model_dir, model_config, tokenizer)
        self._pool: ThreadPoolExecutor | None = None
        # A PIL image given by the caller may be shared by many prompts (one image, many
        # questions) and lazily decoded: PIL's load() is not thread-safe, so its conversion
        # runs one at a time; processing the converted copy needs no lock.
        self._pil_lock = threading.Lock()

    @property
    def supports_images(self) -> bool:
        return self.processor is not None

    @property
    def placeholder(self) -> str:
        """The prompt text that stands for one image; a `ParamError` for a text-only model."""
        self._require()
        return self.processor.placeholder

    def _require(self, where: str = "images") -> ImageProcessor:
        if self.processor is None:
            raise ParamError.at(
                where,
                f"model {self.model_name} takes text only; images need a vision-language model",
            )
        return self.processor

    def check_count(self, n: int, where: str = "prompt") -> None:
        if n and self.processor is None:
            self._require(where)
        if n > self.max_images:
            raise ParamError.at(
                where,
                f"{n} images is more than one prompt may hold "
                f"(limit_mm_per_prompt = {self.max_images})",
            )

    def check_no_placeholders(self, input_ids: list[int], where: str = "prompt") -> None:
        """A `ParamError` if a prompt sent without images holds the model's image token (its
        embedding row would stand in for an image that is not there)."""
        if self.processor is not None and self.processor.image_token_id in input_ids:
            n = input_ids.count(self.processor.image_token_id)
            raise ParamError.at(
                where,
                f"the prompt holds {n} image token(s) "
                f"({self.processor.placeholder!r}) but no images were given",
            )

    async def _prepare_one(self, source: Any, where: str, i: int) -> ImageInput:
        label = None
        if is_url(source):
            try:
                source, label = await fetch(source, self.limits), describe_source(source)
            except ValueError as e:
                raise ParamError(where, f"{where}: image {i}: {e}") from None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._load, source, where, i, label)

    def _load(self, source: Any, where: str, i: int, label: str | None) -> ImageInput:
        """Image `i` of the prompt at `where` loaded, processed and put in its message form
        (offset set later); `label` names a downloaded image's URL in errors."""
        try:
            if hasattr(source, "getpixel"):  # a PIL image
                with self._pil_lock:
                    loaded = load_image(source, self.limits)
            else:
                loaded = load_image(source, self.limits, label)
            image = self.processor.process(loaded)
        except ValueError as e:
            raise ParamError(where, f"{where}: image {i}: {e}") from None
        return to_wire(image, 0, self.pixel_dtype)

    async def prepare(
        self, input_ids: list[int], sources: list[Any], where: str = "prompt"
    ) -> tuple[list[int], list[ImageInput]]:
        """`input_ids` with each image placeholder token expanded, and the images to send.
        A `ParamError` (naming `where` and the image) for an image that cannot be loaded or is
        over a limit, a text-only model, too many images, or placeholders that do not match
        the images in number."""
        if not sources:
            self.check_no_placeholders(input_ids, where)
            return input_ids, []
        processor = self._require(where)
        self.check_count(len(sources), where)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="braid-media")
        images = await asyncio.gather(
            *(self._prepare_one(s, where, i) for i, s in enumerate(sources))
        )
        try:
            ids, offsets = processor.expand(input_ids, images)  # reads each one's num_tokens
        except ValueError as e:
            raise ParamError.at(where, str(e)) from None
        for image, offset in zip(images, offsets):
            image.offset = offset
        return ids, images

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# Content-part types that carry an image, and the key holding it (OpenAI's image_url, and the
# forms vLLM's and transformers' chat APIs take offline).
IMAGE_PARTS = {"image_url": "image_url", "image": "image", "image_pil": "image_pil"}


def flatten_content(content: Any, placeholder: str | None, where: str) -> tuple[str, list[Any]]:
    """A message's content as template text and the image sources it holds, in order: text
    parts joined, a newline between two text parts that follow each other (vLLM joins its
    text parts by newlines; braid keeps each image where it stands among them), each image
    part replaced by `placeholder` (the model's text for one image, so any chat template
    renders it; None: the model takes no images, a `ParamError`)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ParamError.at(where, "content must be a string or a list of parts")
    text, sources = [], []
    last = None  # the previous part's type
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ParamError.at(f"{where}[{j}].text", "must be a string")
            if last == "text":  # text parts on lines of their own, as vLLM joins them
                text.append("\n")
            text.append(part["text"])
        elif kind in IMAGE_PARTS:
            if placeholder is None:
                raise ParamError.at(
                    f"{where}[{j}]",
                    f"an {kind} part, but this model takes text only; images "
                    "need a vision-language model",
                )
            value = part.get(IMAGE_PARTS[kind])
            if kind == "image_url" and isinstance(value, dict):
                value = value.get("url")
            if value is None or (isinstance(value, str) and not value):
                raise ParamError.at(f"{where}[{j}].{IMAGE_PARTS[kind]}", "no image given")
            sources.append(value)
            text.append(placeholder)
        else:
            raise ParamError.at(
                f"{where}[{j}]", f"part type {kind!r} is not supported (text, image_url, image)"
            )
        last = kind
    return "".join(text), sources
