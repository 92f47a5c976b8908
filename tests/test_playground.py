"""The playground page at `/`, in a real headless browser (Debian's chromium driven by selenium through
chromium-driver) against a live server: it loads everything from the server, streams an answer with
its tokens marked by source, compares it with plain decoding, reads /metrics, asks for the API key
when one is set, and fits a narrow screen. Skips where no browser is installed (`.ci/run` installs one)."""

from __future__ import annotations

import json
import os
import shutil
from urllib.parse import urlparse

import httpx
import pytest
import torch
from conftest import serve_in_thread, tiny_chat_target, tiny_drafter

from dominospec.engine import Engine

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and DRIVER), reason="no chromium + chromedriver (apt-get install chromium chromium-driver)"
    ),
]
QUESTION = "abcabc abcabc abc"
KEY = "sesame-123"
BUNDLED_QUESTION = (
    "Rewrite in the past tense: The cat sits on the mat. It watches the birds in the garden and waits for the sun."
)


def open_browser(profile, width: int = 1200, height: int = 900):
    """Headless chromium with a fresh profile and nothing of its own on the network; logs every request."""
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def requested_urls(driver) -> list[str]:
    """Every URL the page asked for so far (Chrome's network log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def wait(driver, condition, timeout: float = 60):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d))


@pytest.fixture(scope="module")
def target():
    return tiny_chat_target(dtype=torch.float64)


@pytest.fixture
def browser(tmp_path):
    driver = open_browser(tmp_path / "profile")
    yield driver
    driver.quit()


def test_page_streams_marked_tokens_compares_with_plain_and_stays_on_loopback(target, browser):
    engine = Engine(target, tiny_drafter(target), lookup=True, policy="fixed", max_batch=2)
    with serve_in_thread(engine, target) as base:
        expected = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 40, "temperature": 0},
        ).json()["choices"][0]["message"]["content"]
        requested_urls(browser)  # drained: what the browser loaded before the page is not the page's
        browser.get(base + "/")
        send = browser.find_element(By.ID, "send")
        wait(browser, lambda d: send.is_enabled())
        assert browser.find_element(By.ID, "model").text == target.name
        assert not browser.find_element(By.ID, "key-form").is_displayed()  # no key on this server
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("40")
        browser.find_element(By.ID, "prompt").send_keys(QUESTION)
        send.click()
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".column.done"))

        column = browser.find_element(By.CSS_SELECTOR, ".column.done")
        tokens = column.find_elements(By.CSS_SELECTOR, ".text .tok")
        sources = {t.get_attribute("class").split("src-")[-1] for t in tokens}
        assert "target" in sources and sources & {"drafter", "lookup"}  # drafts were accepted and shown
        assert "".join(t.get_attribute("textContent") for t in tokens) == expected
        stats = column.find_element(By.CLASS_NAME, "stats").text
        assert "tok/s" in stats and "tau" in stats and "drafts verified per cycle" in stats
        assert "tau -" not in stats

        browser.find_element(By.ID, "compare").click()
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".column.done")) == 2)
        plain = browser.find_elements(By.CSS_SELECTOR, ".column.done")[1]
        plain_tokens = plain.find_elements(By.CSS_SELECTOR, ".text .tok")
        assert "".join(t.get_attribute("textContent") for t in plain_tokens) == expected  # lossless, greedy
        assert {t.get_attribute("class") for t in plain_tokens} == {"tok src-target"}
        comparison = wait(browser, lambda d: d.find_elements(By.CLASS_NAME, "comparison"))[0].text
        assert "speculative" in comparison and "plain" in comparison and comparison.endswith("x")

        # the server panel, from /metrics: acceptance by position once cycles ran
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#acceptance .bar"), timeout=10)
        assert browser.find_element(By.ID, "slots").text == "2"
        # the verify budget over the last minute: from two scrapes with cycles between them
        wait(browser, lambda d: d.find_element(By.ID, "budget").text != "-", timeout=10)
        assert float(browser.find_element(By.ID, "budget").text) > 0

        urls = requested_urls(browser)
    assert any(u.endswith("/playground/playground.js") for u in urls)
    assert any(u.endswith("/v1/chat/completions") for u in urls) and any(u.endswith("/metrics") for u in urls)
    # chrome://, data: and the like never leave the machine; every network request must go to the server
    network = [u for u in urls if urlparse(u).scheme in ("http", "https", "ws", "wss", "ftp")]
    outside = [u for u in network if urlparse(u).hostname != "127.0.0.1"]
    assert not outside, f"the page reached beyond the server: {outside}"


def test_page_asks_for_the_key_when_the_server_has_one(target, browser):
    with serve_in_thread(Engine(target, max_batch=1), target, api_key=KEY) as base:
        assert httpx.get(f"{base}/").status_code == 200  # the page itself holds nothing secret
        assert httpx.get(f"{base}/v1/models").status_code == 401  # what it calls does
        browser.get(base + "/")
        form = browser.find_element(By.ID, "key-form")
        wait(browser, lambda d: form.is_displayed())
        assert not browser.find_element(By.ID, "send").is_enabled()
        browser.find_element(By.ID, "key").send_keys("wrong")
        form.find_element(By.TAG_NAME, "button").click()
        wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-error").text)
        browser.find_element(By.ID, "key").clear()
        browser.find_element(By.ID, "key").send_keys(KEY)
        form.find_element(By.TAG_NAME, "button").click()
        wait(browser, lambda d: not form.is_displayed() and d.find_element(By.ID, "send").is_enabled())
        browser.find_element(By.ID, "prompt").send_keys("hello")
        browser.find_element(By.ID, "send").click()
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".column.done"))
        assert browser.find_elements(By.CSS_SELECTOR, ".column.done .tok")


def test_page_fits_a_narrow_screen(target, tmp_path):
    driver = open_browser(tmp_path / "profile", width=380, height=800)
    try:
        with serve_in_thread(Engine(target, max_batch=1), target) as base:
            driver.get(base + "/")
            wait(driver, lambda d: d.find_element(By.ID, "send").is_enabled())
            overflow = driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"the page is {overflow} px wider than a 380 px screen"
            chat = driver.find_element(By.ID, "chat").rect
            panel = driver.find_element(By.ID, "server").rect
            assert panel["y"] >= chat["y"] + chat["height"]  # the panel moves below the chat
    finally:
        driver.quit()


def test_unknown_playground_file_is_a_404_with_an_openai_body(target):
    with serve_in_thread(Engine(target, max_batch=1), target) as base:
        r = httpx.get(f"{base}/playground/../app.py")
        assert r.status_code == 404
        r = httpx.get(f"{base}/playground/secret.txt")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        page = httpx.get(f"{base}/")
        assert "default-src 'none'" in page.headers["content-security-policy"]


@pytest.mark.integration
def test_bundled_model_through_the_page(smollm, tmp_path):
    """SmolLM2 with its shipped drafter and prompt lookup: real byte-level BPE text through the marks, the
    plain answer equal to the speculative one. With $DOMINOSPEC_PLAYGROUND_SCREENSHOT=PATH the page is
    saved there (docs/img/playground.png is made so)."""
    from dominospec import Drafter
    from dominospec.drafter import shipped_drafter_dir

    drafter = Drafter.from_pretrained(shipped_drafter_dir("smollm2-135m"), target=smollm)
    engine = Engine(smollm, drafter, lookup=True, policy="fixed", max_batch=2)
    driver = open_browser(tmp_path / "profile", width=1280, height=900)
    try:
        with serve_in_thread(engine, smollm) as base:
            driver.get(base + "/")
            wait(driver, lambda d: d.find_element(By.ID, "send").is_enabled())
            driver.find_element(By.ID, "max-tokens").clear()
            driver.find_element(By.ID, "max-tokens").send_keys("60")
            driver.find_element(By.ID, "prompt").send_keys(BUNDLED_QUESTION)
            driver.find_element(By.ID, "send").click()
            wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".column.done"), timeout=300)
            driver.find_element(By.ID, "compare").click()
            wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".column.done")) == 2, timeout=300)
            wait(driver, lambda d: d.find_element(By.ID, "budget").text != "-", timeout=10)
            spec, plain = (
                [t.get_attribute("textContent") for t in c.find_elements(By.CSS_SELECTOR, ".tok")]
                for c in driver.find_elements(By.CSS_SELECTOR, ".column.done")
            )
            assert "".join(spec) == "".join(plain) and len(spec) > 10
            marks = {t.get_attribute("class") for t in driver.find_elements(By.CSS_SELECTOR, ".column.done .tok")}
            assert "tok src-target" in marks and marks & {"tok src-drafter", "tok src-lookup"}
            shot = os.environ.get("DOMINOSPEC_PLAYGROUND_SCREENSHOT")
            if shot:
                driver.save_screenshot(shot)
    finally:
        driver.quit()
