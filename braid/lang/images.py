"""What `image(...)` takes, and the forms the backends send an image in.

A program's image is a local file (`pathlib.Path`; a string that is not a URL is a path), the
encoded file's `bytes`, a `PIL.Image.Image`, or an `http(s)://` / `data:image/...` URL. The
program's own files are read here, in the program's process, so that no backend has to be
allowed to read local paths: braid's runtime refuses them unless configured to, and a remote
server cannot see them.

`image()` checks the type (and that a file exists) when it is called; whether the content is
an image is found when the image is sent: by the runtime's loader (Engine backend) or by
reading its header here (the HTTP backends), each a `ValueError` naming the image.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image as PILImage

    ImageSource = str | Path | bytes | PILImage.Image

URL_SCHEMES = ("http://", "https://", "data:")
_TYPES = "a path (str or pathlib.Path), bytes, a PIL image, or an http(s) or data: URL"
# Pillow's format names -> media types (MPO: the multi-picture JPEG phone cameras write).
_MEDIA_TYPES = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "MPO": "image/jpeg",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
}
_PNG_MODES = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})


def check_source(source: Any) -> ImageSource:
    """`source` as the image node keeps it: a URL string, a `Path` to an existing file, bytes,
    or a PIL image. `ValueError` naming the accepted types for anything else, and for an
    empty value, a `data:` URL that is not an image, or a path that is no file."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise ValueError("image(): the bytes are empty")
        return data
    if isinstance(source, str):
        if not source:
            raise ValueError(f"image(): give {_TYPES}; got an empty string")
        if source[:8].lower().startswith(URL_SCHEMES):
            if source[:5].lower() == "data:" and source[5:11].lower() != "image/":
                raise ValueError("image(): a data URL must be data:image/...;base64,...")
            return source
        source = Path(source)
    if isinstance(source, Path):
        path = source.expanduser()
        if not path.is_file():
            raise ValueError(f"image(): no such file: {source}")
        return path
    if _is_pil_image(source):
        return source
    raise ValueError(f"image(): give {_TYPES}; got {type(source).__name__}")


def _is_pil_image(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image)


def describe(source: ImageSource) -> str:
    """A short name for an image in error messages: never its payload, nor a URL's query or
    credentials."""
    from braid.runtime.multimodal.media import describe_source

    return f"file {source}" if isinstance(source, Path) else describe_source(source)


def read_file(path: Path) -> bytes:
    """The bytes of an image file; `ValueError` if it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"image(): cannot read {path}: {e.strerror or e}") from None


def for_runtime(source: ImageSource) -> bytes | str | PILImage.Image:
    """What braid's runtime loader takes for `source` (`MediaFrontend.prepare`): a file's
    bytes, the rest as they are."""
    return read_file(source) if isinstance(source, Path) else source


def encoded(source: ImageSource) -> tuple[bytes, str]:
    """The encoded image and its media type (`image/png`, ...): a file's or the given bytes,
    a PIL image as PNG. `ValueError` for bytes Pillow does not identify as an image of a
    format braid's runtime reads (only the header is read)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Path):
        data = read_file(source)
    elif isinstance(source, bytes):
        data = source
    else:
        # PNG is lossless and holds every mode but a few (CMYK, YCbCr), which go to RGB.
        image = source if source.mode in _PNG_MODES else source.convert("RGB")
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue(), "image/png"
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ValueError(
            f"image(): {describe(source)} is not an image ({e}); supported: "
            f"{', '.join(sorted(set(_MEDIA_TYPES) - {'MPO'}))}"
        ) from None
    if kind not in _MEDIA_TYPES:
        raise ValueError(f"image(): {describe(source)} is a {kind} image, which is not supported")
    return data, _MEDIA_TYPES[kind]


def to_base64(source: ImageSource) -> str:
    """`source` as SGLang's `/generate` `image_data` takes it: a URL as it is, anything else
    as the base64 of its encoded bytes."""
    if isinstance(source, str):
        return source
    return base64.b64encode(encoded(source)[0]).decode("ascii")


def to_data_url(source: ImageSource) -> str:
    """`source` as an OpenAI `image_url` takes it: an http(s) or data URL as it is, anything
    else as a base64 `data:` URL of its encoded bytes."""
    if isinstance(source, str):
        return source
    data, media_type = encoded(source)
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"
