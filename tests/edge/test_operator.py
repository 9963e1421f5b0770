"""The operator routes under /v1/recap/: export, view, manual compaction, rollback, tenancy.

Real servers (the proxy and the fake upstream on uvicorn), real τ-bench conversations.
Archive events are written in the background just after each response, so tests poll
(bounded) for them instead of sleeping.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.history.messages import fingerprint
from proxy.store import SqliteStore
from proxy.store.base import ConversationRef
from tests.fakes import FakeUpstream, Reply
from tests.trajectories import DATA, chained, model_calls, sessions

pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")

ADMIN = "admin-key"
KEYS = {"a": "key-a", "b": "key-b"}
WINDOW = 12000
T = TypeVar("T")

# Summary markers are words, not ids: the guard strikes ids the input never held.
WORDS = ("ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE", "TEN")


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def wait_for(probe: Callable[[], T | None], timeout: float = 10.0) -> T:
    """Poll until `probe` returns something truthy (events are written in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def two_tenants(upstream_url: str, **compaction: Any) -> dict[str, Any]:
    return {
        name: {
            "api_keys": [key],
            "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 30},
            "compaction": compaction,
        }
        for name, key in KEYS.items()
    }


def chat(
    url: str, messages: list[dict[str, Any]], conv: str, key: str, **headers: str
) -> httpx.Response:
    r = httpx.post(
        f"{url}/chat/completions",
        json={"model": "small", "messages": messages},
        headers={"x-conversation-id": conv, **auth(key), **headers},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def replay_turns(url: str, messages: list[dict[str, Any]], conv: str, key: str) -> int:
    """Each turn start of a recorded conversation, sent as the agent sent it."""
    n = 0
    for i in model_calls(messages):
        if messages[i - 1]["role"] == "user":
            chat(url, messages[:i], conv, key)
            n += 1
    return n


def export(url: str, conv: str, key: str, **params: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/recap/conversations/{conv}/archive", headers=auth(key), params=params)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert "content-length" not in r.headers  # streamed, not built whole
    return [json.loads(line) for line in r.text.splitlines()]


def events_settled(url: str, conv: str, key: str, requests: int) -> list[dict[str, Any]] | None:
    lines = export(url, conv, key)
    kinds = [x["type"] for x in lines]
    done = kinds.count("request") >= requests and kinds.count("response") >= requests
    return lines if done else None


def agent_loop(
    url: str, fake: FakeUpstream, history: list[dict[str, Any]], conv: str, key: str, steps: int
) -> int:
    """A tool loop driven by the fake model: one tool call a step, large results."""
    n = {"step": 0}

    def reply(body: dict[str, Any]) -> Reply:
        n["step"] += 1
        call = {
            "id": f"call_loop_{n['step']}",
            "type": "function",
            "function": {"name": "search_flights", "arguments": json.dumps({"page": n["step"]})},
        }
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")

    fake.chat = reply
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    for _ in range(steps):
        completion = client.chat.completions.create(
            model="small",
            messages=history,  # type: ignore[arg-type]
            extra_headers={"x-conversation-id": conv},
        )
        calls = [c.model_dump() for c in completion.choices[0].message.tool_calls or []]
        history.append({"role": "assistant", "content": None, "tool_calls": calls})
        for c in calls:
            rows = "\n".join(
                f"flight HAT{c['id'][-2:]}{i:03d}: 08:{i % 60:02d} $1{i}9" for i in range(90)
            )
            history.append({"role": "tool", "tool_call_id": c["id"], "content": rows})
    return steps


def test_export_holds_every_original_once_and_every_event_in_order(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        models={"small": {"context_window": WINDOW}},
        admin_keys=[ADMIN],
        tenants=two_tenants(upstream_url, session={"min_saving_tokens": 500}),
    )
    convo = chained(sessions()[:4])
    requests = replay_turns(url, convo, "trip-1", KEYS["a"])
    history = [*convo, {"role": "user", "content": "Now list every flight to SFO next week."}]
    requests += agent_loop(url, fake, history, "trip-1", KEYS["a"], steps=13)
    sent_by_client = history[:-2]  # the last assistant call and its result were never sent

    lines = wait_for(lambda: events_settled(url, "trip-1", KEYS["a"], requests))
    head, *body, end = lines
    assert head["type"] == "conversation" and head["format"] == "recap-archive/1"
    assert (head["tenant"], head["key"]) == ("a", "trip-1")
    messages = [x for x in body if x["type"] == "message"]
    params = [x for x in body if x["type"] == "params"]
    events = [x for x in body if x["type"] not in ("message", "params", "summary")]
    summaries = [x for x in body if x["type"] == "summary"]
    assert end == {
        "type": "end",
        "messages": len(messages),
        "params": len(params),
        "events": len(events),
        "summaries": len(summaries),
    }
    # Messages first, then request parameters, then events, then summary versions.
    kinds = [x["type"] for x in body]
    assert kinds == ["message"] * len(messages) + ["params"] * len(params) + [
        x["type"] for x in events
    ] + ["summary"] * len(summaries)
    # Every archived message exactly once, each one the proxy saw, byte for byte as sent.
    fps = [x["fingerprint"] for x in messages]
    assert len(fps) == len(set(fps)) == head["message_count"]
    assert all(fingerprint(x["message"]) == x["fingerprint"] for x in messages)
    assert {fingerprint(m) for m in sent_by_client} <= set(fps)
    # Every event in order, and every fingerprint an event names is in the export.
    ids = [x["id"] for x in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    types = {x["type"] for x in events}
    assert {"request", "response", "session_compact", "loop_compact", "trim"} <= types, types
    for x in events:
        p = x["payload"]
        for name in ("messages", "sent", "originals"):
            assert set(p.get(name) or []) <= set(fps), (x["type"], name)
    # A request event's `messages` rebuild the client's request exactly.
    by_fp = {x["fingerprint"]: x["message"] for x in messages}
    last_request = [x for x in events if x["type"] == "request"][-1]["payload"]
    assert [by_fp[fp] for fp in last_request["messages"]] == sent_by_client
    assert [s["version"] for s in summaries] == list(range(1, len(summaries) + 1))

    # The view is exactly what the upstream received last.
    r = httpx.get(f"{url}/recap/conversations/trip-1/view", headers=auth(KEYS["a"]))
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["messages"] == fake.chat_requests()[-1].json["messages"]
    assert view["classification"] == "tool_continuation"
    assert "loop" in view["layers"] or "trim" in view["layers"]

    # The detail: current summary, versions, compaction history with figures.
    d = httpx.get(f"{url}/recap/conversations/trip-1", headers=auth(KEYS["a"])).json()
    assert d["current_version"] == d["summary"]["version"] == summaries[-1]["version"]
    assert [v["version"] for v in d["versions"]] == [s["version"] for s in summaries]
    layers = {(c["layer"], c["outcome"]) for c in d["compactions"]}
    assert {("session", "ok"), ("loop", "ok")} <= layers
    assert d["tokens_saved"] == sum(c["tokens_saved"] for c in d["compactions"]) > 0
    assert all(c["reason"] for c in d["compactions"])

    # The admin key sees it too, naming the tenant (two are configured).
    r = httpx.get(f"{url}/recap/conversations/trip-1/archive", headers=auth(ADMIN))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    assert export(url, "trip-1", ADMIN, tenant="a") == lines


def test_manual_compaction_and_rollback_change_what_is_sent(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    # Automatic compaction effectively off (thresholds never reached) but stored summaries
    # applied: what the upstream sees changes only through the operator routes.
    url = proxy_factory(
        admin_keys=[ADMIN],
        tenants=two_tenants(
            upstream_url,
            session={
                "min_new_tokens": 10**9,
                "trigger_ratio": 0.99,
                "recent_turns": 2,
                "min_recent_ratio": 0.01,
            },
            loop={"enabled": False},
            trim={"enabled": False},
        ),
    )
    made: list[str] = []

    def summarize(body: dict[str, Any]) -> Reply:
        made.append(f"SUMMARY-{WORDS[len(made)]}")
        return Reply(content=f"<summary>\n## User Goal\n{made[-1]}\n</summary>")

    fake.summarize = summarize
    key = KEYS["b"]
    base = f"{url}/recap/conversations/desk-1"
    convo = chained(sessions()[:3])
    steps = [i for i in model_calls(convo) if convo[i - 1]["role"] == "user"]
    half = len(steps) // 2
    for i in steps[:half]:
        chat(url, convo[:i], "desk-1", key)
    wait_for(lambda: events_settled(url, "desk-1", key, half))

    r = httpx.post(f"{base}/compact", headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    v1 = r.json()
    assert v1["version"] == 1 and v1["summary"].startswith("## User Goal\nSUMMARY-ONE")
    assert v1["tokens_after"] < v1["tokens_before"]
    # The next request carries the new summary.
    r = chat(url, convo[: steps[half - 1]], "desk-1", key)
    assert r.headers["x-recap-summary-version"] == "1"
    assert "SUMMARY-ONE" in fake.chat_requests()[-1].json["messages"][1]["content"]
    # Applying the stored summary is the session layer's work: the view says so.
    wait_for(lambda: events_settled(url, "desk-1", key, half + 1))
    view = httpx.get(f"{base}/view", headers=auth(key)).json()
    assert view["layers"] == ["session"] and view["summary_version"] == 1
    session = [c for c in view["compactions"] if c["layer"] == "session"]
    assert [(c["action"], c["version"]) for c in session] == [("applied", 1)]
    assert view["tokens_after"] < view["tokens_before"]

    for i in steps[half:]:
        chat(url, convo[:i], "desk-1", key)
    wait_for(lambda: events_settled(url, "desk-1", key, len(steps) + 1))
    v2 = httpx.post(f"{base}/compact", headers=auth(key), timeout=60).json()
    assert v2["version"] == 2 and v2["covered"] > v1["covered"]
    # Version 2 rolled its input from version 1 (a rolling summary).
    assert "SUMMARY-ONE" in fake.chat_requests("summarize")[-1].json["messages"][1]["content"]

    last = convo[: steps[-1]]
    r = httpx.post(f"{base}/rollback", headers=auth(key), json={"version": 1})
    assert r.status_code == 200, r.text
    assert (r.json()["from"], r.json()["to"], r.json()["summary"]["version"]) == (2, 1, 1)
    r = chat(url, last, "desk-1", key)
    assert r.headers["x-recap-summary-version"] == "1"
    assert "SUMMARY-ONE" in fake.chat_requests()[-1].json["messages"][1]["content"]
    # The next compaction starts from version 1 and the archived originals: the discarded
    # version 2 text is nowhere in its input.
    wait_for(lambda: events_settled(url, "desk-1", key, len(steps) + 2))
    v3 = httpx.post(f"{base}/compact", headers=auth(key), timeout=60).json()
    assert v3["version"] == 3  # numbers are never reused
    prompt = fake.chat_requests("summarize")[-1].json["messages"][1]["content"]
    assert "SUMMARY-ONE" in prompt and "SUMMARY-TWO" not in prompt

    r = httpx.post(f"{base}/rollback", headers=auth(key), json={"version": None})
    assert r.json()["to"] is None and r.json()["summary"] is None
    chat(url, last, "desk-1", key)
    assert fake.chat_requests()[-1].json["messages"] == last  # no summary at all
    wait_for(lambda: events_settled(url, "desk-1", key, len(steps) + 3))
    v4 = httpx.post(f"{base}/compact", headers=auth(key), timeout=60).json()
    prompt = fake.chat_requests("summarize")[-1].json["messages"][1]["content"]
    assert "<existing_summary>" not in prompt and "SUMMARY-" not in prompt
    assert "There is no existing summary" in prompt
    assert v4["version"] == 4

    d = httpx.get(base, headers=auth(key)).json()
    assert [v["version"] for v in d["versions"]] == [1, 2, 3, 4]
    assert [v["current"] for v in d["versions"]] == [False, False, False, True]
    assert [c["layer"] for c in d["compactions"]] == ["manual"] * 4
    rollbacks = [x["payload"] for x in export(url, "desk-1", key) if x["type"] == "rollback"]
    assert [(x["from"], x["to"]) for x in rollbacks] == [(2, 1), (3, None)]
    assert all(x["request_id"] for x in rollbacks)

    # Errors are explicit, in the OpenAI error shape.
    r = httpx.post(f"{base}/rollback", headers=auth(key), json={"version": 9})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    for bad in ({}, {"version": "1"}, {"version": 0}, [1]):
        r = httpx.post(f"{base}/rollback", headers=auth(key), json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", bad
    chat(url, [{"role": "user", "content": "hi"}], "tiny", key)
    wait_for(lambda: events_settled(url, "tiny", key, 1))
    r = httpx.post(f"{url}/recap/conversations/tiny/compact", headers=auth(key), timeout=60)
    assert r.status_code == 409 and "Nothing was compacted" in r.json()["error"]["message"]
    fake.summarize = lambda body: Reply(status=500)
    httpx.post(f"{base}/rollback", headers=auth(key), json={"version": None})
    r = httpx.post(f"{base}/compact", headers=auth(key), timeout=60)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "compaction_failed"
    assert "upstream status 500" in r.json()["error"]["message"]
    # The operator's compactions are counted in /metrics, by outcome.
    families = text_string_to_metric_families(httpx.get(url[: -len("/v1")] + "/metrics").text)
    manual = {
        s.labels["outcome"]: s.value
        for f in families
        for s in f.samples
        if s.name == "recap_compactions_total" and s.labels["layer"] == "manual"
    }
    assert manual == {"ok": 4, "skipped": 1, "failed": 1}


def test_each_tenant_sees_only_its_own_conversations(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(admin_keys=[ADMIN], tenants=two_tenants(upstream_url))
    hello_a = [{"role": "user", "content": "hello from a"}]
    hello_b = [{"role": "user", "content": "hello from b"}]
    chat(url, hello_a, "shared", KEYS["a"])
    chat(url, hello_b, "shared", KEYS["b"])
    chat(url, hello_b, "only-b", KEYS["b"])
    for key, n in ((KEYS["a"], 1), (KEYS["b"], 2)):
        wait_for(lambda key=key, n=n: len(_list(url, key)["data"]) == n)

    # The same key in two tenants: each sees its own.
    for key, text in ((KEYS["a"], "hello from a"), (KEYS["b"], "hello from b")):
        wait_for(lambda key=key: events_settled(url, "shared", key, 1))
        msgs = [x["message"] for x in export(url, "shared", key) if x["type"] == "message"]
        assert msgs == [{"role": "user", "content": text}]
        view = httpx.get(f"{url}/recap/conversations/shared/view", headers=auth(key)).json()
        assert view["messages"] == [{"role": "user", "content": text}]

    # Tenant b's conversation does not exist for tenant a: 404 on every route, the same
    # answer as for a key that exists nowhere.
    for method, path in (
        ("GET", ""),
        ("GET", "/view"),
        ("GET", "/archive"),
        ("POST", "/compact"),
        ("POST", "/rollback"),
    ):
        for conv in ("only-b", "nowhere"):
            r = httpx.request(
                method,
                f"{url}/recap/conversations/{conv}{path}",
                headers=auth(KEYS["a"]),
                json={"version": None},
            )
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"] == {
                "message": f"No conversation {conv!r}.",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        # Naming the other tenant does not help.
        r = httpx.request(
            method,
            f"{url}/recap/conversations/only-b{path}",
            headers=auth(KEYS["a"]),
            params={"tenant": "b"},
            json={"version": None},
        )
        assert r.status_code == 404
    assert [c["key"] for c in _list(url, KEYS["a"])["data"]] == ["shared"]
    assert {(c["tenant"], c["key"]) for c in _list(url, ADMIN)["data"]} == {
        ("a", "shared"),
        ("b", "shared"),
        ("b", "only-b"),
    }
    assert {c["key"] for c in _list(url, ADMIN, tenant="b")["data"]} == {"shared", "only-b"}
    r = httpx.get(f"{url}/recap/conversations/only-b", headers=auth(ADMIN), params={"tenant": "b"})
    assert r.status_code == 200 and r.json()["tenant"] == "b"
    r = httpx.get(f"{url}/recap/conversations", headers=auth(ADMIN), params={"tenant": "zz"})
    assert r.status_code == 404

    # Paging: newest first, one at a time, until has_more is false.
    seen, before = [], None
    while True:
        page = _list(url, ADMIN, limit="1", **({"before": str(before)} if before else {}))
        seen += [(c["tenant"], c["key"]) for c in page["data"]]
        if not page["has_more"]:
            break
        before = page["next_before"]
    assert seen == [(c["tenant"], c["key"]) for c in _list(url, ADMIN)["data"]]
    assert len(seen) == 3

    # No key, a wrong key, or an admin key on the chat route: refused.
    assert httpx.get(f"{url}/recap/conversations").status_code == 401
    assert httpx.get(f"{url}/recap/conversations", headers=auth("nope")).status_code == 401
    r = httpx.post(
        f"{url}/chat/completions", json={"model": "m", "messages": hello_a}, headers=auth(ADMIN)
    )
    assert r.status_code == 401
    # The pass-through never sees /v1/recap/.
    before_count = len(fake.requests)
    r = httpx.get(f"{url}/recap/unknown", headers=auth(KEYS["a"]))
    assert r.status_code == 404 and len(fake.requests) == before_count
    assert (
        httpx.get(
            f"{url}/recap/conversations", headers=auth(KEYS["a"]), params={"limit": "0"}
        ).status_code
        == 400
    )


def _list(url: str, key: str, **params: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/recap/conversations", headers=auth(key), params=params)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("inspection_open", [False, True])
def test_open_tenant_inspects_only_when_allowed(
    proxy_factory: Callable[..., str], upstream_url: str, inspection_open: bool
) -> None:
    url = proxy_factory(inspection_open=inspection_open)
    chat(url, [{"role": "user", "content": "hi"}], "open-1", "client-upstream-key")
    r = httpx.get(f"{url}/recap/conversations")
    if not inspection_open:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        return
    wait_for(lambda: httpx.get(f"{url}/recap/conversations").json()["data"])
    assert [c["key"] for c in httpx.get(f"{url}/recap/conversations").json()["data"]] == ["open-1"]


def test_periodic_prune_deletes_idle_conversations_and_rearchives_revived_ones(
    proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path
) -> None:
    url = proxy_factory(
        admin_keys=[ADMIN],
        archive={"retention_days": 1, "prune_interval_s": 0.05},
        tenants=two_tenants(upstream_url),
    )
    history = [{"role": "user", "content": "book me a flight"}]
    chat(url, history, "old-1", KEYS["a"])
    chat(url, history, "new-1", KEYS["a"])
    wait_for(lambda: events_settled(url, "old-1", KEYS["a"], 1))
    # Age one conversation by two days, as if it had been idle since.
    with sqlite3.connect(tmp_path / "recap.db") as db:
        db.execute(
            "UPDATE conversations SET updated_at = updated_at - 2 * 86400 WHERE key = 'old-1'"
        )
    wait_for(lambda: [c["key"] for c in _list(url, KEYS["a"])["data"]] == ["new-1"])
    # Gone whole: no messages, events or summaries left behind.
    with sqlite3.connect(tmp_path / "recap.db") as db:
        for table in ("messages", "events", "summary_versions", "compactions"):
            n = db.execute(f"SELECT COUNT(*) FROM {table} WHERE key = 'old-1'").fetchone()[0]
            assert n == 0, table
    # The same history comes back: its messages are archived again (the archiver's memory
    # of what is on disk was cleared by the prune).
    chat(url, history, "old-1", KEYS["a"])
    lines = wait_for(lambda: events_settled(url, "old-1", KEYS["a"], 1))
    assert [x["message"] for x in lines if x["type"] == "message"] == history


async def test_store_last_event_and_paged_archive(tmp_path: Path) -> None:
    conv = ConversationRef("t", "k")
    async with SqliteStore(str(tmp_path / "s.db")) as store:
        assert await store.last_event(conv, "request") is None
        rows = [(f"fp{i:02d}", json.dumps({"role": "user", "content": str(i)})) for i in range(7)]
        await store.archive_messages(conv, rows[:4])
        await store.archive_messages(conv, rows[2:])
        for i in range(3):
            await store.append_event(conv, "request", {"n": i})
            await store.append_event(conv, "response", {"n": i})
        last = await store.last_event(conv, "request")
        assert last is not None and last.payload == {"n": 2} and last.type == "request"
        paged = [x async for x in store.iter_archived(conv, page_size=2)]
        assert paged == rows
        other = ConversationRef("u", "k")
        assert [x async for x in store.iter_archived(other)] == []
        assert await store.last_event(other, "request") is None


def _compactable(url: str, conv: str, key: str, *, model: str | None) -> None:
    """One request with a history a forced compaction folds (half a τ-bench chain)."""
    convo = chained(sessions()[:3])
    steps = [i for i in model_calls(convo) if convo[i - 1]["role"] == "user"]
    body: dict[str, Any] = {"messages": convo[: steps[len(steps) // 2]]}
    if model is not None:
        body["model"] = model
    r = httpx.post(
        f"{url}/chat/completions",
        json=body,
        headers={"x-conversation-id": conv, **auth(key)},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    wait_for(lambda: events_settled(url, conv, key, 1))


def _no_automatic_compaction(upstream_url: str) -> dict[str, Any]:
    return two_tenants(
        upstream_url,
        session={"min_new_tokens": 10**9, "trigger_ratio": 0.99, "recent_turns": 2},
        loop={"enabled": False},
        trim={"enabled": False},
    )


def test_an_admins_manual_compaction_never_sends_the_admin_key_upstream(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    """The tenant has no upstream key of its own, so a chat request's summarizer call
    carries the client's Authorization; an admin's compaction carries none: the admin key
    is Recap's, never the upstream's."""
    url = proxy_factory(admin_keys=[ADMIN], tenants=_no_automatic_compaction(upstream_url))
    _compactable(url, "desk-admin", KEYS["a"], model="small")
    r = httpx.post(
        f"{url}/recap/conversations/desk-admin/compact",
        params={"tenant": "a"},
        headers=auth(ADMIN),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    (call,) = fake.chat_requests("summarize")
    assert not any(ADMIN in value for value in call.headers.values()), call.headers
    assert "authorization" not in call.headers


def test_a_manual_compaction_with_no_model_to_ask_is_a_400(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    """The conversation's last request named no model and the scene names none: nothing to
    ask, which the caller can tell (400, param `model`), not an upstream failure (on
    ce59ff6: 502 compaction_failed); no summarizer call is made."""
    url = proxy_factory(admin_keys=[ADMIN], tenants=_no_automatic_compaction(upstream_url))
    _compactable(url, "desk-nomodel", KEYS["a"], model=None)
    r = httpx.post(
        f"{url}/recap/conversations/desk-nomodel/compact", headers=auth(KEYS["a"]), timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"
    assert fake.chat_requests("summarize") == []
