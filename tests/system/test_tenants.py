"""Tenants and keys: one tenant can neither see nor move another's conversations, even
under the same conversation key; the operator routes need a key; and no key (proxy,
upstream, admin, or a wrong one) and no message content ever reaches the logs or the
metrics.

Two tenants behind one proxy, each with its own proxy key and upstream key; the fake
summarizer signs each summary with the tenant whose upstream key called it, so a
summary that crossed over would show.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.conftest import LogCapture
from tests.fakes import Reply
from tests.faults import (
    Answer,
    SummarizerFake,
    compacting_config,
    history,
    post,
    summaries_in,
)
from tests.servers import recap_app, serve

KEYS = {
    "proxy_a": "rk-alpha-7Q2c9Xw",
    "proxy_b": "rk-bravo-3Z8kq1L",
    "upstream_a": "sk-up-alpha-91XfR0",
    "upstream_b": "sk-up-bravo-55KmT4",
    "admin": "adm-key-4M1pQz7",
    "wrong": "rk-wrong-secret-0Pv",
}
TENANT_A, TENANT_B = "tnt-alpha-x1", "tnt-bravo-y2"
SIGNATURE = {
    f"Bearer {KEYS['upstream_a']}": "SIGNED-ALPHA",
    f"Bearer {KEYS['upstream_b']}": "SIGNED-BRAVO",
}
MARKER = "MARKER-zq9-CONTENT"  # appears in messages, tool results, summaries, error bodies


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[SummarizerFake, str, LogCapture]]:
    fake = SummarizerFake()

    def signed(body: dict[str, Any]) -> Answer:
        signature = SIGNATURE[fake.calls[-1].tenant]
        return Answer(content=f"<summary>\n## User Goal\n{signature} {MARKER}\n</summary>")

    fake.answer = signed
    logs = LogCapture()
    root = logging.getLogger("recap")
    old = root.level
    root.addHandler(logs.handler)
    root.setLevel(logging.DEBUG)
    try:
        with serve(fake) as url:

            def tenant(proxy_key: str, upstream_key: str) -> dict[str, Any]:
                return {
                    "api_keys": [proxy_key],
                    "upstream": {"base_url": f"{url}/v1", "api_key": upstream_key},
                    "compaction": {
                        "session": {"min_saving_tokens": 500},
                        "trim": {"enabled": False},
                    },
                    "summarizer": {"quality_guard": False},
                }

            config = compacting_config(
                url,
                tmp_path,
                tenants={
                    TENANT_A: tenant(KEYS["proxy_a"], KEYS["upstream_a"]),
                    TENANT_B: tenant(KEYS["proxy_b"], KEYS["upstream_b"]),
                },
                admin_keys=[KEYS["admin"]],
            )
            with serve(recap_app(config)) as proxy:
                yield fake, proxy + "/v1", logs
    finally:
        root.removeHandler(logs.handler)
        root.setLevel(old)


def as_(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[key]}"}


def recap(url: str, path: str, key: str | None, method: str = "GET", **kw: Any) -> httpx.Response:
    headers = as_(key) if key else {}
    return httpx.request(method, f"{url}/recap/{path}", headers=headers, timeout=30, **kw)


def test_same_conversation_key_and_history_never_cross_tenants(
    world: tuple[SummarizerFake, str, LogCapture],
) -> None:
    fake, url, _ = world
    messages = history(marker=MARKER)
    r = post(url, messages, "shared", headers=as_("proxy_a"))
    assert r.headers["x-recap-compaction"] == "session"
    sent_a = fake.fake.chat_requests()[-1]
    assert sent_a.headers["authorization"] == f"Bearer {KEYS['upstream_a']}"
    assert "SIGNED-ALPHA" in sent_a.json["messages"][1]["content"]

    # Same key, same history, other tenant: its own summary, made with its own key.
    r = post(url, messages, "shared", headers=as_("proxy_b"))
    assert r.headers["x-recap-compaction"] == "session"
    assert r.headers["x-recap-summary-version"] == "1"
    sent_b = fake.fake.chat_requests()[-1]
    assert sent_b.headers["authorization"] == f"Bearer {KEYS['upstream_b']}"
    (at,) = summaries_in(sent_b.json["messages"])
    assert "SIGNED-BRAVO" in sent_b.json["messages"][at]["content"]
    assert "SIGNED-ALPHA" not in json.dumps(sent_b.json)
    assert [c.tenant for c in fake.calls] == [
        f"Bearer {KEYS['upstream_a']}",
        f"Bearer {KEYS['upstream_b']}",
    ]

    # Each keeps its own: A again gets A's summary, with no new call.
    post(url, messages, "shared", headers=as_("proxy_a"))
    assert "SIGNED-ALPHA" in fake.fake.chat_requests()[-1].json["messages"][1]["content"]
    assert fake.count() == 2


def test_operator_routes_are_scoped_and_keyed(
    world: tuple[SummarizerFake, str, LogCapture],
) -> None:
    fake, url, _ = world
    post(url, history(seed=1), "shared", headers=as_("proxy_a"))
    post(url, history(seed=2), "shared", headers=as_("proxy_b"))
    post(url, history(seed=3, marker="ONLY-IN-A"), "only-a", headers=as_("proxy_a"))

    def state_of_a() -> list[Any]:
        """What B must not be able to change: A's conversations, as A sees them."""
        out = []
        for conv in ("only-a", "shared"):
            r = recap(url, f"conversations/{quote(conv, safe='')}", "proxy_a")
            assert r.status_code == 200
            detail = r.json()
            versions = [(v["version"], v["summary"]) for v in detail["versions"]]
            out.append(
                (
                    versions,
                    detail["current_version"],
                    detail["message_count"],
                    detail["compactions"],
                )
            )
        return out

    a_before = state_of_a()
    # No key, or a wrong one: nothing (inspection_open is false and there is no open tenant).
    for key in (None, "wrong"):
        assert recap(url, "conversations", key).status_code == 401
        for path in ("shared", "shared/view", "shared/archive"):
            assert recap(url, f"conversations/{path}", key).status_code == 401
        assert recap(url, "conversations/shared/compact", key, "POST").status_code == 401
        rollback = recap(url, "conversations/shared/rollback", key, "POST", json={"version": None})
        assert rollback.status_code == 401

    # B sees only B: the listing, and "shared" is B's own conversation.
    listing = recap(url, "conversations", "proxy_b").json()["data"]
    assert {c["tenant"] for c in listing} == {TENANT_B} and {c["key"] for c in listing} == {
        "shared"
    }
    assert recap(url, f"conversations?tenant={TENANT_A}", "proxy_b").status_code == 404
    detail = recap(url, "conversations/shared", "proxy_b").json()
    assert detail["tenant"] == TENANT_B and "SIGNED-BRAVO" in detail["summary"]["summary"]
    export = recap(url, "conversations/shared/archive", "proxy_b").text
    assert TENANT_A not in export and "SIGNED-ALPHA" not in export

    # A conversation only A has is, to B, a conversation that does not exist, whatever B asks.
    for path in ("only-a", "only-a/view", "only-a/archive", f"only-a?tenant={TENANT_A}"):
        r = recap(url, f"conversations/{path}", "proxy_b")
        assert r.status_code == 404 and "ONLY-IN-A" not in r.text
    assert recap(url, "conversations/only-a/compact", "proxy_b", "POST").status_code == 404
    r = recap(url, "conversations/only-a/rollback", "proxy_b", "POST", json={"version": None})
    assert r.status_code == 404

    # B compacting and rolling back "shared" moves B's conversation, never A's.
    fake.fake.chat = lambda body: Reply(content="fine")
    rollback = recap(
        url, "conversations/shared/rollback", "proxy_b", "POST", json={"version": None}
    )
    assert rollback.status_code == 200
    forced = post(
        url, history(seed=2), "only-a", headers={**as_("proxy_b"), "x-recap-compaction": "force"}
    )
    assert forced.headers["x-recap-compaction"] == "session"  # B's own "only-a"
    assert state_of_a() == a_before

    # The admin key sees both (naming the tenant), and is no key for chat.
    r = recap(url, f"conversations/only-a?tenant={TENANT_A}", "admin")
    assert r.status_code == 200 and r.json()["tenant"] == TENANT_A
    assert recap(url, "conversations/shared", "admin").status_code == 400  # which tenant?
    calls = len(fake.fake.chat_requests())
    r = post(url, history(), "shared", headers=as_("admin"))
    assert r.status_code == 401
    assert len(fake.fake.chat_requests()) == calls


def test_no_key_and_no_content_in_logs_or_metrics(
    world: tuple[SummarizerFake, str, LogCapture],
) -> None:
    fake, url, logs = world
    messages = history(marker=MARKER)
    messages[4] = {**messages[4], "content": f"tool output {MARKER}"}
    # Traffic of every kind: compaction, streaming, a failing summarizer, upstream errors
    # that quote the content, wrong keys, pass-through, operator calls.
    post(url, messages, "k1", headers=as_("proxy_a"))
    post(url, messages, "k1", headers=as_("proxy_b"), stream=True)
    fake.answer = lambda body: Answer(content=f"<summary>{MARKER}", finish_reason="length")
    post(url, history(seed=5, marker=MARKER), "k2", headers=as_("proxy_a"))
    fake.fake.chat = lambda body: Reply(
        status=400, error={"error": {"message": f"bad request: {MARKER} {KEYS['upstream_a']}"}}
    )
    post(url, messages, "k3", headers=as_("proxy_a"))
    post(url, messages, "k3", headers=as_("wrong"))
    post(url, messages, f"key-{MARKER}"[:10], headers={"authorization": KEYS["proxy_b"]})
    httpx.get(f"{url}/models", headers=as_("proxy_b"), timeout=10)
    httpx.get(f"{url}/models", headers=as_("wrong"), timeout=10)
    for key in ("proxy_a", "admin", "wrong"):
        recap(url, f"conversations/k1?tenant={TENANT_A}", key)
        recap(url, "conversations/k1/archive", key)
    recap(url, f"conversations/k1/compact?tenant={TENANT_A}", "admin", "POST")

    metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    logged = logs.text
    assert len(logs.records("recap.access")) >= 12
    assert "recap_requests_total" in metrics
    for name, secret in KEYS.items():
        assert secret not in logged, f"{name} key in the logs"
        assert secret not in metrics, f"{name} key in the metrics"
    assert MARKER not in logged
    assert MARKER not in metrics
    # Labels name a tenant only on the prompt-cache counters (the cached share per tenant
    # the operator asks for; tenants come from the config, so the cardinality is bounded).
    cache_series = ("recap_upstream_reported_input_tokens", "recap_upstream_cached_input_tokens")
    named = [line for line in metrics.splitlines() if TENANT_A in line or TENANT_B in line]
    assert named and all(line.startswith(cache_series) for line in named), named
