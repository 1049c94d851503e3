"""`braid serve --model org/name` from a Hugging Face cache on disk (no hub reachable), and the
playground page it serves at `/`, driven in a real headless Chromium through selenium.

One server for the module: a tiny random Llama with a byte-level tokenizer and a ChatML
template, served from a fake hub cache under a name of its own and behind an API key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.hub_cache import add_snapshot, build_tiny_chat_model, dir_files
from tests.server.conftest import start_server

REPO = "braid-test/tiny-chat"
KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    model = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")
    add_snapshot(home / "hub", REPO, dir_files(model))
    return home


@pytest.fixture(scope="module")
def server(hf_home, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(hf_home))
        env.setenv("HF_HUB_OFFLINE", "1")
        s = start_server(
            tmp_path_factory.mktemp("serve"),
            "--model",
            REPO,
            "--served-model-name",
            "x",
            "--api-key",
            KEY,
        )
    yield s
    s.stop()


def test_served_model_name_is_what_v1_models_reports(server):
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["x"]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=AUTH,
        json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["model"] == "x"


def test_the_page_and_its_assets_load_without_the_key_and_the_api_does_not(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for asset, kind in [("playground.js", "text/javascript"), ("playground.css", "text/css")]:
        r = httpx.get(f"{server.url}/playground/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), asset
        assert f"/playground/{asset}" in page.text
    # Nothing the page loads comes from another origin: it works with no internet.
    assert "http://" not in page.text and "https://" not in page.text
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/playground/other.js").status_code == 401


def test_the_page_is_not_in_the_openapi_schema(server):
    paths = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()["paths"]
    assert "/v1/chat/completions" in paths
    assert not [p for p in paths if p == "/" or p.startswith("/playground")]


def test_serve_with_a_model_not_in_the_cache_exits_2_with_one_clear_line(hf_home, tmp_path):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "braid", "serve", "--model", "braid-test/absent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "not in the Hugging Face cache" in line]
    assert len(errors) == 1, run.stderr
    assert "hf download braid-test/absent" in errors[0]


# ---- the page in a browser -------------------------------------------------------------------
def _browser_tools() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip(
            "no headless browser: install Debian's chromium and chromium-driver "
            "(`make setup` does where apt-get works)"
        )
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = _browser_tools()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1200,900")
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


def _set(drv, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    # Right after `drv.get` on a loaded machine the page may not be there yet.
    el = WebDriverWait(drv, 30).until(lambda d: d.find_element("id", element_id))
    el.clear()
    el.send_keys(value)


def _reply(drv, index: int, timeout: float = 90.0):
    """The `index`-th assistant message once its stream has ended."""
    from selenium.webdriver.support.ui import WebDriverWait

    def finished(d):
        boxes = d.find_elements("css selector", ".msg.assistant")
        if len(boxes) > index and boxes[index].get_attribute("data-state") in ("done", "failed"):
            return boxes[index]
        return False

    return WebDriverWait(drv, timeout).until(finished)


def _api_reply(server, messages: list[dict], **extra) -> str:
    body = {"model": "x", "messages": messages, "temperature": 0.0, "max_tokens": 12, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.browser
def test_the_page_streams_a_reply_with_its_figures(server, browser):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    drv = browser
    drv.get(f"{server.url}/")
    # Without the key the page says it needs one; with it, it names the served model.
    WebDriverWait(drv, 30).until(lambda d: "API key" in d.find_element("id", "status").text)
    _set(drv, "api-key", KEY + Keys.TAB)
    WebDriverWait(drv, 30).until(lambda d: d.find_element("id", "model-name").text == "x")

    system = "You answer briefly."
    _set(drv, "system-prompt", system)
    drv.execute_script(
        "const t = document.getElementById('temperature'); t.value = '0';"
        "t.dispatchEvent(new Event('input'));"
    )
    _set(drv, "max-tokens", "12")
    _set(drv, "message-input", "hello world" + Keys.ENTER)
    first = _reply(drv, 0)
    assert first.get_attribute("data-state") == "done", first.text
    shown = first.find_element("css selector", ".content").get_property("textContent")
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}]
    assert shown and shown == _api_reply(server, turn1)
    figures = first.find_element("css selector", ".figures").text
    assert "tokens/s" in figures and "cached prompt tokens" in figures, figures
    user = drv.find_elements("css selector", ".msg.user .content")
    assert [u.get_property("textContent") for u in user] == ["hello world"]

    # The second turn resends the first: its prompt starts with tokens the cache holds.
    _set(drv, "message-input", "and then?" + Keys.ENTER)
    second = _reply(drv, 1)
    figures = second.find_element("css selector", ".figures").text
    cached, prompt = figures.split("cached prompt tokens ")[1].split(" ")[0].split("/")
    assert 0 < int(cached) < int(prompt), figures
    turn2 = [
        *turn1,
        {"role": "assistant", "content": shown},
        {"role": "user", "content": "and then?"},
    ]
    text = second.find_element("css selector", ".content").get_property("textContent")
    assert text == _api_reply(server, turn2)


@pytest.mark.browser
def test_the_json_schema_toggle_constrains_the_reply(server, browser):
    from selenium.webdriver.common.keys import Keys

    drv = browser
    drv.get(f"{server.url}/")
    _set(drv, "api-key", KEY + Keys.TAB)
    drv.find_element("id", "json-mode").click()
    schema = {"enum": ["yes", "no"]}
    _set(drv, "json-schema", json.dumps(schema))
    _set(drv, "message-input", "yes or no?" + Keys.ENTER)
    reply = _reply(drv, 0)
    assert reply.get_attribute("data-state") == "done", reply.text
    text = reply.find_element("css selector", ".content").get_property("textContent")
    assert json.loads(text) in ("yes", "no")
    # A schema that is not JSON is refused on the page, before anything is sent.
    _set(drv, "json-schema", "{not json")
    _set(drv, "message-input", "again" + Keys.ENTER)
    status = drv.find_element("id", "status").text
    assert "not valid JSON" in status
    assert len(drv.find_elements("css selector", ".msg.assistant")) == 1
