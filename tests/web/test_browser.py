"""The web page in a real browser: headless Chromium (Debian's package) driven by Selenium.

An operator's first hour: `recap serve` on a config with no admin key, the key read from
the file its start-up line names, the list, a conversation, compact now, a rollback and
its mark on the discarded version, and that untrusted text stays text. Selenium is given
the distribution's chromedriver and chromium explicitly, so Selenium Manager never
downloads a browser. Where they are missing the test skips, except under CI (`CI=true`),
where `.ci/run` installs them and a missing browser is a failure.

Set RECAP_WEB_SCREENSHOT=path to keep the conversation page's screenshot there, and its
versions table after the rollback beside it as <name>-versions.png (docs/web-page.png and
docs/web-page-versions.png are made that way).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.fakes import Reply
from tests.faults import history
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
    first_start_site: Site, browser: WebDriver, tmp_path: Path
) -> None:
    """As an operator's first hour: `recap serve` with no admin_keys, the key read from the
    file its start-up line named, then the list, a conversation, compact, roll back."""
    site = first_start_site
    browser.get(site.url + "/recap/")
    assert browser.current_url.endswith("/recap/login")  # no session: to the form
    assert "start-up line" in browser.find_element(By.CSS_SELECTOR, "form.login").text

    log_in(browser, "not-a-key")
    assert "not an operator key" in browser.find_element(By.CSS_SELECTOR, ".error").text
    assert browser.get_cookie("recap_session") is None

    assert site.key_file is not None
    key = site.key_file.read_text().strip()  # what `cat data/recap.db-admin-key` shows
    log_in(browser, key)
    assert browser.current_url.endswith("/recap/")
    cookie = browser.get_cookie("recap_session")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert key not in cookie["value"]
    listed = sorted(a.text for a in browser.find_elements(By.CSS_SELECTOR, "td.key a"))
    assert listed == sorted([CONV_A, CONV_B])  # an admin key: every tenant

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
    rows = browser.find_elements(By.CSS_SELECTOR, "#versions tr")
    assert "v1 (current)" in rows[1].text
    assert "v2 (rolled back)" in rows[2].text and "rolled-back" in rows[2].get_attribute("class")
    choices = {
        o.get_attribute("value"): o.text
        for o in Select(browser.find_element(By.ID, "version")).options
    }
    assert "rolled back" in choices["2"] and "rolled back" not in choices["1"]
    assert "rollback" in browser.find_element(By.ID, "timeline").text
    detail = site.detail("a", CONV_A)
    assert detail["current_version"] == 1
    assert [v["rolled_back"] for v in detail["versions"]] == [False, True]  # as the JSON says
    shot = Path(os.environ.get("RECAP_WEB_SCREENSHOT") or tmp_path / "web-page.png")
    table = shot.with_name(shot.stem + "-versions.png")  # docs/web-page-versions.png
    assert browser.find_element(By.ID, "versions").screenshot(str(table))
    assert table.read_bytes().startswith(PNG)

    # The first request, chosen from the chart: it went upstream compacted too.
    follow(browser, browser.find_elements(By.CSS_SELECTOR, "svg.chart a")[0])
    assert "What the model saw" in browser.find_element(By.ID, "model-saw").text
    assert no_alert(browser)

    browser.get(f"{site.url}/recap/conversation?tenant=a&key={quote(CONV_A)}&from=1&to=2")
    assert browser.find_elements(By.CSS_SELECTOR, "pre.diff .add")
    browser.execute_script("window.scrollTo(0, 0)")
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes().startswith(PNG)

    # A drop: the summarizer down and a history over the window. The timeline's row is red
    # `dropped`, and the messages the last resort dropped are tagged in what the client sent.
    site.upstream.summarize = lambda body: Reply(status=503, error={"error": {"message": "x"}})
    site.chat("b", "dropping", history(turns=70, marker="drop"))
    site.wait_archived("b", "dropping", 1)
    browser.get(f"{site.url}/recap/conversation?tenant=b&key=dropping")
    row = browser.find_element(By.CSS_SELECTOR, "#timeline tr.dropped")
    assert "fit_to_window" in row.text and "dropped" in row.text
    red = row.find_element(By.CSS_SELECTOR, "td.outcome").value_of_css_property("color")
    assert red in ("rgba(207, 34, 46, 1)", "rgb(207, 34, 46)"), red
    sent = browser.find_element(By.ID, "client-sent")
    assert sent.find_elements(By.CSS_SELECTOR, ".msg.dropped .tag.dropped")

    # A tenant's proxy key sees its own tenant only, even given another's exact URL.
    follow(browser, browser.find_element(By.CSS_SELECTOR, "header form button"))  # Log out
    log_in(browser, KEYS["a"])
    assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "td.key a")] == [CONV_A]
    assert CONV_B not in browser.page_source
    browser.get(f"{site.url}/recap/conversation?tenant=b&key={CONV_B}")
    assert "Error 404" in browser.find_element(By.TAG_NAME, "h1").text
