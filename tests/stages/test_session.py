"""Session rolling summaries end to end: real servers, the openai SDK, real trajectories."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.history.conversation import check_history
from proxy.history.tokens import TokenCounter
from tests.fakes import FakeUpstream, Reply
from tests.invariant import assert_nothing_lost
from tests.trajectories import DATA, chained, model_calls, sessions

pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")

WINDOW = 12000
SUMMARY_MARK = "<recap-summary>"


@pytest.fixture
def small_proxy(proxy_factory: Callable[..., str], upstream_url: str) -> Callable[..., str]:
    def start(summarizer: dict[str, Any] | None = None, **session: Any) -> str:
        return proxy_factory(
            models={"small": {"context_window": WINDOW}},
            tenants={
                "default": {
                    "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 30},
                    # Trimming changes older messages as rounds age; it has its own tests.
                    "compaction": {
                        "session": {"min_saving_tokens": 500, **session},
                        "trim": {"enabled": False},
                    },
                    "summarizer": summarizer or {},
                }
            },
        )

    return start


def long_conversation() -> list[dict[str, Any]]:
    rows = sessions()
    return chained(rows[:6])


def replay(
    url: str,
    messages: list[dict[str, Any]],
    key: str,
    on_step: Callable[[int, httpx.Response], None] | None = None,
) -> int:
    steps = 0
    with httpx.Client(timeout=60) as client:
        for i in model_calls(messages):
            if messages[i - 1]["role"] != "user":
                continue  # session compaction acts at turn start; tool steps are the loop layer's
            r = client.post(
                f"{url}/chat/completions",
                json={"model": "small", "messages": messages[:i]},
                headers={"x-conversation-id": key},
            )
            assert r.status_code == 200, r.text
            steps += 1
            if on_step:
                on_step(i, r)
    return steps


def is_summary(m: dict[str, Any]) -> bool:
    return isinstance(m.get("content"), str) and SUMMARY_MARK in m["content"]


def test_long_conversation_replayed_turn_by_turn(
    small_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = small_proxy()
    convo = long_conversation()
    counter = TokenCounter()
    headers_seen: list[str] = []
    replay(
        url,
        convo,
        "long-1",
        lambda i, r: headers_seen.append(r.headers.get("x-recap-compaction", "")),
    )
    sent = fake.chat_requests()
    summaries = fake.chat_requests("summarize")
    assert len(summaries) >= 2, "the conversation should compact at least twice"
    assert "session" in headers_seen
    pinned = convo[0]
    compacted_steps = 0
    for rec in sent:
        msgs = rec.json["messages"]
        assert check_history(msgs) == [], check_history(msgs)
        assert msgs[0] == pinned  # the pinned system prompt, first and unchanged
        if any(is_summary(m) for m in msgs):
            compacted_steps += 1
            assert is_summary(msgs[1]) and msgs[1]["role"] == "system"
            assert sum(is_summary(m) for m in msgs) == 1
        assert counter.count_messages(msgs, "small") <= WINDOW
        assert msgs[-1]["role"] == "user"
    assert compacted_steps > len(sent) // 3
    # The second compaction's input contains the first summary (rolling, not from scratch).
    first = summaries[0]
    answer = fake.summarize(first.json).content or ""
    first_summary = answer.split("<summary>")[1].split("</summary>")[0].strip()
    assert first_summary.splitlines()[1] in summaries[1].json["messages"][1]["content"]


def test_prefix_byte_identical_between_compactions(
    small_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = small_proxy()
    convo = long_conversation()
    replay(url, convo, "cache-1")
    sent = [r.json["messages"] for r in fake.chat_requests()]
    pairs = 0
    for prev, cur in itertools.pairwise(sent):
        # Between compactions the previous request is a strict prefix of the next (plus new
        # messages), byte for byte once serialised as the proxy sends it.
        if any(is_summary(m) for m in prev) and prev[1] == cur[1]:
            assert json.dumps(cur[: len(prev)]) == json.dumps(prev)
            pairs += 1
    assert pairs >= 3


def test_summarizer_failures_fall_back(small_proxy: Callable[..., str], fake: FakeUpstream) -> None:
    convo = long_conversation()
    failures = [
        Reply(status=500),
        Reply(content=""),
        Reply(content="<summary>cut off", finish_reason="length"),
        Reply(content="<summary>too late</summary>", delay_s=3),  # over the timeout below
    ]
    calls: list[int] = []

    def failing(body: dict[str, Any]) -> Reply:
        calls.append(1)
        return failures[(len(calls) - 1) % len(failures)]

    fake.summarize = failing
    url = small_proxy(summarizer={"timeout_s": 1}, failure_threshold=100)
    results: list[str] = []
    replay(
        url, convo, "fail-1", lambda i, r: results.append(r.headers.get("x-recap-compaction", ""))
    )
    assert len(calls) >= 4
    assert "failed" in results
    for rec in fake.chat_requests():
        msgs = rec.json["messages"]
        assert not any(is_summary(m) for m in msgs)  # never a summary that failed


def test_concurrent_requests_one_summarizer_call(
    small_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = small_proxy()
    convo = long_conversation()
    # Find the first turn-start step that compacts, using a throwaway conversation.
    steps = [i for i in model_calls(convo) if convo[i - 1]["role"] == "user"]
    fake.summarize = lambda body: Reply(
        content="<summary>\n## User Goal\nslow summary\n</summary>", delay_s=0.5
    )
    target = None
    probe_calls = 0
    for i in steps:
        calls_before = len(fake.chat_requests("summarize"))
        r = httpx.post(
            f"{url}/chat/completions",
            json={"model": "small", "messages": convo[:i]},
            headers={"x-conversation-id": "probe"},
            timeout=60,
        )
        if r.headers.get("x-recap-compaction") == "session":
            target = i
            probe_calls = len(fake.chat_requests("summarize")) - calls_before
            break
    assert target is not None
    before = len(fake.chat_requests("summarize"))
    codes: list[int] = []

    def send() -> None:
        r = httpx.post(
            f"{url}/chat/completions",
            json={"model": "small", "messages": convo[:target]},
            headers={"x-conversation-id": "race"},
            timeout=60,
        )
        codes.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 4
    # Four concurrent requests cost exactly what one request alone cost: the others
    # waited for the compaction and reused it.
    assert probe_calls >= 1
    assert len(fake.chat_requests("summarize")) - before == probe_calls
    last4 = [r.json["messages"] for r in fake.chat_requests()[-4:]]
    assert all(is_summary(m[1]) for m in last4)


def test_edited_history_never_gets_summary_of_messages_it_lacks(
    small_proxy: Callable[..., str], fake: FakeUpstream, tmp_path: Path
) -> None:
    url = small_proxy()
    convo = long_conversation()
    replay(url, convo, "edit-1")
    last_sent = fake.chat_requests()[-1].json["messages"]
    assert is_summary(last_sent[1])
    old_summaries = [m["content"] for m in last_sent if is_summary(m)]
    # The client edits its first user message and re-sends the whole history, with
    # compaction on (issue 12.8: with it off the session stage never ran).
    edited = [dict(m) for m in convo[: list(model_calls(convo))[-1]]]
    first_user = next(i for i, m in enumerate(edited) if m["role"] == "user")
    original = edited[first_user]["content"]
    edited[first_user]["content"] = "I changed my mind about everything."
    asked_before = len(fake.chat_requests("summarize"))
    r = httpx.post(
        f"{url}/chat/completions",
        json={"model": "small", "messages": edited},
        headers={"x-conversation-id": "edit-1"},
        timeout=60,
    )
    assert r.status_code == 200
    sent = fake.chat_requests()[-1].json["messages"]
    # No summary of the original history stands in for the edited one; a summary, if
    # any, is one recorded for exactly this history, made from the edited text.
    assert not any(m.get("content") in old_summaries for m in sent)
    assert_nothing_lost(tmp_path / "recap.db", "default", "edit-1", edited, sent, r.headers)
    if any(is_summary(m) for m in sent):
        # Made from the edited history: the summarizer was given the edited text, and never
        # the original (the summary is recorded for it: assert_nothing_lost).
        asked = [json.dumps(c.json) for c in fake.chat_requests("summarize")[asked_before:]]
        assert any("I changed my mind about everything." in a for a in asked)
        assert not any(json.dumps(original)[1:-1] in a for a in asked)


def test_off_header_and_openai_sdk(small_proxy: Callable[..., str], fake: FakeUpstream) -> None:
    url = small_proxy()
    convo = long_conversation()
    replay(url, convo, "sdk-1")
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    i = list(model_calls(convo))[-1]
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=convo[:i], extra_headers={"x-conversation-id": "sdk-1"}
    )
    assert raw.headers["x-recap-compaction"] in ("session", "none")
    assert int(raw.headers["x-recap-tokens-after"]) < int(raw.headers["x-recap-tokens-before"])
    assert is_summary(fake.chat_requests()[-1].json["messages"][1])
    client.chat.completions.create(
        model="small",
        messages=convo[:i],
        extra_headers={"x-conversation-id": "sdk-1", "x-recap-compaction": "off"},
    )
    assert fake.chat_requests()[-1].json["messages"] == convo[:i]


def test_stream_sends_progress_comments_then_the_answer(
    small_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = small_proxy()
    convo = long_conversation()
    steps = [i for i in model_calls(convo) if convo[i - 1]["role"] == "user"]
    fake.summarize = lambda body: Reply(
        content="<summary>\n## User Goal\nx\n</summary>", delay_s=0.3
    )
    seen_comment = False
    for i in steps:
        with httpx.stream(
            "POST",
            f"{url}/chat/completions",
            timeout=60,
            json={"model": "small", "messages": convo[:i], "stream": True},
            headers={"x-conversation-id": "stream-1"},
        ) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        if ": recap compacting" in lines:
            seen_comment = True
            (done,) = [line for line in lines if line.startswith(": recap compacted")]
            assert lines.index(": recap compacting") < lines.index(done)
            data = [line for line in lines if line.startswith("data:")]
            assert data[-1] == "data: [DONE]"
            assert lines.index(done) < lines.index(data[0])
            break
    assert seen_comment
    # The SDK ignores the comments and reads the answer as usual.
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    stream = client.chat.completions.create(
        model="small",
        messages=convo[: steps[-1]],
        stream=True,
        extra_headers={"x-conversation-id": "stream-2"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()


def test_chinese_conversation_summary_framed_in_chinese(
    small_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = small_proxy(recent_turns=2, min_new_messages=4, min_compact_messages=4)
    history: list[dict[str, Any]] = [{"role": "system", "content": "你是一个乐于助人的助手。"}]
    for n in range(30):
        history.append(
            {
                "role": "user",
                "content": f"第{n}个问题:请帮我检查订单 ORD-{1000 + n} 的物流状态。"
                + "详细说明。" * 150,
            }
        )
        history.append(
            {
                "role": "assistant",
                "content": f"订单 ORD-{1000 + n} 已发货,预计三天内送达。" + "补充信息。" * 150,
            }
        )
    history.append({"role": "user", "content": "现在请总结一下所有订单。"})
    r = httpx.post(
        f"{url}/chat/completions",
        json={"model": "small", "messages": history},
        headers={"x-conversation-id": "zh-1"},
        timeout=60,
    )
    assert r.headers["x-recap-compaction"] == "session"
    (call,) = fake.chat_requests("summarize")[:1]
    assert "Chinese" in call.json["messages"][0]["content"] + call.json["messages"][1]["content"]
    sent = fake.chat_requests()[-1].json["messages"]
    assert is_summary(sent[1])
    assert "对话" in sent[1]["content"] or "摘要" in sent[1]["content"]


def test_the_summary_is_in_the_users_language_when_the_agent_writes_english(
    small_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    """Issue 23.26: three of every four messages are the agent's and its tool's, in
    English; the user writes Chinese, so the summary (and its frame) is Chinese."""
    url = small_proxy(recent_turns=2, min_new_messages=4, min_compact_messages=4)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a support agent."}]
    for n in range(30):
        call = {
            "id": f"call_{n}",
            "type": "function",
            "function": {"name": "get_order", "arguments": json.dumps({"id": f"ORD-{1000 + n}"})},
        }
        history += [
            {"role": "user", "content": f"第{n}个问题：请帮我查一下订单 ORD-{1000 + n} 的物流。"},
            {"role": "assistant", "content": "Let me look the order up.", "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": f"call_{n}",
                "content": "Order shipped by courier, tracking updated. " * 40,
            },
            {"role": "assistant", "content": "The order has shipped and arrives soon. " * 40},
        ]
    history.append({"role": "user", "content": "现在请总结一下所有订单。"})
    r = httpx.post(
        f"{url}/chat/completions",
        json={"model": "small", "messages": history},
        headers={"x-conversation-id": "zh-user-en-agent"},
        timeout=60,
    )
    assert r.headers["x-recap-compaction"] == "session"
    call_body = fake.chat_requests("summarize")[0].json
    assert "Write the summary in Chinese" in call_body["messages"][1]["content"]
    sent = fake.chat_requests()[-1].json["messages"]
    assert is_summary(sent[1]) and sent[1]["content"].startswith("本对话是之前一段对话的延续")
