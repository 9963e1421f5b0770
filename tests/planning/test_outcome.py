"""Reporting tells the truth and force means force (issue 12.5, 12.6), end to end."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.planning.outcome import CompactionOutcome, in_words, layers, log_fields
from tests.conftest import LogCapture
from tests.faults import SummarizerFake, history, post, summaries_in, wait_until


def archived_layers(tmp_path: Path, key: str, requests: int) -> list[list[str]]:
    """The `layers` of the conversation's archived requests, once `requests` of them are
    stored (the server stores journaled records in batches, within 0.25 s)."""

    def read() -> list[list[str]]:
        with sqlite3.connect(tmp_path / "recap.db") as db:
            rows = db.execute(
                "SELECT payload FROM events WHERE key = ? AND type = 'request' ORDER BY id", (key,)
            ).fetchall()
        return [json.loads(p)["layers"] for (p,) in rows]

    assert wait_until(lambda: len(read()) >= requests, timeout=10)
    return read()


def test_force_folds_a_small_conversation(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    fake, url = upstream
    proxy = start(url)
    small = history(turns=3, tool_every=0)  # far below every threshold
    r = post(proxy, small, "force-small", headers={"x-recap-compaction": "force"})
    assert r.headers["x-recap-compaction"] == "session"
    assert r.headers["x-recap-summary-version"] == "1"
    assert "x-recap-compaction-skipped" not in r.headers
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    # Everything before the current turn is folded: pinned, summary, the question.
    assert len(summaries_in(forwarded)) == 1 and forwarded[-1] == small[-1]
    assert len(forwarded) == 3


def test_force_with_nothing_to_fold_says_why(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    _, url = upstream
    proxy = start(url)
    one = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    r = post(proxy, one, "force-one", headers={"x-recap-compaction": "force"})
    assert r.headers["x-recap-compaction"] == "none"
    assert r.headers["x-recap-compaction-skipped"] == in_words("too_short")
    two = [*one, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    post(proxy, two, "force-two", headers={"x-recap-compaction": "force"})
    r = post(proxy, two, "force-two", headers={"x-recap-compaction": "force"})
    assert r.headers["x-recap-compaction-skipped"] == (
        "there is nothing before the current turn that is not already summarised"
    )
    assert r.headers["x-recap-compaction"] == "session"  # the stored summary still applies


def test_applying_a_stored_summary_is_reported_as_a_layer(
    upstream: tuple[SummarizerFake, str],
    start: Callable[..., str],
    tmp_path: Path,
    logs: LogCapture,
) -> None:
    fake, url = upstream
    proxy = start(url)
    messages = history()
    first = post(proxy, messages, "applied")
    assert first.headers["x-recap-compaction"] == "session"
    calls = len(fake.calls)
    # The next turn: below every threshold again, no summarizer call, but the stored
    # summary shortens what is sent. That is the session layer at work.
    later = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    r = post(proxy, later, "applied")
    assert len(fake.calls) == calls
    assert r.headers["x-recap-compaction"] == "session"
    assert r.headers["x-recap-summary-version"] == first.headers["x-recap-summary-version"]
    assert archived_layers(tmp_path, "applied", 2)[-1] == ["session"]
    line = logs.access(2)[-1]
    assert line["compactions"][0]["layer"] == "session"
    assert line["compactions"][0]["action"] == "applied"
    assert line["summary_version"] == int(r.headers["x-recap-summary-version"])
    # A line when the compaction started: conversation, layer, trigger.
    (started,) = [rec for rec in logs.records() if rec.get("msg") == "compaction started"]
    assert started["conversation"] == "applied"
    assert started["layer"] == "session"
    assert started["trigger"] in ("min_new_tokens", "context_ratio")


def test_outcomes_render_the_log_fields_by_their_names() -> None:
    outcomes = [
        CompactionOutcome(
            "session",
            "compacted",
            "context_ratio",
            version=3,
            covers=40,
            count=12,
            duration_ms=80,
            calls=2,
            summarizer_tokens_in=900,
            summarizer_tokens_out=120,
        ),
        CompactionOutcome("loop", "applied", covers=5, extra={"tool_rounds": 9}),
        CompactionOutcome("trim", "compacted", count=2, saved_chars=5000),
        CompactionOutcome("fit_to_window", "skipped"),
    ]
    fields: dict[str, Any] = log_fields(outcomes)
    assert layers(outcomes) == ["session", "loop", "trim"]
    assert fields["session_trigger"] == "context_ratio" and fields["session_batches"] == 2
    assert fields["summary_version"] == 3 and fields["summary_covers"] == 40
    assert fields["compacted_messages"] == 12 and "session_failure" not in fields
    assert fields["loop_rounds_summarised"] == 5 and fields["tool_rounds"] == 9
    assert fields["trimmed_results"] == 2 and fields["trimmed_chars_saved"] == 5000
    assert fields["summarizer_tokens_in"] == 900
    assert [c["action"] for c in fields["compactions"]] == [
        "compacted",
        "applied",
        "compacted",
        "skipped",
    ]
