"""The web page in a real browser: headless Chromium (Debian's package) driven by Selenium.

Login, the list, a conversation, compact now, a rollback, and that untrusted text
stays text. Selenium is given the distribution's chromedriver and chromium
explicitly, so Selenium Manager never downloads a browser. Where they are missing
the test skips, except under CI (`CI=true`), where `.ci/run` installs them and a
missing browser is a failure.

Set RECAP_WEB_SCREENSHOT=path to keep the conversation page's screenshot there
(docs/web-page.png is made that way).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.web.conftest import CONV_A, CONV_B, KEYS, SCRIPT, Site

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
PNG = b"\x89PNG\r\n\x1a\n"

try:
    from selenium import webdriver
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver, WebElement
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # pragma: no cover - the test extra installs it
    webdriver = None  # type: ignore[assignment]


def _missing() -> str | None:
    if webdriver is None:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).exists() or shutil.which(path)):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    missing = _missing()
    if missing:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI must run the browser test: {missing}")
        pytest.skip(missing)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1500",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


def log_in(driver: WebDriver, key: str) -> None:
    field = driver.find_element(By.NAME, "key")
    field.clear()
    field.send_keys(key)
    follow(driver, driver.find_element(By.CSS_SELECTOR, "form.login button"))


def follow(driver: WebDriver, element: WebElement) -> None:
    """Click what leads to a new page and wait until the old one is gone (no race with
    the navigation: reading the page right after a click may still see the old one)."""
    element.click()
    WebDriverWait(driver, 30).until(expected_conditions.staleness_of(element))


def no_alert(driver: WebDriver) -> bool:
    try:
        driver.switch_to.alert  # noqa: B018  # raises when no script opened one
    except NoAlertPresentException:
        return True
    return False


def test_login_list_conversation_compact_rollback(
    site: Site, browser: WebDriver, tmp_path: Path
) -> None:
    browser.get(site.url + "/recap/")
    assert browser.current_url.endswith("/recap/login")  # no session: to the form

    log_in(browser, "not-a-key")
    assert "not an operator key" in browser.find_element(By.CSS_SELECTOR, ".error").text
    assert browser.get_cookie("recap_session") is None

    log_in(browser, KEYS["a"])
    assert browser.current_url.endswith("/recap/")
    cookie = browser.get_cookie("recap_session")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert KEYS["a"] not in cookie["value"]
    listed = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "td.key a")]
    assert listed == [CONV_A]  # tenant a's key: not tenant b's conversation
    assert CONV_B not in browser.page_source

    follow(browser, browser.find_element(By.LINK_TEXT, CONV_A))
    assert browser.find_element(By.TAG_NAME, "h1").text == CONV_A
    assert browser.find_elements(By.CSS_SELECTOR, "svg.chart polyline")
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.chart a")) == 6  # six requests
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline tr.ok")
    # The client's own words, shown as text and never run.
    assert SCRIPT in browser.find_element(By.ID, "client-sent").text
    assert SCRIPT in browser.find_element(By.ID, "summary").text
    assert no_alert(browser)
    saw = browser.find_element(By.ID, "model-saw")
    assert saw.find_elements(By.CSS_SELECTOR, ".msg.synthetic")  # the summary stands in

    follow(browser, browser.find_element(By.ID, "compact"))
    assert "Compacted now" in browser.find_element(By.ID, "notice").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#versions tr")
    assert [r.text.split()[0] for r in rows[1:]] == ["v1", "v2"]
    assert "v2 (current)" in rows[2].text
    assert site.detail("a", CONV_A)["current_version"] == 2

    Select(browser.find_element(By.ID, "version")).select_by_value("1")
    follow(browser, browser.find_element(By.ID, "rollback"))
    assert "Rolled back" in browser.find_element(By.ID, "notice").text
    assert "v1 (current)" in browser.find_element(By.ID, "versions").text
    assert "rollback" in browser.find_element(By.ID, "timeline").text
    assert site.detail("a", CONV_A)["current_version"] == 1

    # The first request, chosen from the chart: it went upstream compacted too.
    follow(browser, browser.find_elements(By.CSS_SELECTOR, "svg.chart a")[0])
    assert "What the model saw" in browser.find_element(By.ID, "model-saw").text
    assert no_alert(browser)

    browser.get(f"{site.url}/recap/conversation?tenant=a&key={quote(CONV_A)}&from=1&to=2")
    assert browser.find_elements(By.CSS_SELECTOR, "pre.diff .add")
    browser.execute_script("window.scrollTo(0, 0)")
    shot = Path(os.environ.get("RECAP_WEB_SCREENSHOT") or tmp_path / "web-page.png")
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes().startswith(PNG)

    # Another tenant's conversation is not found, even by its exact URL.
    browser.get(f"{site.url}/recap/conversation?tenant=b&key={CONV_B}")
    assert "Error 404" in browser.find_element(By.TAG_NAME, "h1").text
