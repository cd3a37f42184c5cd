"""The playground at ``/`` in a real browser: Debian's headless Chromium, driven by Selenium.

Skipped, saying why, where no Chromium or chromedriver is installed; ``.ci/run`` installs them.
Screenshots go to ``$VLMSERVE_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from server_utils import start_server

from vlmserve.config import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "assets" / "example.png"
CAPTION = "A red circle, a blue triangle and a yellow star."
BROWSER, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (BROWSER and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                                                   "(apt-get install chromium chromium-driver)")
ARTIFACTS = Path(os.environ.get("VLMSERVE_ARTIFACTS", ROOT / "test-artifacts"))


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def _wait(predicate, timeout: float = 60, what: str = "the page"):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _set(browser, element_id: str, value: str) -> None:  # noqa: ANN001
    browser.execute_script("document.getElementById(arguments[0]).value = arguments[1]", element_id, value)


def _ask(browser, text: str) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()


def _answer(browser) -> str:  # noqa: ANN001
    return browser.execute_script(
        "const a = document.querySelectorAll('#chat li.assistant .text'); return a.length ? a[a.length-1].textContent : ''")


def test_caption_an_uploaded_image(browser, demo_server):
    from selenium.webdriver.common.by import By

    browser.get(demo_server.url + "/")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
    assert browser.find_element(By.ID, "model").get_attribute("value") == DEFAULT_MODEL_NAME
    browser.find_element(By.ID, "images").send_keys(str(EXAMPLE))
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#thumbs img"), what="the thumbnail")
    _set(browser, "temperature", "0")
    _ask(browser, "Describe this image.")
    _wait(lambda: browser.find_element(By.ID, "usage").text, what="the usage line")
    assert _answer(browser) == CAPTION
    usage = browser.find_element(By.ID, "usage").text
    assert re.search(r"prompt \d+ tokens, completion \d+ tokens, time to first token \d+ ms", usage), usage
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))


def test_the_demo_tool_call_is_shown(browser, demo_server):
    from selenium.webdriver.common.by import By

    browser.get(demo_server.url + "/")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
    browser.find_element(By.ID, "weather").click()
    _set(browser, "temperature", "0")
    _ask(browser, "What's the weather in Tokyo in celsius?")
    call = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#chat .tool-call"), what="the tool call")[0].text
    assert call.startswith("tool call: get_weather(") and '"Tokyo"' in call
    result = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#chat .tool-result"), what="the tool result")[0].text
    weather = json.loads(result.removeprefix("tool result (made up by the playground): "))
    assert weather["location"] == "Tokyo" and weather["unit"] == "celsius"
    # the model's answer to the result, in the next bubble, once the request has ended
    _wait(lambda: browser.find_element(By.ID, "send").is_enabled() and len(browser.find_elements(
        By.CSS_SELECTOR, "#chat .assistant")) == 2, what="the answer after the result")
    answer = browser.find_elements(By.CSS_SELECTOR, "#chat .assistant .text")[-1].text
    assert answer == f"It is {weather['temperature']} degrees in Tokyo.", answer


def test_stop_aborts_the_request_and_frees_the_slot(browser, tmp_path):
    """A micro model built never to emit EOS writes until max_tokens: Stop ends it mid-stream."""
    from selenium.webdriver.common.by import By

    from vlmserve.testing import build_model

    server = start_server(["--model", str(build_model("gemma4", "micro", ignore_eos=True))], tmp_path / "server.log")
    try:
        browser.get(server.url + "/")
        _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
        _set(browser, "max-tokens", "20000")
        _set(browser, "temperature", "0")
        _ask(browser, "Tell me everything.")
        _wait(lambda: len(_answer(browser)) > 20, what="streamed text")
        running = lambda: float(re.search(r"^vlmserve_running_requests\{.*\} (\S+)$",  # noqa: E731
                                          httpx.get(server.url + "/metrics").text, re.M).group(1))
        _wait(lambda: running() == 1, timeout=10, what="the request in the batch")
        browser.find_element(By.ID, "stop").click()
        _wait(lambda: _answer(browser).endswith("[stopped]"), what="the stopped reply")
        _wait(lambda: running() == 0, timeout=30, what="the slot to be freed")
        assert browser.find_element(By.ID, "send").is_enabled()
    finally:
        server.stop()


def test_a_wrong_api_key_then_the_right_one(browser, tmp_path):
    from selenium.webdriver.common.by import By

    server = start_server(["--api-key", "right-key"], tmp_path / "server.log")
    try:
        browser.get(server.url + "/")
        form = _wait(lambda: [f for f in browser.find_elements(By.ID, "key-form") if f.is_displayed()], what="the key form")
        browser.find_element(By.ID, "api-key").send_keys("wrong-key")
        form[0].find_element(By.TAG_NAME, "button").click()
        _wait(lambda: browser.find_element(By.ID, "key-error").text, what="the refusal")
        key = browser.find_element(By.ID, "api-key")
        key.clear()
        key.send_keys("right-key")
        form[0].find_element(By.TAG_NAME, "button").click()
        _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
        assert not browser.find_element(By.ID, "key-form").is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('vlmserve-api-key')") == "right-key"
    finally:
        server.stop()


def test_a_model_dir_lists_every_model_and_loads_the_one_chosen(browser, tmp_path):
    """``--model-dir``: every folder is listed with its status, one that is not a model disabled with its
    reason; choosing one loads it (``POST /v1/models/load``), the others stay unloaded, and it answers."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from vlmserve.testing import build_model

    folder = tmp_path / "models"
    for family in ("gemma4", "qwen2_5_vl"):  # copies: a link out of the folder is refused
        shutil.copytree(build_model(family, "micro"), folder / family)
    (folder / "notes").mkdir()
    (folder / "notes" / "README.md").write_text("not a model")
    server = start_server(["--model-dir", str(folder)], tmp_path / "server.log")
    options = lambda: {o.get_attribute("value"): o for o in browser.find_elements(By.CSS_SELECTOR, "#model option")}  # noqa: E731
    listed = lambda: {m["id"]: m["status"] for m in httpx.get(server.url + "/v1/models").json()["data"]}  # noqa: E731
    try:
        browser.get(server.url + "/")
        _wait(lambda: browser.find_element(By.ID, "status").text, what="the model list")
        assert [o.text for o in options().values()] == ["gemma4 (available)", "notes (unavailable)",
                                                        "qwen2_5_vl (available)"]
        assert browser.find_element(By.ID, "status").text == "2 available, 1 unavailable"
        assert not options()["notes"].is_enabled() and "no config.json" in options()["notes"].get_attribute("title")
        assert options()["gemma4"].is_enabled() and options()["qwen2_5_vl"].is_enabled()

        Select(browser.find_element(By.ID, "model")).select_by_value("qwen2_5_vl")
        _wait(lambda: re.fullmatch(r"qwen2_5_vl loaded in \d+\.\d s", browser.find_element(By.ID, "status").text),
              what="the load")
        assert listed() == {"gemma4": "available", "notes": "unavailable", "qwen2_5_vl": "loaded"}
        _wait(lambda: options()["qwen2_5_vl"].text == "qwen2_5_vl (loaded)", timeout=10, what="the new status")

        _set(browser, "temperature", "0")
        _set(browser, "max-tokens", "8")
        _ask(browser, "Hello?")
        usage = _wait(lambda: browser.find_element(By.ID, "usage").text, what="the usage line")
        assert re.search(r"completion [1-8] tokens", usage), usage
        assert not browser.find_elements(By.CSS_SELECTOR, "#chat li.error"), _answer(browser)
        assert listed()["gemma4"] == "available"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "playground-model-dir.png"))
    finally:
        server.stop()


def test_nothing_is_fetched_from_elsewhere(demo_server):
    page = httpx.get(demo_server.url + "/").text
    assert "http://" not in page and "https://" not in page
    for name in ("playground.js", "playground.css"):
        asset = httpx.get(f"{demo_server.url}/static/{name}")
        assert asset.status_code == 200 and not re.search(r"https?://", asset.text), name
    assert httpx.get(demo_server.url + "/docs").status_code == 404  # FastAPI's CDN-backed pages are off
    assert httpx.get(demo_server.url + "/openapi.json").status_code == 200
