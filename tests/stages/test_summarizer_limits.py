"""The summarizer's own limits, end to end (issue 15.2-3): what a small, slow model needs.

Through real servers: the proxy, and the fake upstream whose summarizer side a test
scripts (tests/faults.py). Each test here failed before its change: a summary cut by
`finish_reason: length` failed the compaction at once; a summary's `max_tokens` was the
scene's 2048 whatever `max_summary_chars` said; session batches and loop inputs were
bounded by message counts only, so 200 messages of 4,000 characters went to a 16k model
in one call.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.history.tokens import TokenCounter
from tests.conftest import LogCapture
from tests.faults import (
    MODEL,
    SUMMARY,
    Answer,
    SummarizerFake,
    audit_rows,
    history,
    post,
    summaries_in,
)

COUNTER = TokenCounter()
RETRY_TEXT = "Your previous answer was too long"
# A summary cut in its third section: the first two are complete.
CUT = (
    "<summary>\n## User Goal\nChange flight R00042.\n## Confirmed Facts\n"
    "Passenger Ana, gold member.\n## Decisions Made\nRebook on HAT1"
)


def scripted(*answers: Answer) -> Callable[[dict[str, Any]], Answer]:
    """Answer summarizer calls in order; the last answer repeats."""
    queue = list(answers)
    return lambda body: queue.pop(0) if len(queue) > 1 else queue[0]


def prompt_tokens(body: dict[str, Any]) -> int:
    return sum(COUNTER.count_text(m["content"], MODEL) for m in body["messages"])


def test_a_summary_cut_by_length_is_asked_for_again_shorter(
    upstream: tuple[SummarizerFake, str],
    start: Callable[..., str],
    logs: LogCapture,
    tmp_path: Path,
) -> None:
    fake, url = upstream
    fake.answer = scripted(Answer(content=CUT, finish_reason="length"), Answer(content=SUMMARY))
    proxy = start(url, session={"max_summary_chars": 2000})
    r = post(proxy, history(), "cut-once")
    assert r.status_code == 200
    assert r.headers["x-recap-compaction"] == "session"
    first, second = (c.body for c in fake.calls)
    # The second try is the first prompt (its instructions, after the data, with the halved
    # target too), then the tighter instruction, half the target.
    asked = first["messages"][1]["content"]
    assert RETRY_TEXT not in asked
    retry = second["messages"][1]["content"]
    assert retry.startswith(asked.replace("within 1500 characters", "within 750 characters"))
    assert RETRY_TEXT in retry and "at most 750 characters" in retry  # 75% of 2000, halved
    assert "do not copy tool output" in retry
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    (i,) = summaries_in(forwarded)
    assert "Change a flight." in forwarded[i]["content"]
    line = logs.access()[-1]
    assert line["summarizer_length_retries"] == 1 and "summaries_salvaged" not in line
    (session,) = [c for c in line["compactions"] if c["layer"] == "session"]
    assert session["length_retries"] == 1
    (row,) = audit_rows(tmp_path, "cut-once")
    assert (row["outcome"], row["detail"]) == ("ok", "after a length retry")


def test_a_summary_over_max_summary_chars_is_asked_for_again_shorter(
    upstream: tuple[SummarizerFake, str],
    start: Callable[..., str],
    logs: LogCapture,
    tmp_path: Path,
) -> None:
    """A model that stops on its own past the character target (the 1.5B model on a τ-bench
    chain) gets the same second try as one cut by its token limit, instead of a failure."""
    fake, url = upstream
    wordy = "<summary>\n## User Goal\n" + "Change flight R00042, as said before. " * 60
    fake.answer = scripted(Answer(content=wordy + "</summary>"), Answer(content=SUMMARY))
    proxy = start(url, session={"max_summary_chars": 1000})
    r = post(proxy, history(), "too-long-once")
    assert r.headers["x-recap-compaction"] == "session"
    first, second = (c.body for c in fake.calls)
    assert RETRY_TEXT not in first["messages"][1]["content"]
    assert RETRY_TEXT in second["messages"][1]["content"]
    assert logs.access()[-1]["summarizer_length_retries"] == 1
    (row,) = audit_rows(tmp_path, "too-long-once")
    assert (row["outcome"], row["detail"]) == ("ok", "after a length retry")


def test_a_retry_cut_too_keeps_its_complete_sections(
    upstream: tuple[SummarizerFake, str],
    start: Callable[..., str],
    logs: LogCapture,
    tmp_path: Path,
) -> None:
    fake, url = upstream
    fake.answer = scripted(Answer(content=CUT, finish_reason="length"))
    proxy = start(url)
    r = post(proxy, history(), "cut-twice")
    assert r.headers["x-recap-compaction"] == "session"
    assert fake.count() == 2
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    (i,) = summaries_in(forwarded)
    summary = forwarded[i]["content"]
    # The two complete sections, not the one the cut fell in.
    assert "Change flight R00042." in summary and "Passenger Ana, gold member." in summary
    assert "Decisions Made" not in summary and "HAT1" not in summary
    line = logs.access()[-1]
    assert line["summarizer_length_retries"] == 1 and line["summaries_salvaged"] == 1
    (row,) = audit_rows(tmp_path, "cut-twice")
    assert row["detail"] == "after a length retry, complete sections kept"


def test_a_retry_still_too_long_keeps_the_whole_sections_that_fit(
    upstream: tuple[SummarizerFake, str],
    start: Callable[..., str],
    logs: LogCapture,
    tmp_path: Path,
) -> None:
    """The 1.5B model's loop summary: cut, then a second answer that stops on its own but is
    over max_summary_chars. Its first sections stand in for it; the compaction does not fail."""
    fake, url = upstream
    long = (
        "<summary>\n## User Goal\nChange flight R00042.\n## Confirmed Facts\n"
        "Passenger Ana, gold member.\n## Progress\n" + "copied tool output\n" * 80 + "</summary>"
    )
    fake.answer = scripted(
        Answer(content=CUT, finish_reason="length"), Answer(content=long, finish_reason="stop")
    )
    proxy = start(url, session={"max_summary_chars": 600})
    r = post(proxy, history(), "long-twice")
    assert r.headers["x-recap-compaction"] == "session"
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    (i,) = summaries_in(forwarded)
    summary = forwarded[i]["content"]
    assert "Change flight R00042." in summary and "Passenger Ana, gold member." in summary
    assert "copied tool output" not in summary
    assert logs.access()[-1]["summaries_salvaged"] == 1
    (row,) = audit_rows(tmp_path, "long-twice")
    assert (row["outcome"], row["detail"]) == ("ok", "after a length retry, complete sections kept")


def test_a_retry_that_fails_otherwise_fails_the_compaction_and_says_it_retried(
    upstream: tuple[SummarizerFake, str],
    start: Callable[..., str],
    logs: LogCapture,
    tmp_path: Path,
) -> None:
    fake, url = upstream
    fake.answer = scripted(Answer(content=CUT, finish_reason="length"), Answer(status=500))
    proxy = start(url)
    r = post(proxy, history(), "cut-then-500")
    assert r.headers["x-recap-compaction"] == "failed"
    line = logs.access()[-1]
    assert line["session_failure"] == "upstream status 500"
    assert line["summarizer_length_retries"] == 1
    assert fake.count() == 2
    (row,) = audit_rows(tmp_path, "cut-then-500")
    assert row["detail"] == "upstream status 500 (after a length retry)"


def test_max_tokens_follows_max_summary_chars_the_language_and_the_window(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    fake, url = upstream
    # 1,200 characters at 3 a token, +20%, +64: 544 tokens, not the scene's 2048.
    proxy = start(url, session={"max_summary_chars": 1200})
    post(proxy, history(), "english")
    assert fake.calls[-1].body["max_tokens"] == 544
    # Chinese: a character a token: 1,200 x 1.2 + 64.
    chinese = [
        {**m, "content": "请帮我改签航班，申请先别提交。" * 40}
        if m["role"] == "user" and isinstance(m.get("content"), str)
        else m
        for m in history()
    ]
    post(proxy, chinese, "chinese")
    assert fake.calls[-1].body["max_tokens"] == 1504
    # The default 6,000 characters would want 2,464: the scene's max_tokens caps it...
    proxy = start(url)
    post(proxy, history(), "default")
    assert fake.calls[-1].body["max_tokens"] == 2048
    # ...and half the summarizer's window does.
    proxy = start(url, summarizer={"context_window": 3000})
    post(proxy, history(), "small-window")
    assert fake.calls[-1].body["max_tokens"] == 1500


def _text(rng: random.Random, chars: int) -> str:
    words = ["flight", "R00042", "refund", "seat", "12A", "gate", "baggage", "2026-05-01"]
    out = " ".join(rng.choice(words) for _ in range(chars // 4))
    return out[:chars]


def test_session_batches_fit_the_summarizer_window(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    """200 messages of 4,000 characters went to a 16k model in one call."""
    fake, url = upstream
    rng = random.Random(7)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for i in range(100):
        messages.append({"role": "user", "content": f"Q{i} " + _text(rng, 4000)})
        messages.append({"role": "assistant", "content": f"A{i} " + _text(rng, 4000)})
    messages.append({"role": "user", "content": "And now?"})
    proxy = start(
        url,
        session={"max_rounds_per_request": 100},
        models={MODEL: {"context_window": 1_000_000}},
    )
    r = post(proxy, messages, "big-batches", headers={"x-recap-compaction": "force"}, timeout=60)
    assert r.headers["x-recap-compaction"] == "session"
    assert len(fake.calls) > 1
    for call in fake.calls:
        assert prompt_tokens(call.body) + call.body["max_tokens"] <= 16384
    # Every message before the current one is folded, in calls that follow one another.
    line = logs.access()[-1]
    assert line["session_batches"] == len(fake.calls)
    assert line["compacted_messages"] == 200
    # A later call holds the summary so far, and still fits.
    assert "<existing_summary>" in fake.calls[-1].body["messages"][1]["content"]


def test_a_message_too_large_for_any_call_is_sent_shortened(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    fake, url = upstream
    fake.answer = lambda body: Answer(content=SUMMARY)
    rng = random.Random(3)
    messages = history()
    # One message of ~60,000 characters in a 4,096-token summarizer with items uncut.
    messages[3] = {"role": "user", "content": "HEAD-MARK " + _text(rng, 60_000) + " TAIL-MARK"}
    proxy = start(
        url,
        session={"max_item_chars": 100_000, "max_summary_chars": 1200},
        summarizer={"context_window": 4096},
        models={MODEL: {"context_window": 1_000_000}},
    )
    r = post(proxy, messages, "huge-item", headers={"x-recap-compaction": "force"})
    assert r.headers["x-recap-compaction"] == "session"
    for call in fake.calls:
        assert prompt_tokens(call.body) + call.body["max_tokens"] <= 4096
    text = "".join(c.body["messages"][1]["content"] for c in fake.calls)
    # Head and tail of the message kept, its middle cut (and said so).
    assert "HEAD-MARK" in text and "TAIL-MARK" in text and "chars omitted]" in text


def test_loop_rounds_fit_the_summarizer_window(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    fake, url = upstream
    rng = random.Random(5)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing build."},
    ]
    for n in range(11):
        call_id = f"call_{n}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "shell", "arguments": json.dumps({"cmd": f"m {n}"})},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, 3000)})
    proxy = start(
        url,
        session={"max_summary_chars": 1200},
        summarizer={"context_window": 4096},
        models={MODEL: {"context_window": 1_000_000}},
    )
    post(proxy, messages, "loop-window")
    (call,) = fake.calls
    assert prompt_tokens(call.body) + call.body["max_tokens"] <= 4096
    line = logs.access()[-1]
    # Six rounds were due (11 less the 5 kept); fewer fit one call, the rest wait.
    assert 0 < line["loop_rounds_compacted"] < 6
