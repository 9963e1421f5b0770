"""Nothing lost silently (issue 12.2), end to end: small windows, pinned instructions,
and a last-resort fit that says how many messages it dropped and why."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes import FakeUpstream, Reply
from tests.invariant import assert_nothing_lost

WINDOW = 6000
SUMMARY_MARK = "<recap-summary>"


def start(proxy_factory: Callable[..., str], upstream_url: str, **compaction: Any) -> str:
    return proxy_factory(
        models={"small": {"context_window": WINDOW}},
        tenants={
            "default": {
                "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 30},
                "compaction": compaction,
            }
        },
    )


def post(url: str, messages: list[dict[str, Any]], key: str) -> Any:
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="small",
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-conversation-id": key},
    )


def tool_round(i: int, chars: int) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
    text = f"step {i} found:\n" + "\n".join(
        f"match {i}.{k}: value {k * i}" for k in range(chars // 20)
    )
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": text},
    ]


def test_small_window_loop_summarises_before_anything_is_dropped(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    # The defaults, on a 6,000-token window: loop_trigger_tokens (96,000) is capped at
    # half the window, so rounds are summarised long before the fit would drop any.
    url = start(proxy_factory, upstream_url)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a code search agent."},
        {"role": "user", "content": "Find every caller of parse_config."},
    ]
    for i in range(16):
        history += tool_round(i, 1200)
        r = post(url, history, "small-loop")
        forwarded = fake.chat_requests()[-1].json["messages"]
        dropped = assert_nothing_lost(
            tmp_path / "recap.db", "default", "small-loop", history, forwarded, r.headers
        )
        assert dropped == 0, (i, r.headers.get("x-recap-dropped-reason"))
    assert fake.chat_requests("summarize")
    assert "<recap-summary>" in json.dumps(forwarded)


def test_mid_conversation_instructions_stay_in_place(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    url = start(
        proxy_factory,
        upstream_url,
        session={"min_new_tokens": 500, "recent_turns": 1, "min_saving_tokens": 1},
    )
    policy = {"role": "developer", "content": "POLICY-7: never book red-eye flights."}
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are an airline agent."}]
    for i in range(12):
        history.append({"role": "user", "content": f"Question {i}: " + "details " * 200})
        if i == 1:
            history.append(policy)
        history.append({"role": "assistant", "content": f"Answer {i}: " + "words " * 200})
    history.append({"role": "user", "content": "So which flight?"})
    r = post(url, history, "pinned")
    assert r.headers["x-recap-compaction"] == "session"
    forwarded = fake.chat_requests()[-1].json["messages"]
    assert_nothing_lost(tmp_path / "recap.db", "default", "pinned", history, forwarded, r.headers)
    # The developer message is forwarded as sent, right after the summary, and the
    # summarizer never saw it as history to fold.
    assert forwarded[2] == policy
    assert all("POLICY-7" not in rec.body.decode() for rec in fake.chat_requests("summarize"))


def test_fit_says_how_many_it_dropped_and_why(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    url = start(proxy_factory, upstream_url, trim={"enabled": False})
    fake.summarize = lambda body: Reply(status=500)
    history: list[dict[str, Any]] = []
    for i in range(30):
        history.append({"role": "user", "content": f"Question {i}: " + "details " * 120})
        history.append({"role": "assistant", "content": f"Answer {i}: " + "words " * 120})
    history.append({"role": "user", "content": "And now?"})
    r = post(url, history, "fit")
    assert r.headers["x-recap-compaction"] == "failed"
    dropped = int(r.headers["x-recap-dropped-messages"])
    assert dropped > 0
    assert (
        r.headers["x-recap-dropped-reason"]
        == "a summary failed, so the history could not be folded"
    )
    forwarded = fake.chat_requests()[-1].json["messages"]
    assert len(forwarded) == len(history) - dropped
    assert_nothing_lost(tmp_path / "recap.db", "default", "fit", history, forwarded, r.headers)
    assert json.dumps(forwarded[-1]) == json.dumps(history[-1])


def test_a_tool_loop_after_short_turns_folds_them_instead_of_dropping_them(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    """τ-bench's shape: short turns below every trigger, then one tool loop whose few large
    results take the request over the window. The turns before it go into a session summary
    (trigger over_window), not out of the request; the running turn goes whole (trimming
    and loop working memory, which would shorten it, have their own tests)."""
    url = start(proxy_factory, upstream_url, trim={"enabled": False}, loop={"enabled": False})
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are an airline agent."}]
    for i in range(8):
        history.append({"role": "user", "content": f"Question {i}: my card is card_{i}00{i}. "})
        history.append({"role": "assistant", "content": f"Noted card_{i}00{i} " + "ok " * 200})
    history.append({"role": "user", "content": "Book the flight with the first card."})
    start_of_turn = len(history)
    r = post(url, history, "tau-shape")
    assert "x-recap-dropped-messages" not in r.headers
    for i in range(8):
        # ~520 tokens a round: over the window (less the answer's 600) from the 7th on,
        # with the turns before; the running turn alone stays within it.
        history += tool_round(i, 1000)
        r = post(url, history, "tau-shape")
        forwarded = fake.chat_requests()[-1].json["messages"]
        assert_nothing_lost(
            tmp_path / "recap.db", "default", "tau-shape", history, forwarded, r.headers
        )
        assert "x-recap-dropped-messages" not in r.headers, (i, r.headers)
    assert "session" in r.headers["x-recap-compaction"]
    # The summary stands for every turn before the running one, which goes as it came.
    assert forwarded[0] == history[0] and SUMMARY_MARK in forwarded[1]["content"]
    assert forwarded[2:] == history[start_of_turn - 1 :]
    (row,) = fake.chat_requests("summarize")
    assert "card_0000" in row.body.decode()


@pytest.mark.parametrize("words", [90, 120])
def test_a_long_chat_on_a_small_window_folds_instead_of_dropping(
    proxy_factory: Callable[..., str],
    upstream_url: str,
    fake: FakeUpstream,
    tmp_path: Path,
    words: int,
) -> None:
    """A 40-turn chat on a 5,300-token window: whenever the view is over the room, the session
    summary folds more turns; the last resort never drops one. The stored summary goes up in its
    frame (about 130 tokens of framing text): a planner that counted it bare let through views
    the frame put over the room, and the fit then dropped a user turn and its answer (turn 39
    with 90 words a message, turn 28 with 120, before the fix)."""
    url = proxy_factory(
        models={"small": {"context_window": 5300}},
        tenants={
            "default": {
                "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 30},
                "compaction": {"trim": {"enabled": False}},
            }
        },
    )
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent."}]
    drops: list[tuple[int, str | None]] = []
    for i in range(40):
        history.append({"role": "user", "content": f"Question {i}: " + "details " * words})
        r = post(url, history, "band")
        forwarded = fake.chat_requests()[-1].json["messages"]
        dropped = assert_nothing_lost(
            tmp_path / "recap.db", "default", "band", history, forwarded, r.headers
        )
        if dropped:
            drops.append((i, r.headers.get("x-recap-dropped-reason")))
        history.append({"role": "assistant", "content": f"Answer {i}: " + "words " * words})
    assert fake.chat_requests("summarize")
    assert drops == []
