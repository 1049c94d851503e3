"""Images over HTTP against a real `braid serve` of a tiny Qwen2.5-VL, driven by the real
`openai` client: `image_url` parts with data URLs and http(s) URLs (a local server on
127.0.0.1), local files only under `--allowed-local-media-path`, `/generate` `image_data`,
usage counting image tokens; and every bad image an OpenAI-style 400 naming the problem, with
the server still serving and no KV lost."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import httpx
import openai
import pytest

from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl, tiny_image
from tests.server.conftest import start_server, wait_idle

GREEDY = dict(max_tokens=6, temperature=0.0)


def _png(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    tiny_image(w, h, seed).save(buf, format="PNG")
    return buf.getvalue()


def _tiff() -> bytes:
    buf = io.BytesIO()
    tiny_image(8, 8, 0).save(buf, format="TIFF")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(_png(56, 56, 7))
    return d


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory, media_dir):
    model = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen"), "2.5")
    s = start_server(
        tmp_path_factory.mktemp("serve"),
        "--model",
        str(model),
        "--limit-mm-per-prompt",
        "3",
        "--max-image-bytes",
        "200000",
        "--allowed-local-media-path",
        str(media_dir),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def images_http():
    """A local HTTP server: /ok.png, /big.png (over the server's byte limit), /missing."""
    files = {"/ok.png": _png(84, 56, 3), "/big.png": b"\x89PNG" + b"\0" * 300_000}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            body = files.get(self.path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def client(vlm_server):
    return openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="none", max_retries=0)


def _image_msg(url: str, text: str = "what is this?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


def _chat(client, url: str, **kw):
    return client.chat.completions.create(model="m", messages=_image_msg(url), **GREEDY, **kw)


def test_data_url_http_url_and_local_file_give_answers_counting_image_tokens(
    client, vlm_server, images_http, media_dir
):
    text_only = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "what is this?"}], **GREEDY
    )
    for url in (
        _data_url(_png(84, 56, 3)),
        images_http + "/ok.png",
        (media_dir / "cat.png").as_uri(),
    ):
        r = _chat(client, url)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 6
        # 84x56 and 56x56 images are 6 and 4 image tokens, plus the vision start/end tokens.
        assert r.usage.prompt_tokens >= text_only.usage.prompt_tokens + 4
    # The same image by data URL and by URL is the same content: same greedy answer.
    by_data = _chat(client, _data_url(_png(84, 56, 3))).choices[0].message.content
    by_url = _chat(client, images_http + "/ok.png").choices[0].message.content
    assert by_data == by_url
    info = httpx.get(vlm_server.url + "/get_model_info").json()
    assert info["image_placeholder"] == "<|vision_start|><|image_pad|><|vision_end|>"


def test_streamed_chat_with_an_image_matches_the_whole_answer(client):
    url = _data_url(_png(56, 84, 4))
    whole = _chat(client, url).choices[0].message.content
    chunks = _chat(client, url, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_generate_image_data_single_and_batched(vlm_server):
    ph = httpx.get(vlm_server.url + "/get_model_info").json()["image_placeholder"]
    b64 = base64.b64encode(_png(56, 56, 5)).decode()
    sp = {"max_new_tokens": 5, "temperature": 0.0}
    one = httpx.post(
        vlm_server.url + "/generate",
        json={"text": f"look {ph} now", "image_data": b64, "sampling_params": sp},
    )
    assert one.status_code == 200, one.text
    batch = httpx.post(
        vlm_server.url + "/generate",
        json={
            "text": [f"look {ph} now", f"two {ph}{ph}"],
            "image_data": [[b64], [_data_url(_png(28, 56, 6)), b64]],
            "sampling_params": sp,
        },
    )
    assert batch.status_code == 200, batch.text
    out = batch.json()
    assert out[0]["output_ids"] == one.json()["output_ids"]
    assert out[1]["meta_info"]["prompt_tokens"] > out[0]["meta_info"]["prompt_tokens"]
    assert out[0]["meta_info"]["cached_tokens"] > 0  # the same image and text as `one`


@pytest.mark.parametrize(
    "url,words",
    [
        ("data:image/png;base64,@@@not-base64", "invalid base64"),
        (_data_url(b"these bytes are not an image"), "not an image"),
        (_data_url(_png(32, 32, 1)[:70]), "truncated"),
        (
            "data:image/tiff;base64," + base64.b64encode(_tiff()).decode(),
            "unsupported image format tiff",
        ),
        ("/etc/hostname", "local path refused"),
        ("file:///etc/hostname", "outside"),
    ],
)
def test_bad_image_is_a_400_naming_the_problem(client, url, words):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, url)
    assert words in e.value.message.lower() or words in str(e.value.body).lower()
    assert e.value.body["param"] == "messages"


def test_unfetchable_too_large_and_too_many_images_are_400s(client, images_http, vlm_server):
    for url, words in [
        (images_http + "/missing", "404"),
        (images_http + "/big.png", "too large"),
        ("http://127.0.0.1:9/none.png", "fetch"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, url)
        assert words in e.value.message.lower()
    img = {"type": "image_url", "image_url": {"url": _data_url(_png(8, 8, 1))}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": [img] * 4}], **GREEDY
        )
    assert "limit_mm_per_prompt" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=[img], **GREEDY)
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
    r = httpx.post(
        vlm_server.url + "/generate",
        json={"text": "no placeholder", "image_data": base64.b64encode(_png(8, 8, 1)).decode()},
    )
    assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]
    # The image token typed as text, with no image: refused on every route.
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=f"x {ph}", **GREEDY)
    assert "no images were given" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": ph}], **GREEDY
        )
    assert "no images were given" in e.value.message
    r = httpx.post(vlm_server.url + "/generate", json={"text": ph})
    assert r.status_code == 400 and "no images were given" in r.json()["error"]["message"]
    stats = wait_idle(vlm_server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]
    assert _chat(client, _data_url(_png(28, 28, 2))).choices[0].finish_reason == "length"
