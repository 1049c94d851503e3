"""Turning what a user sends as an image into a validated, fully decoded RGB `PIL.Image`.

A source is a `PIL.Image.Image`, the encoded file's `bytes`, or a string: a
`data:image/...;base64,...` URL, an `http(s)://` URL, a `file://` URL or a plain path (only
under `MediaLimits.allowed_local_media_path`), or bare base64 (as SGLang's `/generate`
`image_data` takes it). A string in one base64 alphabet is read as base64 unless local files
are allowed and it names an existing one; a `file://` URL is never ambiguous.

Every failure is a `ValueError` whose message says what is wrong with the input, so the server
can answer it as an HTTP 400. Limits are checked before the expensive step they guard: the
encoded size before reading or decoding, the pixel count from the image header before
decoding.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import re
import stat
import struct
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

# Pillow's format names; MPO is how Pillow names the multi-picture JPEGs phone cameras write.
SUPPORTED_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})
_SUPPORTED_TEXT = "PNG, JPEG, WEBP, GIF, BMP"

# What Pillow raises on malformed input (its fuzzers accept these as clean failures).
_PIL_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, TypeError)
_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)

_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_BASE64_URLSAFE = re.compile(r"[A-Za-z0-9_\-]+={0,2}")
_WHITESPACE = re.compile(r"\s+")
_MAX_PATH_CHARS = 4096
_SCHEME = re.compile(r"([a-z][a-z0-9+.-]*)://")


@dataclass(frozen=True)
class MediaLimits:
    """What `load_image` accepts. `max_image_bytes` bounds the encoded image (request body,
    file or download); `max_pixels` bounds width * height, read from the header before any
    decoding (decompression bombs). Local files are refused unless
    `allowed_local_media_path` names a directory (as vLLM's `--allowed-local-media-path`);
    a local path must resolve, symlinks followed, to a regular file inside it, and a relative
    path is taken relative to it. `caller_files` (the offline `LLM`): an image given as a
    `Path` object (never a string, which may come from a message) names any file the process
    can read, within `allowed_local_media_path` if that is set."""

    max_image_bytes: int = 20 * 2**20
    max_pixels: int = 32 * 2**20
    fetch_timeout_s: float = 10.0
    allowed_local_media_path: Path | None = None
    caller_files: bool = False

    def __post_init__(self) -> None:
        if self.max_image_bytes <= 0:
            raise ValueError(f"max_image_bytes must be positive, got {self.max_image_bytes}")
        if self.max_pixels <= 0:
            raise ValueError(f"max_pixels must be positive, got {self.max_pixels}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if self.allowed_local_media_path is not None:
            root = Path(os.path.realpath(self.allowed_local_media_path))
            if not root.is_dir():
                raise ValueError(
                    f"allowed_local_media_path {self.allowed_local_media_path} is not a directory"
                )
            # Stored resolved, so containment is checked against the real directory.
            object.__setattr__(self, "allowed_local_media_path", root)


def load_image(
    source: str | bytes | Image.Image, limits: MediaLimits, label: str | None = None
) -> Image.Image:
    """The image `source` stands for, fully decoded (truncation is found here, not later) and
    in RGB mode, transparency composited onto white as transformers' `convert_to_rgb` does.
    Animated GIF/WEBP/PNG give their first frame. A given `PIL.Image` is copied, never
    modified. Raises `ValueError` naming the problem and the source (`label`, or
    `describe_source`: a URL's downloaded bytes are loaded with the URL's description)."""
    try:
        if isinstance(source, Image.Image):
            return _to_rgb(source, limits)
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            _check_size(len(data), limits)
        elif isinstance(source, str):
            data = _read_string(source, limits)
        elif isinstance(source, os.PathLike) and limits.caller_files:
            data = _read_local(os.fspath(source), limits, anywhere=True)
        else:
            raise ValueError(
                f"an image must be a string, bytes or a PIL image, not {type(source).__name__}"
            )
        return _decode(data, limits)
    except ValueError as e:
        hint = ""
        if (
            isinstance(source, str)
            and limits.allowed_local_media_path is None
            and source.startswith(("/", "./", "../", "~"))
            and _looks_like_path(source)
            and "local file paths are refused" not in str(e)
        ):
            # Read as base64 (the alphabets overlap); if a file was meant, say why it was not
            # read, without telling whether it exists.
            hint = (
                "; if this is a file path: local file paths are refused, the server has no "
                "allowed_local_media_path"
            )
        raise ValueError(f"{label or describe_source(source)}: {e}{hint}") from e


def describe_source(source: object) -> str:
    """A short description of an image source for log lines and error messages: never the
    payload itself, and a URL without its query string or credentials."""
    if isinstance(source, Image.Image):
        return f"PIL image ({source.width}x{source.height} {source.mode})"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"bytes ({_size_text(len(source))})"
    if isinstance(source, os.PathLike):
        return _clip(f"path {os.fspath(source)}")
    if not isinstance(source, str):
        return type(source).__name__
    head = source[:16].lower()
    if head.startswith("data:"):
        return f"data URL ({_size_text(len(source))})"
    if head.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(source)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return _clip(f"{parts.scheme}://{host}{parts.path}")
    if head.startswith("file:"):
        return _clip(source)
    if _is_base64_text(source):
        return f"base64 string ({_size_text(len(source))})"
    return _clip(f"path {source}")


# -- reading each kind of source ----------------------------------------------------------------


def _read_string(s: str, limits: MediaLimits) -> bytes:
    head = s[:16].lower()
    if head.startswith("data:"):
        return _read_data_url(s, limits)
    if is_url(s):
        return asyncio.run(_fetch(s, limits))  # the front end awaits `fetch` instead
    if head.startswith("file:"):
        return _read_local(_file_url_path(s), limits)
    scheme = _SCHEME.match(head)
    if scheme:
        raise ValueError(
            f"URL scheme {scheme.group(1)!r} is not supported (http, https, data and file are)"
        )
    if _is_base64_text(s) and not _is_existing_local_path(s, limits):
        return _decode_base64(s, limits)
    if limits.allowed_local_media_path is not None or _looks_like_path(s):
        return _read_local(s, limits)
    raise ValueError("invalid base64 (the string is not a URL, a data URL or a file path either)")


def _read_data_url(url: str, limits: MediaLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ValueError("malformed data URL: no ',' before the data")
    params = [p.strip().lower() for p in header[len("data:") :].split(";")]
    media_type = params[0]
    if not media_type.startswith("image/"):
        raise ValueError(f"data URL has media type {media_type or 'text/plain'!r}, not image/*")
    if "base64" not in params[1:]:
        raise ValueError("data URL is not base64-encoded (expected data:image/...;base64,...)")
    return _decode_base64(payload, limits)


def _is_base64_text(s: str) -> bool:
    # Either alphabet, not both: a path such as /srv/img-1 mixes them, base64 never does.
    s = _WHITESPACE.sub("", s)
    return _BASE64.fullmatch(s) is not None or _BASE64_URLSAFE.fullmatch(s) is not None


def _is_existing_local_path(s: str, limits: MediaLimits) -> bool:
    # A path made only of base64 characters (/srv/images/cat) when local files are allowed.
    root = limits.allowed_local_media_path
    return root is not None and _looks_like_path(s) and os.path.lexists(root / s)


def _decode_base64(text: str, limits: MediaLimits) -> bytes:
    text = _WHITESPACE.sub("", text)
    # Refuse before decoding: base64 carries 3 bytes in every 4 characters.
    _check_size(len(text) * 3 // 4, limits)
    if "-" in text or "_" in text:
        text = text.replace("-", "+").replace("_", "/")  # the URL-safe alphabet
    if len(text) % 4:
        text += "=" * (-len(text) % 4)  # clients often drop the padding
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise ValueError(f"invalid base64: {e}") from e
    if not data:
        raise ValueError("invalid base64: the data is empty")
    return data


def is_url(source: object) -> bool:
    """Whether `source` is an http(s) URL, which `fetch` downloads."""
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


async def fetch(url: str, limits: MediaLimits) -> bytes:
    """The body `url` answers with, within the size limit and `fetch_timeout_s` for the whole
    download; a `ValueError` naming the URL and what went wrong. Awaited on the caller's event
    loop (the front end's): a slow server holds no thread, so it delays no other image."""
    try:
        return await _fetch(url, limits)
    except ValueError as e:
        raise ValueError(f"{describe_source(url)}: {e}") from e


async def _fetch(url: str, limits: MediaLimits) -> bytes:
    import httpx  # only servers that take image URLs need it

    timeout = limits.fetch_timeout_s
    # Identity encoding: the limit then counts what is sent, with no gzip bomb to expand.
    headers = {"Accept-Encoding": "identity", "User-Agent": "braid"}

    async def download() -> bytes:
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=True, headers=headers) as c:
            async with c.stream("GET", url) as response:
                if not response.is_success:
                    raise ValueError(
                        f"could not fetch the URL: HTTP {response.status_code} "
                        f"{response.reason_phrase}".rstrip()
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit():
                    _check_size(int(declared), limits)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    _check_size(len(body), limits)
                return bytes(body)

    try:
        # httpx's timeout bounds each network operation; this bounds the whole download, so a
        # server that drips bytes is not waited on for longer.
        return await asyncio.wait_for(download(), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        raise ValueError(f"could not fetch the URL: timed out after {timeout:g} s") from e
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ValueError(f"could not fetch the URL: {type(e).__name__}: {e}") from e


def _file_url_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URL names the host {parts.netloc!r}; only local files are read")
    if not parts.path:
        raise ValueError("file URL has no path")
    return urllib.parse.unquote(parts.path)


def only_a_path(s: str) -> bool:
    """Whether `s` can only be meant as a file path: it looks like one and is not base64 text
    (a path such as /srv/img_1 mixes the two alphabets)."""
    return _looks_like_path(s) and not _is_base64_text(s)


def _looks_like_path(s: str) -> bool:
    if len(s) > _MAX_PATH_CHARS or "\n" in s or "\x00" in s:
        return False
    return "/" in s or "\\" in s or bool(Path(s).suffix)


def _read_local(path: str, limits: MediaLimits, anywhere: bool = False) -> bytes:
    """The file `path` names: within `allowed_local_media_path`, or (`anywhere`: the offline
    caller's own `Path`) any file when no directory is set."""
    root = limits.allowed_local_media_path
    if root is None and not anywhere:
        raise ValueError("local file paths are refused: the server has no allowed_local_media_path")
    if len(path) > _MAX_PATH_CHARS or "\x00" in path:
        raise ValueError("local path refused: not a valid file path")
    # realpath follows every symlink, so a link inside the directory that points out of it
    # resolves outside and is refused.
    real = Path(os.path.realpath(path if root is None else root / path))
    if root is not None and not real.is_relative_to(root):
        # The directory is not named: clients need not learn the server's layout.
        raise ValueError("local path refused: it is outside the allowed directory")
    # O_NOFOLLOW: a symlink put in place after the check is not followed; O_NONBLOCK: opening
    # a FIFO does not hang the worker (it is then refused as not a regular file).
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError as e:
        raise ValueError("local path refused: no such file") from e
    except OSError as e:
        raise ValueError(f"local path refused: cannot open it ({e.strerror})") from e
    try:
        # fstat on the opened descriptor: what is checked is what is read.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("local path refused: not a regular file")
        _check_size(st.st_size, limits)
        chunks = []
        remaining = limits.max_image_bytes + 1
        while remaining > 0 and (chunk := os.read(fd, min(remaining, 1 << 20))):
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    _check_size(len(data), limits)
    return data


# -- decoding -------------------------------------------------------------------------------------


def _decode(data: bytes, limits: MediaLimits) -> Image.Image:
    try:
        # Image.open reads the header only: format and size are known before any decoding.
        image = Image.open(io.BytesIO(data))
    except _BOMB as e:
        raise ValueError(f"too many pixels: {e}") from e
    except UnidentifiedImageError as e:
        raise ValueError(
            f"not an image: cannot identify image file (supported: {_SUPPORTED_TEXT})"
        ) from e
    except _PIL_ERRORS as e:
        raise ValueError(f"not a valid image: {e}") from e
    with image:
        if image.format not in SUPPORTED_FORMATS:
            raise ValueError(
                f"unsupported image format {image.format} (supported: {_SUPPORTED_TEXT})"
            )
        return _to_rgb(image, limits)


def _to_rgb(image: Image.Image, limits: MediaLimits) -> Image.Image:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"empty image ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ValueError(
            f"too many pixels: {width}x{height} is over the limit of {limits.max_pixels} "
            "(max_pixels)"
        )
    try:
        image.load()
        return _composite_rgb(image)
    except _BOMB as e:
        raise ValueError(f"too many pixels: {e}") from e
    except _PIL_ERRORS as e:
        raise ValueError(f"truncated or corrupt image data: {e}") from e
    except AssertionError as e:  # Pillow asserts that its file is open
        raise ValueError(
            "cannot read the image: the PIL image was closed before it was loaded"
        ) from e


def _composite_rgb(image: Image.Image) -> Image.Image:
    # Transparent pixels keep arbitrary colour values underneath; laying the image on white
    # (as transformers' convert_to_rgb does) keeps what a viewer sees.
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


# -- small helpers --------------------------------------------------------------------------------


def _check_size(nbytes: int, limits: MediaLimits) -> None:
    if nbytes > limits.max_image_bytes:
        raise ValueError(
            f"image too large: over the limit of {_size_text(limits.max_image_bytes)} "
            "(max_image_bytes)"
        )


def _size_text(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 1024 * 1024:
        return f"{nbytes / 1024:.0f} KB"
    return f"{nbytes / 2**20:.1f} MB"


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
