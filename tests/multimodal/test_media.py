"""load_image: every kind of source it accepts, and a clear ValueError for every bad one."""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from braid.runtime.multimodal.media import MediaLimits, describe_source, load_image

LIMITS = MediaLimits()


def _image(width: int = 24, height: int = 16, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A 1-bit grey PNG whose header claims width x height but that holds no pixel data:
    decoding it would fail, so refusing it proves the size was checked first."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    signature = b"\x89PNG\r\n\x1a\n"
    return (
        signature + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return _image()


@pytest.fixture(scope="module")
def png(picture: Image.Image) -> bytes:
    return _encode(picture, "PNG")


# -- accepted sources -----------------------------------------------------------------------------


def test_png_bytes_decode_to_the_same_rgb_pixels(picture: Image.Image, png: bytes) -> None:
    out = load_image(png, LIMITS)
    assert out.mode == "RGB" and out.size == picture.size
    np.testing.assert_array_equal(_pixels(out), _pixels(picture))


def test_jpeg_bytes_decode_as_pillow_decodes_them(picture: Image.Image) -> None:
    jpeg = _encode(picture, "JPEG")
    out = load_image(jpeg, LIMITS)
    assert out.mode == "RGB" and out.size == picture.size
    np.testing.assert_array_equal(_pixels(out), _pixels(Image.open(io.BytesIO(jpeg))))


@pytest.mark.parametrize("fmt", ["WEBP", "BMP", "GIF"])
def test_other_supported_formats_decode(picture: Image.Image, fmt: str) -> None:
    out = load_image(_encode(picture, fmt), LIMITS)
    assert out.mode == "RGB" and out.size == picture.size
    if fmt == "BMP":
        np.testing.assert_array_equal(_pixels(out), _pixels(picture))


def test_animated_gif_gives_its_first_frame() -> None:
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    buf = io.BytesIO()
    red.save(buf, format="GIF", save_all=True, append_images=[blue])
    out = load_image(buf.getvalue(), LIMITS)
    assert out.getpixel((3, 3)) == (255, 0, 0)


def test_data_url_and_bare_base64_give_the_same_pixels(picture: Image.Image, png: bytes) -> None:
    b64 = base64.b64encode(png).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))  # MIME line breaks
    urlsafe_unpadded = base64.urlsafe_b64encode(png).decode().rstrip("=")
    for source in (f"data:image/png;base64,{b64}", b64, wrapped, urlsafe_unpadded):
        np.testing.assert_array_equal(_pixels(load_image(source, LIMITS)), _pixels(picture))


def test_pil_image_is_copied_to_rgb_with_transparency_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    out = load_image(rgba, LIMITS)
    assert out.mode == "RGB" and rgba.mode == "RGBA"
    assert out.getpixel((0, 0)) == (10, 20, 30)
    assert out.getpixel((1, 1)) == (255, 255, 255)
    rgb = _image()
    copy = load_image(rgb, LIMITS)
    assert copy is not rgb
    np.testing.assert_array_equal(_pixels(copy), _pixels(rgb))


# -- local files ----------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path, png: bytes) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    return root


def test_local_file_inside_the_allowed_dir_loads(media_dir: Path, picture: Image.Image) -> None:
    limits = MediaLimits(allowed_local_media_path=media_dir)
    for source in (str(media_dir / "cat.png"), "cat.png", (media_dir / "cat.png").as_uri()):
        np.testing.assert_array_equal(_pixels(load_image(source, limits)), _pixels(picture))


def test_local_file_is_refused_without_an_allowed_dir(media_dir: Path) -> None:
    for source in (str(media_dir / "cat.png"), (media_dir / "cat.png").as_uri()):
        with pytest.raises(ValueError, match="local file paths are refused"):
            load_image(source, LIMITS)


def test_the_offline_callers_files_load_from_anywhere(
    media_dir: Path, picture: Image.Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline `LLM` (`caller_files`): a `Path` names any readable file, relative to the
    working directory; a string (which may come from a message) keeps the server's rule; an
    allowed directory still narrows it."""
    limits = MediaLimits(caller_files=True)
    monkeypatch.chdir(media_dir.parent)
    secret = media_dir.parent / "secret.png"
    for source in (secret, Path("secret.png"), Path("media/cat.png")):
        np.testing.assert_array_equal(_pixels(load_image(source, limits)), _pixels(picture))
    for source in (str(secret), secret.as_uri()):
        with pytest.raises(ValueError, match="local file paths are refused"):
            load_image(source, limits)
    with pytest.raises(ValueError, match="no such file"):
        load_image(Path("missing.png"), limits)
    with pytest.raises(ValueError, match="must be a string"):
        load_image(secret, LIMITS)  # a Path only where files are the caller's
    narrowed = MediaLimits(allowed_local_media_path=media_dir, caller_files=True)
    with pytest.raises(ValueError, match="outside the allowed directory"):
        load_image(secret, narrowed)


def test_an_unsupported_url_scheme_is_named(media_dir: Path) -> None:
    for source in ("ftp://x/y.png", "s3://bucket/cat.png"):
        with pytest.raises(ValueError, match="URL scheme '(ftp|s3)' is not supported"):
            load_image(source, MediaLimits(caller_files=True))


def test_local_file_outside_the_allowed_dir_is_refused(media_dir: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=media_dir)
    for source in (str(media_dir.parent / "secret.png"), "../secret.png"):
        with pytest.raises(ValueError, match="outside the allowed directory"):
            load_image(source, limits)


def test_symlink_escaping_the_allowed_dir_is_refused(media_dir: Path) -> None:
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    (media_dir / "inner.png").symlink_to(media_dir / "cat.png")
    limits = MediaLimits(allowed_local_media_path=media_dir)
    with pytest.raises(ValueError, match="outside the allowed directory"):
        load_image(str(media_dir / "link.png"), limits)
    assert load_image(str(media_dir / "inner.png"), limits).size == (24, 16)


def test_local_path_that_is_not_a_regular_file_is_refused(media_dir: Path) -> None:
    (media_dir / "sub").mkdir()
    os.mkfifo(media_dir / "pipe")
    limits = MediaLimits(allowed_local_media_path=media_dir)
    with pytest.raises(ValueError, match="no such file"):
        load_image(str(media_dir / "missing.png"), limits)
    for name in ("sub", "pipe"):
        with pytest.raises(ValueError, match="not a regular file"):
            load_image(str(media_dir / name), limits)


def test_local_file_over_the_size_limit_is_refused(media_dir: Path, png: bytes) -> None:
    limits = MediaLimits(allowed_local_media_path=media_dir, max_image_bytes=len(png) - 1)
    with pytest.raises(ValueError, match="too large"):
        load_image("cat.png", limits)


def test_allowed_dir_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        MediaLimits(allowed_local_media_path=tmp_path / "nope")
    with pytest.raises(ValueError, match="max_pixels"):
        MediaLimits(max_pixels=0)


# -- http(s) URLs ---------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    png = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self._send(200, self.png)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/big":
            # No Content-Length: the client must stop on the bytes it counts.
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 4096)
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            time.sleep(2.0)
        else:
            self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    block_on_close = False  # the slow handler must not hold the test's teardown
    daemon_threads = True


@pytest.fixture(scope="module")
def server(png: bytes) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"png": png})
    httpd = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_url_is_fetched_and_redirects_followed(server: str, picture: Image.Image) -> None:
    for path in ("/cat.png", "/moved"):
        np.testing.assert_array_equal(_pixels(load_image(server + path, LIMITS)), _pixels(picture))


def test_http_error_status_is_a_clear_error(server: str) -> None:
    with pytest.raises(ValueError, match="could not fetch the URL: HTTP 404"):
        load_image(server + "/missing.png", LIMITS)


def test_download_over_the_size_limit_stops(server: str) -> None:
    with pytest.raises(ValueError, match=r"too large: over the limit of 64 KB \(max_image_bytes"):
        load_image(server + "/big", MediaLimits(max_image_bytes=64 * 1024))


def test_slow_url_times_out(server: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="could not fetch the URL: timed out after 0.3 s"):
        load_image(server + "/slow", MediaLimits(fetch_timeout_s=0.3))
    assert time.monotonic() - start < 1.5


def test_unreachable_host_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="could not fetch the URL: ConnectError"):
        load_image("http://127.0.0.1:9/cat.png", MediaLimits(fetch_timeout_s=2.0))


# -- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    ["data:image/png;base64,@@@@notbase64", "iVBORw0KGgoAA", "hello there, not base64!"],
)
def test_invalid_base64_is_named(source: str) -> None:
    with pytest.raises(ValueError, match="invalid base64"):
        load_image(source, LIMITS)


def test_data_url_that_is_not_an_image_or_not_base64_is_refused(png: bytes) -> None:
    b64 = base64.b64encode(png).decode()
    with pytest.raises(ValueError, match="media type 'text/html', not image"):
        load_image(f"data:text/html;base64,{b64}", LIMITS)
    with pytest.raises(ValueError, match="not base64-encoded"):
        load_image("data:image/png,rawdata", LIMITS)


def test_bytes_that_are_not_an_image_are_named() -> None:
    with pytest.raises(ValueError, match=r"^bytes \(26 B\): not an image: cannot identify image"):
        load_image(b"definitely not a png file!", LIMITS)
    b64 = base64.b64encode(b"plain text, no picture here").decode()
    with pytest.raises(ValueError, match="cannot identify image file"):
        load_image(b64, LIMITS)


def test_truncated_png_is_named(png: bytes) -> None:
    with pytest.raises(ValueError, match="truncated"):
        load_image(png[: len(png) // 2], LIMITS)


@pytest.mark.parametrize("fmt", ["TIFF", "ICO"])
def test_unsupported_format_is_named(picture: Image.Image, fmt: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported image format {fmt}"):
        load_image(_encode(picture, fmt), LIMITS)


def test_too_many_pixels_is_refused_from_the_header(png: bytes) -> None:
    # Over our limit but under Pillow's own bomb check, with no pixel data behind the header:
    # the pixel count was checked before any decoding.
    with pytest.raises(ValueError, match="too many pixels: 6000x6000 is over the limit"):
        load_image(_png_header(6000, 6000), LIMITS)
    # Over Pillow's own check too (it raises in Image.open).
    with pytest.raises(ValueError, match="too many pixels"):
        load_image(_png_header(20000, 20000), MediaLimits(max_pixels=2**31))
    with pytest.raises(ValueError, match="too many pixels: 24x16"):
        load_image(png, MediaLimits(max_pixels=24 * 16 - 1))
    with pytest.raises(ValueError, match="too many pixels: 24x16"):
        load_image(_image(), MediaLimits(max_pixels=100))


def test_too_large_is_refused_naming_the_limit(png: bytes) -> None:
    limits = MediaLimits(max_image_bytes=1024)
    b64 = base64.b64encode(png).decode()
    for source in (png, b64, f"data:image/png;base64,{b64}"):
        with pytest.raises(ValueError, match=r"too large: over the limit of 1 KB"):
            load_image(source, limits)


def test_unknown_source_type_is_refused() -> None:
    with pytest.raises(ValueError, match="must be a string, bytes or a PIL image, not int"):
        load_image(42, LIMITS)  # type: ignore[arg-type]


def test_describe_source_never_shows_payloads_or_queries(png: bytes) -> None:
    assert describe_source(png).startswith("bytes (")
    assert describe_source("data:image/png;base64,AAAA") == "data URL (26 B)"
    assert describe_source("https://u:p@host.example:8443/a/b.png?token=s3cret") == (
        "https://host.example:8443/a/b.png"
    )
    assert describe_source(base64.b64encode(png).decode()).startswith("base64 string (")
