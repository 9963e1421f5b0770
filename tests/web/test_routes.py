"""The web page's routes through a real uvicorn, with httpx as the browser.

Login and its cookie, keys never in URLs or cookies, tenant isolation, CSRF and
Origin checks on every action, and escaping of untrusted conversation text.
"""

from __future__ import annotations

import html
import re
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import pytest

from proxy.config import parse_config
from tests.fakes import Reply
from tests.faults import WINDOW, history
from tests.servers import recap_app, serve
from tests.web.conftest import ADMIN, CONV_A, CONV_B, KEYS, SCRIPT, Site, bearer

CSRF = re.compile(r'name="csrf" value="([^"]*)"')
REQUEST = re.compile(r"request=(\d+)#saw")


def logged_in(site: Site, key: str) -> httpx.Client:
    client = httpx.Client(base_url=site.url)
    r = client.post("/recap/login", data={"key": key}, headers={"origin": site.url})
    assert r.status_code == 303, r.text
    assert r.headers["location"] == "/recap/"
    return client


def page(client: httpx.Client, tenant: str, conv: str, **params: str) -> httpx.Response:
    return client.get("/recap/conversation", params={"tenant": tenant, "key": conv, **params})


def csrf_of(client: httpx.Client, tenant: str, conv: str) -> str:
    r = page(client, tenant, conv)
    assert r.status_code == 200, r.text
    tokens: set[str] = set(CSRF.findall(r.text))
    assert len(tokens) == 1 and tokens != {""}
    return tokens.pop()


def test_login_sets_a_strict_httponly_cookie_that_holds_no_key(shared_site: Site) -> None:
    r = httpx.post(
        shared_site.url + "/recap/login",
        data={"key": KEYS["a"]},
        headers={"origin": shared_site.url},
    )
    assert r.status_code == 303
    header = r.headers["set-cookie"]
    attrs = {a.strip().split("=")[0].lower() for a in header.split(";")}
    assert {"httponly", "samesite", "path", "max-age"} <= attrs
    assert "samesite=strict" in header.lower() and "path=/recap" in header.lower()
    assert "secure" not in attrs  # plain http here; https sets it
    value = SimpleCookie(header)["recap_session"].value
    assert KEYS["a"] not in value and value.startswith("v1.")
    r = httpx.get(shared_site.url + "/recap/", cookies={"recap_session": value})
    assert r.status_code == 200
    assert "tenant a" in r.text


def test_logging_in_again_replaces_the_session(shared_site: Site) -> None:
    client = logged_in(shared_site, KEYS["a"])
    r = client.post("/recap/login", data={"key": KEYS["b"]}, headers={"origin": shared_site.url})
    assert r.status_code == 303
    assert "tenant b" in client.get("/recap/").text
    # From another site, even the login form is refused.
    r = client.post("/recap/login", data={"key": ADMIN}, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "tenant b" in client.get("/recap/").text


def test_https_behind_a_proxy_marks_the_cookie_secure(shared_site: Site) -> None:
    r = httpx.post(
        shared_site.url + "/recap/login",
        data={"key": KEYS["a"]},
        headers={"origin": shared_site.url, "x-forwarded-proto": "https"},
    )
    assert r.status_code == 303
    assert "secure" in r.headers["set-cookie"].lower()


@pytest.mark.parametrize("key", ["wrong-key", "", KEYS["a"] + "x"])
def test_a_wrong_key_gets_401_and_the_login_form_again(shared_site: Site, key: str) -> None:
    r = httpx.post(shared_site.url + "/recap/login", data={"key": key})
    assert r.status_code == 401
    assert 'name="key"' in r.text and "not an operator key" in r.text
    assert "recap_session=v1" not in r.headers.get("set-cookie", "")


def test_no_session_is_sent_to_the_login_form(shared_site: Site) -> None:
    for path in ("/recap/", f"/recap/conversation?tenant=a&key={CONV_A}"):
        r = httpx.get(shared_site.url + path)
        assert r.status_code == 303 and r.headers["location"] == "/recap/login"
    assert httpx.get(shared_site.url + "/recap").headers["location"] == "/recap/"


def test_forged_or_foreign_cookies_are_no_session(shared_site: Site) -> None:
    client = logged_in(shared_site, KEYS["a"])
    good = client.cookies["recap_session"]
    version, body, signature = good.split(".")
    forged = [
        f"{version}.{body}.{signature[:-2]}AA",  # signature changed
        f"{version}.{body[:-2]}AA.{signature}",  # payload changed
        "v1.e30.x",
        "garbage",
        "x" * 5000,
    ]
    for value in forged:
        r = httpx.get(shared_site.url + "/recap/", cookies={"recap_session": value})
        assert r.status_code == 303, value


def test_bearer_keys_work_for_scripts_and_wrong_ones_are_401(shared_site: Site) -> None:
    r = httpx.get(shared_site.url + "/recap/", headers=bearer(KEYS["b"]))
    assert r.status_code == 200 and CONV_B in r.text and "conv-a" not in r.text
    r = httpx.get(shared_site.url + "/recap/", headers=bearer("nope"))
    assert r.status_code == 401 and 'name="key"' in r.text


def test_a_key_in_the_url_logs_no_one_in(shared_site: Site) -> None:
    r = httpx.get(shared_site.url + "/recap/login", params={"key": KEYS["a"]})
    assert r.status_code == 200 and "set-cookie" not in r.headers
    r = httpx.get(shared_site.url + "/recap/", params={"key": KEYS["a"]})
    assert r.status_code == 303
    # Nor does the page ever put one into a link or form.
    client = logged_in(shared_site, KEYS["a"])
    assert KEYS["a"] not in page(client, "a", CONV_A).text


def test_tenant_keys_see_only_their_tenant(shared_site: Site) -> None:
    a = logged_in(shared_site, KEYS["a"])
    listing = a.get("/recap/")
    assert html.escape(CONV_A) in listing.text and CONV_B not in listing.text
    assert a.get("/recap/", params={"tenant": "b"}).status_code == 404
    assert page(a, "b", CONV_B).status_code == 404
    # Without naming a tenant, the key's own: b's conversation is not in a.
    assert page(a, "", CONV_B).status_code == 404
    assert page(a, "a", CONV_A).status_code == 200


def test_admin_keys_see_every_tenant(shared_site: Site) -> None:
    admin = logged_in(shared_site, ADMIN)
    listing = admin.get("/recap/").text
    assert html.escape(CONV_A) in listing and CONV_B in listing
    assert "Tenant a" in listing and "Tenant b" in listing
    assert page(admin, "b", CONV_B).status_code == 200
    # Two tenants: an admin must say which one holds the conversation.
    assert page(admin, "", CONV_B).status_code == 400


def test_untrusted_text_is_escaped_everywhere(shared_site: Site) -> None:
    admin = logged_in(shared_site, ADMIN)
    escaped = html.escape(SCRIPT)
    for text in (
        page(admin, "a", CONV_A).text,
        page(admin, "a", CONV_A, request="1").text,
        page(admin, "a", CONV_A, **{"from": "1", "to": "1"}).text,
        admin.get("/recap/").text,
    ):
        assert "<script" not in text.lower()
        assert "<u>" not in text  # the conversation key's own markup
    conversation = page(admin, "a", CONV_A).text
    assert escaped in conversation
    assert html.escape(CONV_A) in conversation
    headers = page(admin, "a", CONV_A).headers
    assert "default-src 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"


def test_what_the_model_saw_for_a_chosen_request(shared_site: Site) -> None:
    admin = logged_in(shared_site, ADMIN)
    # The chart links each request: the first is the one that compacted.
    first = REQUEST.findall(page(admin, "a", CONV_A).text)[0]
    text = page(admin, "a", CONV_A, request=first).text
    assert 'class="chosen"' in text
    saw, sent = text.split('id="model-saw"')[1].split('id="client-sent"')
    assert "synthetic" in saw  # the summary the model saw instead of old messages
    assert "folded" in sent  # the client's messages it stands for
    # Each request names the summary it was sent with, made then or applied from the store.
    requests = text.split('id="requests"')[1].split("</table>")[0]
    assert requests.count("session (summary v1)") >= 2, requests
    assert "No request 999" in page(admin, "a", CONV_A, request="999").text


def test_actions_refuse_cross_site_requests(site: Site) -> None:
    client = logged_in(site, KEYS["a"])
    token = csrf_of(client, "a", CONV_A)
    form = {"tenant": "a", "key": CONV_A, "version": "", "csrf": token}
    refused = [
        ({**form, "csrf": ""}, {}),
        ({**form, "csrf": token[:-1] + ("A" if token[-1] != "A" else "B")}, {}),
        (form, {"origin": "http://evil.example"}),
        (form, {"origin": "null"}),
        (form, {"sec-fetch-site": "cross-site"}),
    ]
    for data, headers in refused:
        r = client.post("/recap/rollback", data=data, headers=headers)
        assert r.status_code == 403, (data, headers)
        assert site.detail("a", CONV_A)["current_version"] == 1
    # Another session's token is not this session's.
    other = logged_in(site, KEYS["a"])
    r = client.post("/recap/rollback", data={**form, "csrf": csrf_of(other, "a", CONV_A)})
    assert r.status_code == 403
    assert client.post("/recap/logout", data={}).status_code == 403

    r = client.post("/recap/rollback", data=form, headers={"origin": site.url})
    assert r.status_code == 303
    assert site.detail("a", CONV_A)["current_version"] is None
    assert "Rolled back" in client.get(r.headers["location"]).text


def test_actions_on_another_tenant_are_not_found(site: Site) -> None:
    client = logged_in(site, KEYS["b"])
    token = csrf_of(client, "b", CONV_B)
    r = client.post(
        "/recap/rollback", data={"tenant": "a", "key": CONV_A, "version": "", "csrf": token}
    )
    assert r.status_code == 404
    r = client.post("/recap/compact", data={"tenant": "", "key": CONV_A, "csrf": token})
    assert r.status_code == 404
    assert site.detail("a", CONV_A)["current_version"] == 1


def test_compact_by_script_with_a_bearer_key(site: Site) -> None:
    before = site.detail("a", CONV_A)
    r = httpx.post(
        site.url + "/recap/compact", data={"tenant": "a", "key": CONV_A}, headers=bearer(KEYS["a"])
    )
    assert r.status_code == 303, r.text
    after = site.detail("a", CONV_A)
    assert after["current_version"] == 2
    # One click, one compaction: one version, and the count moves by one.
    assert after["compact_count"] == before["compact_count"] + 1
    assert after["compactions_made"] == before["compactions_made"] + 1
    # Nothing new since: the JSON route's answer (409), as a page.
    r = httpx.post(
        site.url + "/recap/compact", data={"tenant": "a", "key": CONV_A}, headers=bearer(KEYS["a"])
    )
    assert r.status_code == 409 and "Nothing was compacted" in r.text
    r = httpx.post(
        site.url + "/recap/rollback",
        data={"tenant": "a", "key": CONV_A, "version": "7"},
        headers=bearer(KEYS["a"]),
    )
    assert r.status_code == 404 and "No summary version 7" in r.text


def test_logout_ends_the_session_in_the_browser(shared_site: Site) -> None:
    client = logged_in(shared_site, KEYS["a"])
    token = csrf_of(client, "a", CONV_A)
    r = client.post("/recap/logout", data={"csrf": token})
    assert r.status_code == 303 and r.headers["location"] == "/recap/login"
    assert "recap_session" not in client.cookies
    assert client.get("/recap/").status_code == 303


def test_logout_revokes_the_cookie_itself(shared_site: Site) -> None:
    """A copy of the cookie (another tab, a stolen one) is dead after logout too: the
    cookie is stateless, so on ce59ff6 it opened the page for its whole 12 hours."""
    client = logged_in(shared_site, KEYS["a"])
    copy = client.cookies["recap_session"]
    other = logged_in(shared_site, KEYS["a"])  # another session of the same key
    token = csrf_of(client, "a", CONV_A)
    assert client.post("/recap/logout", data={"csrf": token}).status_code == 303
    r = httpx.get(shared_site.url + "/recap/", cookies={"recap_session": copy})
    assert r.status_code == 303 and r.headers["location"] == "/recap/login"
    assert other.get("/recap/").status_code == 200  # only the session that logged out


@pytest.mark.parametrize("inspection_open", [True, False])
def test_the_open_tenant_needs_no_login_only_with_inspection_open(
    tmp_path: Path, inspection_open: bool
) -> None:
    config = parse_config(
        {
            "store": f"sqlite:///{tmp_path / 'recap.db'}",
            "inspection_open": inspection_open,
            "tenants": {"open": {}, "closed": {"api_keys": ["k"]}},
        },
        env={},
        base_dir=str(tmp_path),
    )
    with serve(recap_app(config)) as url:
        r = httpx.get(url + "/recap/")
        if inspection_open:
            assert r.status_code == 200 and "tenant open (open)" in r.text
            assert httpx.get(url + "/recap/", params={"tenant": "closed"}).status_code == 404
        else:
            assert r.status_code == 303 and r.headers["location"] == "/recap/login"
        # Logging in with no key is never a session, open tenant or not.
        assert httpx.post(url + "/recap/login", data={"key": ""}).status_code == 401


def test_rolled_back_versions_are_marked_in_the_table_and_the_roll_back_list(site: Site) -> None:
    key = bearer(KEYS["a"])
    form = {"tenant": "a", "key": CONV_A}
    assert httpx.post(site.url + "/recap/compact", data=form, headers=key).status_code == 303
    r = httpx.post(site.url + "/recap/rollback", data={**form, "version": "1"}, headers=key)
    assert r.status_code == 303
    assert [v["rolled_back"] for v in site.detail("a", CONV_A)["versions"]] == [False, True]
    text = httpx.get(
        site.url + "/recap/conversation", params={"tenant": "a", "key": CONV_A}, headers=key
    ).text
    table = text[text.index('<table id="versions">') :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table)[1:]
    assert "v1 (current)" in rows[0] and "rolled back" not in rows[0]
    assert "v2 (rolled back)" in rows[1]
    assert '<tr class="rolled-back">' in table
    chooser = text[text.index('<select id="version"') :]
    chooser = chooser[: chooser.index("</select>")]
    options = re.findall(r'<option value="(\d*)"[^>]*>([^<]*)</option>', chooser)
    listed = {value: label for value, label in options if value in ("1", "2")}
    assert "rolled back" not in listed["1"] and "(current)" in listed["1"]
    assert "rolled back" in listed["2"]


def test_the_login_page_says_which_keys_open_it(shared_site: Site) -> None:
    text = html.unescape(httpx.get(shared_site.url + "/recap/login").text)
    assert "admin_keys" in text
    assert "start-up line" in text  # where a first start names the key file it wrote


def test_a_wrong_operator_key_is_called_that_not_a_proxy_key(shared_site: Site) -> None:
    # Before: "Invalid proxy API key.", the chat route's words, for a mistyped admin key.
    wrong = bearer("admin-key-typo")
    r = httpx.get(shared_site.url + "/v1/recap/conversations", headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    message = r.json()["error"]["message"]
    assert "proxy API key" not in message and "admin key" in message
    r = httpx.get(shared_site.url + "/recap/", headers=wrong)
    assert r.status_code == 401 and "proxy API key" not in html.unescape(r.text)
    # The chat route keeps its own words.
    r = httpx.post(
        shared_site.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers=wrong,
    )
    assert r.status_code == 401 and r.json()["error"]["message"] == "Invalid proxy API key."


def test_a_drop_is_red_and_tagged_and_compactions_count_every_layer(site: Site) -> None:
    """The last resort's drop: a red `dropped` row in the timeline, not counted as saved or
    as a compaction, and the messages it dropped tagged `dropped` in "what the client sent"
    (they reached the model in no form), apart from those a summary folded."""
    admin = logged_in(site, ADMIN)
    before = site.detail("a", CONV_A)
    site.upstream.summarize = lambda body: Reply(status=503, error={"error": {"message": "down"}})
    site.chat("a", "dropping", history(turns=70, marker="drop"))
    site.wait_archived("a", "dropping", 1)
    detail = site.detail("a", "dropping")
    layers = [(c["layer"], c["outcome"]) for c in detail["compactions"]]
    assert ("fit_to_window", "dropped") in layers, layers
    assert detail["tokens_saved"] == 0 and detail["summary"] is None
    text = page(admin, "a", "dropping").text
    assert '<tr class="dropped">' in text
    sent = text.split('id="client-sent"')[1]
    assert 'class="tag dropped"' in sent and 'class="tag folded"' not in sent
    # The list counts compactions across layers: the seeded conversation's session summaries
    # (one version per compaction), none for the dropping one.
    listing = admin.get("/recap/").text
    row = listing.split("dropping</a>")[1].split("</tr>")[0]
    assert re.findall(r'<td class="num">([\d,]+)</td>', row)[1] == "0", row
    assert before["compactions_made"] >= 1


def test_the_window_a_decision_used_is_shown_beside_the_configured_one(site: Site) -> None:
    """An upstream that counts twice Recap's tokens: the next request is planned on about
    half the configured window, and the page says so for that request."""
    admin = logged_in(site, ADMIN)
    configured = WINDOW
    site.upstream.script(
        [Reply(usage={"prompt_tokens": 40_000, "completion_tokens": 5, "total_tokens": 40_005})]
    )
    messages = history(turns=8, marker="calibrate")
    site.chat("a", "calibrated", messages)
    site.chat("a", "calibrated", messages)
    site.wait_archived("a", "calibrated", 2)
    text = page(admin, "a", "calibrated").text
    shown = re.search(r'<span id="window">window ([\d,]+) tokens \(configured ([\d,]+)\)', text)
    assert shown is not None, text
    used, conf = (int(x.replace(",", "")) for x in shown.groups())
    assert conf == configured and used < configured, shown.group(0)


def test_the_holdout_report_follows_the_tenant_rules(shared_site: Site) -> None:
    a = logged_in(shared_site, KEYS["a"])
    r = a.get("/recap/report")
    assert r.status_code == 200 and "Holdout: tenant a" in r.text
    # Tenant a runs no holdout: its conversations are in no cohort, and said to be left out.
    assert "in no single cohort left out" in r.text
    assert a.get("/recap/report", params={"tenant": "b"}).status_code == 404
    bad = a.get("/recap/report", params={"since": "yesterday"})
    assert bad.status_code == 400 and "since must be an age" in bad.text
    admin = logged_in(shared_site, ADMIN)
    assert admin.get("/recap/report").status_code == 400  # two tenants: name one
    assert admin.get("/recap/report", params={"tenant": "b", "since": "1h"}).status_code == 200
    # No holdout, no link to its report on the listing.
    assert "holdout report" not in admin.get("/recap/").text
