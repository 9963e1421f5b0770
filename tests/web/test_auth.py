"""Session cookies and cross-site checks, directly (pure: no server)."""

from __future__ import annotations

import pytest

from proxy.config import parse_config
from proxy.web.auth import Forbidden, Sessions, check_same_origin, presented

pytestmark = pytest.mark.quick

CONFIG = {"admin_keys": ["admin-1"], "tenants": {"a": {"api_keys": ["key-a"]}, "b": {}}}


def sessions(**overrides: object) -> Sessions:
    return Sessions(parse_config({**CONFIG, **overrides}, env={}), secret=b"s" * 32, ttl_s=60)


def test_a_cookie_names_its_key_until_it_expires() -> None:
    s = sessions()
    cookie = s.issue("key-a", now=1000)
    assert "key-a" not in cookie
    opened = s.open(cookie, now=1059)
    assert opened is not None and opened.key == "key-a" and opened.session
    assert s.open(cookie, now=1060) is None


def test_only_configured_keys_are_known() -> None:
    s = sessions()
    assert s.known("admin-1") and s.known("key-a")
    assert not s.known("key-b") and not s.known("")


def test_a_key_removed_from_the_config_ends_its_sessions() -> None:
    cookie = sessions().issue("key-a", now=1000)
    without = sessions(tenants={"a": {"api_keys": ["key-a2"]}})
    assert without.open(cookie, now=1001) is None
    assert sessions().open(cookie, now=1001) is not None


def test_another_secret_opens_nothing() -> None:
    cookie = sessions().issue("key-a", now=1000)
    other = Sessions(parse_config(CONFIG, env={}), secret=b"t" * 32)
    assert other.open(cookie, now=1001) is None
    assert Sessions(parse_config(CONFIG, env={})).csrf(None) == ""


def test_csrf_tokens_belong_to_one_session() -> None:
    s = sessions()
    one = s.open(s.issue("key-a", now=1000), now=1001)
    two = s.open(s.issue("key-a", now=1000), now=1001)
    assert one is not None and two is not None
    s.check_csrf(one, s.csrf(one))
    with pytest.raises(Forbidden):
        s.check_csrf(one, s.csrf(two))
    with pytest.raises(Forbidden):
        s.check_csrf(one, "")
    # A Bearer caller carries no ambient credential: no token needed.
    bearer = presented(s, {"authorization": "Bearer key-a"}, None)
    assert bearer is not None and bearer.session is None
    s.check_csrf(bearer, "")


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ({"host": "recap:8080"}, True),
        ({"host": "recap:8080", "origin": "http://recap:8080"}, True),
        ({"host": "recap:8080", "origin": "https://recap:8080"}, True),  # TLS ends before us
        ({"host": "recap:8080", "origin": "http://recap:8081"}, False),
        ({"host": "recap:8080", "origin": "http://evil.example"}, False),
        ({"host": "recap:8080", "origin": "null"}, False),
        ({"host": "recap:8080", "sec-fetch-site": "same-origin"}, True),
        ({"host": "recap:8080", "sec-fetch-site": "same-site"}, False),
        ({"host": "recap:8080", "sec-fetch-site": "cross-site"}, False),
    ],
)
def test_same_origin(headers: dict[str, str], ok: bool) -> None:
    if ok:
        check_same_origin(headers)
    else:
        with pytest.raises(Forbidden):
            check_same_origin(headers)


def test_a_revoked_session_stays_revoked_within_a_bounded_memory() -> None:
    s = Sessions(parse_config(CONFIG, env={}), secret=b"s" * 32, ttl_s=60, max_revoked=3)
    cookies = [s.issue("key-a", now=1000 + i) for i in range(6)]
    for cookie in cookies[:5]:
        credential = s.open(cookie, now=1010)
        assert credential is not None
        s.revoke(credential, now=1010)
    # Never more than max_revoked kept; a session forgotten from the set is not let back
    # in: every session expiring no later than it is refused instead.
    assert s.revoked_count <= 3
    assert all(s.open(c, now=1010) is None for c in cookies[:5])
    assert s.open(cookies[5], now=1010) is not None
    # Expired entries are dropped: the set holds only sessions that could still open.
    fresh = s.open(s.issue("key-a", now=2000), now=2000)
    assert fresh is not None
    s.revoke(fresh, now=2000)
    assert s.revoked_count == 1
