"""A rollback sticks, end to end through the operator routes on a real server.

After rolling back from version 2 to 1, a later compaction makes version 3; a client
whose history version 2 would still match must get version 1 (never the discarded 2),
and nothing after the rollback is ever built on version 2's text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.edge.test_operator import (
    ADMIN,
    KEYS,
    auth,
    chat,
    events_settled,
    two_tenants,
    wait_for,
)
from tests.fakes import FakeUpstream, Reply
from tests.trajectories import chained, model_calls, sessions

# Summary markers are words, not ids: the guard strikes ids the input never held.
WORDS = ("ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE", "TEN")


def test_a_rolled_back_version_never_comes_back(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    # Automatic compaction off, stored summaries applied: versions come from /compact only.
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
    key = KEYS["a"]
    base = f"{url}/recap/conversations/desk"
    convo = chained(sessions()[:3])
    steps = [i for i in model_calls(convo) if convo[i - 1]["role"] == "user"]
    sent = 0

    def send(messages: list[dict[str, Any]]) -> httpx.Response:
        nonlocal sent
        r = chat(url, messages, "desk", key)
        sent += 1
        wait_for(lambda: events_settled(url, "desk", key, sent))
        return r

    def compact() -> dict[str, Any]:
        r = httpx.post(f"{base}/compact", headers=auth(key), timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())

    half = len(steps) // 2
    send(convo[: steps[half]])
    assert compact()["version"] == 1
    last = convo[: steps[-1]]
    send(last)
    assert compact()["version"] == 2
    assert send(last).headers["x-recap-summary-version"] == "2"

    r = httpx.post(f"{base}/rollback", headers=auth(key), json={"version": 1})
    assert r.status_code == 200, r.text
    # A forked history (its first user message edited): version 3 is made from it.
    fork = [dict(m) for m in last]
    first_user = next(i for i, m in enumerate(fork) if m["role"] == "user")
    fork[first_user]["content"] = "An edited first question."
    send(fork)
    v3 = compact()
    assert v3["version"] == 3
    prompt = fake.chat_requests("summarize")[-1].json["messages"][1]["content"]
    assert "SUMMARY-TWO" not in prompt

    # The original history: version 3 does not match it, version 2 would, and was
    # discarded: version 1 applies.
    r = send(last)
    assert r.headers["x-recap-summary-version"] == "1"
    forwarded = str(fake.chat_requests()[-1].json["messages"])
    assert "SUMMARY-ONE" in forwarded and "SUMMARY-TWO" not in forwarded
    # A compaction of it now builds on version 1, never on version 2's text.
    assert compact()["version"] == 4
    prompt = fake.chat_requests("summarize")[-1].json["messages"][1]["content"]
    assert "SUMMARY-ONE" in prompt and "SUMMARY-TWO" not in prompt

    d = httpx.get(base, headers=auth(key)).json()
    assert [(v["version"], v["rolled_back"]) for v in d["versions"]] == [
        (1, False),
        (2, True),
        (3, False),
        (4, False),
    ]
