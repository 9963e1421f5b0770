"""Summarizer faults: whatever the summarizer does, the request goes through, and a failing
summarizer is neither hammered (circuit breaker) nor flooded (bounded concurrency).

Real servers on loopback: the proxy, and a fake upstream whose summarizer side is
scripted per test (`tests/faults.py: SummarizerFake`) and measures calls in flight.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from proxy.history.conversation import check_history
from proxy.history.tokens import TokenCounter
from tests.conftest import LogCapture
from tests.faults import (
    MODEL,
    SUMMARY,
    WINDOW,
    Answer,
    SummarizerFake,
    compacting_config,
    history,
    post,
    summaries_in,
    wait_until,
)
from tests.servers import free_port, recap_app, serve

# Long on purpose: only the fake clock ends it, never the wall clock.
COOLDOWN_S = 3600.0

# Each case: what the summarizer does, and the reason the proxy must log for it.
FAILURES: dict[str, tuple[Answer, str]] = {
    "error_500": (Answer(status=500), "upstream status 500"),
    "rate_limited_429": (Answer(status=429), "upstream status 429"),
    "late": (Answer(content=SUMMARY, delay_s=2.0), "upstream_timeout"),
    "hang": (Answer(content=SUMMARY, delay_s=3600), "upstream_timeout"),
    "empty": (Answer(content=""), "empty"),
    "null_content": (
        Answer(raw=b'{"choices":[{"message":{"content":null},"finish_reason":"stop"}]}'),
        "empty",
    ),
    "only_tags": (Answer(content="<summary>\n  \n</summary>"), "empty"),
    "only_thinking": (Answer(content="<think>drafting a summary</think>"), "empty"),
    "truncated": (
        Answer(content="<summary>\n## User Goal\nChange a fl", finish_reason="length"),
        "finish_reason=length",
    ),
    "too_long": (Answer(content="<summary>" + "x" * 9_500 + "</summary>"), "too_long"),
    "not_json": (Answer(raw=b"<html>bad gateway</html>"), "malformed upstream response"),
    "no_choices": (Answer(raw=b'{"choices": []}'), "malformed upstream response"),
    "wrong_shape": (
        Answer(raw=b'{"choices": [{"message": "text"}]}'),
        "malformed upstream response",
    ),
}


def test_every_summarizer_failure_forwards_the_request_as_it_came(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    fake, url = upstream
    proxy = start(url, summarizer={"timeout_s": 0.5})
    messages = history()
    sent = json.dumps({"model": MODEL, "messages": messages}).encode()
    for n, (name, (answer, reason)) in enumerate(FAILURES.items(), start=1):
        fake.answer = lambda body, a=answer: a  # type: ignore[misc]
        r = httpx.post(
            f"{proxy}/chat/completions",
            content=sent,
            headers={"x-conversation-id": f"fail-{name}", "content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, name
        assert r.headers["x-recap-compaction"] == "failed", name
        assert "x-recap-summary-version" not in r.headers, name
        # Forwarded as it came: the client's exact bytes.
        assert fake.fake.chat_requests()[-1].body == sent, name
        line = logs.access(n)[-1]
        # A hanging summarizer costs at most its timeout, not the client's patience: its
        # failure is the proxy's own (the reason), within the client's 30 s.
        assert line["session_failure"] == reason, name
        # A summary cut by its token limit, or over max_summary_chars, is asked for once
        # more before it fails.
        retried = name in ("truncated", "too_long")
        assert line.get("summarizer_length_retries") == (1 if retried else None), name
    assert fake.count() == len(FAILURES) + 2  # "truncated" and "too_long": two tries each
    assert fake.abandoned == 2  # "late" and "hang": the proxy hung up on both


def test_trickling_summarizer_is_cut_at_its_time_budget(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    """Bytes every 0.2 s never trip a 0.5 s read timeout; the overall bound must."""
    fake, url = upstream
    fake.answer = lambda body: Answer(content=SUMMARY, trickle_s=0.2)
    proxy = start(
        url,
        summarizer={
            "timeout_s": 0.5,
            "upstream": {"base_url": f"{url}/v1", "connect_timeout_s": 0.5},
        },
    )
    # The trickle would take minutes to finish: a "timeout" failure is the overall bound.
    r = post(proxy, history(), "trickle")
    assert r.status_code == 200
    assert r.headers["x-recap-compaction"] == "failed"
    assert logs.access()[-1]["session_failure"] == "timeout"
    assert summaries_in(fake.fake.chat_requests()[-1].json["messages"]) == []
    assert wait_until(lambda: fake.abandoned == 1)


def test_unreachable_summarizer_forwards_uncompacted(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    fake, url = upstream
    dead = f"http://127.0.0.1:{free_port()}/v1"
    proxy = start(url, summarizer={"upstream": {"base_url": dead}})
    messages = history()
    r = post(proxy, messages, "refused")
    assert r.status_code == 200
    assert r.headers["x-recap-compaction"] == "failed"
    assert fake.fake.chat_requests()[-1].json["messages"] == messages
    assert logs.access()[-1]["session_failure"] == "upstream_unreachable"


def test_failed_summary_over_the_window_is_still_fitted(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    """No summary, but the history is over the window: the last resort still fits it, and its
    warning (logger `recap.fit`) names the compaction whose failure left it there."""
    fake, url = upstream
    fake.answer = lambda body: Answer(status=503)
    proxy = start(url)
    messages = history(70)
    counter = TokenCounter()
    assert counter.count_messages(messages, MODEL) > WINDOW
    r = post(proxy, messages, "over")
    assert r.status_code == 200
    assert r.headers["x-recap-compaction"] == "failed"
    assert int(r.headers["x-recap-dropped-messages"]) > 0
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    assert summaries_in(forwarded) == []
    assert check_history(forwarded) == []
    assert forwarded[0] == messages[0] and forwarded[-1] == messages[-1]
    assert counter.count_messages(forwarded, MODEL) <= WINDOW
    # Every surface tells it apart from a compaction: the log line's outcome is `dropped`.
    (fit,) = [c for c in logs.access()[-1]["compactions"] if c["layer"] == "fit_to_window"]
    assert fit["action"] == "dropped" and fit["count"] > 0
    (warning,) = logs.records("recap.fit")
    assert warning["request_id"] == r.headers["x-recap-request-id"]
    assert "the session summary failed (upstream status 503)" in warning["msg"], warning["msg"]
    assert r.headers["x-recap-dropped-reason"].startswith("a summary failed")


def test_a_drop_in_the_cool_down_says_so(
    upstream: tuple[SummarizerFake, str], tmp_path: Path, logs: LogCapture
) -> None:
    """Over the window while the breaker is open: the drop's reason is the cool-down, not
    "what must stay raw is over the window" (which was not why nothing was folded)."""
    fake, url = upstream
    fake.answer = lambda body: Answer(status=500)
    config = compacting_config(
        url, tmp_path, session={"failure_threshold": 1, "cooldown_s": COOLDOWN_S}
    )
    messages = history(70)
    with serve(recap_app(config, clock=FakeClock())) as root:
        proxy = root + "/v1"
        assert post(proxy, messages, "cool").headers["x-recap-compaction"] == "failed"
        r = post(proxy, messages, "cool")
    assert fake.count() == 1, "the breaker is open: no second summarizer call"
    assert int(r.headers["x-recap-dropped-messages"]) > 0
    assert "cool-down" in r.headers["x-recap-dropped-reason"], r.headers
    assert logs.access(2)[-1]["dropped_reason"] == "cooling_down"
    assert "cool-down" in logs.records("recap.fit")[-1]["msg"]


class FakeClock:
    """Monotonic seconds that move only when the test says so (the breaker's cool-down)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_circuit_breaker_stops_calls_during_the_cooldown(
    upstream: tuple[SummarizerFake, str], tmp_path: Path, logs: LogCapture
) -> None:
    fake, url = upstream
    fake.answer = lambda body: Answer(status=500)
    clock = FakeClock()
    config = compacting_config(
        url, tmp_path, session={"failure_threshold": 2, "cooldown_s": COOLDOWN_S}
    )
    messages = history()
    with serve(recap_app(config, clock=clock)) as root:
        proxy = root + "/v1"

        def turn(key: str = "breaker") -> httpx.Response:
            r = post(proxy, messages, key)
            assert r.status_code == 200
            return r

        turn()
        turn()
        assert fake.count() == 2  # threshold reached: the breaker opens
        for _ in range(5):
            r = turn()
            assert r.headers["x-recap-compaction"] == "none"
        # The clock stood still: the cool-down is running, whatever the wall clock did.
        assert fake.count() == 2, "no summarizer call while the breaker is open"
        assert logs.access(7)[-1]["session_skip"] == "circuit_open"
        # Still open up to the last moment of the cool-down.
        clock.advance(COOLDOWN_S - 0.01)
        turn()
        assert fake.count() == 2
        # Other conversations are not punished for this one.
        turn("other")
        assert fake.count() == 3

        # After the cool-down one attempt goes through (half-open); it fails and re-opens.
        clock.advance(0.02)
        turn()
        assert fake.count() == 4
        turn()
        assert fake.count() == 4
        # The summarizer recovers; after the next cool-down the conversation compacts again.
        fake.answer = lambda body: Answer(content=SUMMARY)
        clock.advance(COOLDOWN_S)
        r = turn()
        assert fake.count() == 5
        assert r.headers["x-recap-compaction"] == "session"
        turn()
        assert fake.count() == 5  # the stored summary is reused


def test_summarizer_concurrency_is_bounded_per_tenant(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    """A compaction storm: 2 tenants x 6 conversations compacting at once, max 2 per tenant."""
    fake, url = upstream
    fake.answer = lambda body: Answer(content=SUMMARY, delay_s=0.3)
    # Both tenants' two slots full at once is the event this test needs; on a loaded
    # machine the first calls could end before the other tenant's arrive, so the fake
    # holds the calls until four are in flight (a proxy bounding the total lower, or
    # per tenant higher, still fails below).
    fake.hold_until_total = 4

    def tenant(name: str) -> dict[str, Any]:
        return {
            "api_keys": [f"rk-{name}"],
            "upstream": {"base_url": f"{url}/v1", "api_key": f"sk-{name}"},
            "compaction": {"session": {"min_saving_tokens": 500}, "trim": {"enabled": False}},
            "summarizer": {"max_concurrency": 2, "quality_guard": False},
        }

    proxy = start(url, tenants={"a": tenant("a"), "b": tenant("b")})
    statuses: list[str] = []

    def conversation(name: str, n: int) -> None:
        r = post(
            proxy,
            history(seed=n),
            f"storm-{n}",
            headers={"authorization": f"Bearer rk-{name}"},
        )
        statuses.append(f"{r.status_code} {r.headers.get('x-recap-compaction')}")

    threads = [
        threading.Thread(target=conversation, args=(name, n))
        for n in range(6)
        for name in ("a", "b")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == ["200 session"] * 12
    assert fake.count() == 12
    # Measured at the upstream: never more than 2 per tenant, and both tenants at once.
    assert fake.max_in_flight == {"Bearer sk-a": 2, "Bearer sk-b": 2}
    assert fake.max_total == 4
    # Each call was answered after its full delay, none cut short: with at most 2 in flight
    # per tenant, the 6 calls of a tenant queued for their slots (3 rounds at least).
    assert fake.abandoned == 0
