"""POST /v1/messages through real servers: the official anthropic SDK as the client, a fake
Messages upstream that rejects any request Anthropic would reject (tests/fake_messages.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from proxy.app import create_app
from proxy.dialects.messages import MAX_BREAKPOINTS, cache_breakpoints
from proxy.planning.framing import FRAME_OPEN
from tests.conftest import LogCapture, make_config
from tests.fake_messages import Answer, FakeMessages, error_body
from tests.faults import MODEL, compacting_config, history
from tests.messages_history import EPHEMERAL, TOOLS, from_chat, mark_last, tool_loop
from tests.servers import serve

THINKING = {"type": "enabled", "budget_tokens": 2000}


@pytest.fixture
def fake() -> FakeMessages:
    return FakeMessages()


@pytest.fixture
def upstream(fake: FakeMessages) -> Iterator[str]:
    with serve(fake.app) as url:
        yield url


@pytest.fixture
def plain(upstream: str, tmp_path: Path) -> Iterator[str]:
    with serve(create_app(make_config(upstream, tmp_path))) as url:
        yield url


@pytest.fixture
def compacting(upstream: str, tmp_path: Path) -> Iterator[Callable[..., str]]:
    servers: list[Any] = []

    def start(**kwargs: Any) -> str:
        cm = serve(create_app(compacting_config(upstream, tmp_path, **kwargs)))
        servers.append(cm)
        return str(cm.__enter__())

    yield start
    for cm in reversed(servers):
        cm.__exit__(None, None, None)


def client(url: str, key: str = "sk-client", **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url, api_key=key, max_retries=0, default_headers=headers, timeout=60
    )


def conversation(turns: int = 45, marker: str = "") -> tuple[list[Any], list[Any]]:
    return from_chat(history(turns, marker=marker))


def test_unchanged_request_goes_up_as_the_very_bytes(plain: str, fake: FakeMessages) -> None:
    body = {
        "model": "claude-x",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}],
        "messages": [{"role": "user", "content": "Say hello."}],
        "thinking": THINKING,
        "metadata": {"user_id": "u-1"},
    }
    raw = json.dumps(body, indent=1).encode()  # odd spacing: only a forwarded body keeps it
    r = httpx.post(
        f"{plain}/v1/messages?beta=true",
        content=raw,
        headers={"content-type": "application/json", "x-api-key": "sk-client"},
    )
    assert r.status_code == 200 and r.headers["x-recap-compaction"] == "none"
    (sent,) = fake.message_requests()
    assert sent.body == raw and sent.headers["x-api-key"] == "sk-client"
    # The SDK's own request: thinking comes back signed, usage as the upstream said.
    answer = client(plain).messages.create(
        model="claude-x", max_tokens=100, messages=[{"role": "user", "content": "Hi."}]
    )
    assert answer.content[0].type == "text" and answer.usage.input_tokens > 0
    assert fake.problems == []


def test_a_stream_is_relayed_event_by_event(plain: str, fake: FakeMessages) -> None:
    fake.respond = lambda body: Answer(
        text="Reading it now.",
        thinking="I should read a.py.",
        calls=[("read_file", {"path": "a.py"})],
    )
    with client(plain).messages.stream(
        model="claude-x",
        max_tokens=3000,
        thinking=THINKING,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Read a.py."}],
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"path": "a.py"}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_long_conversation_is_compacted_and_its_cached_prefix_holds(
    compacting: Callable[..., str], fake: FakeMessages, logs: LogCapture, stream: bool
) -> None:
    url = compacting()
    system, messages = conversation(marker=f"s{stream}")
    c = client(url, **{"x-claude-code-session-id": f"long-{stream}"})

    def ask(history: list[Any]) -> Any:
        kwargs: dict[str, Any] = dict(
            model=MODEL, max_tokens=1000, system=system, tools=TOOLS, messages=history,
            thinking=THINKING,
        )  # fmt: skip
        if not stream:
            return c.messages.with_raw_response.create(**kwargs)
        with c.messages.with_streaming_response.create(stream=True, **kwargs) as r:
            r.read()
            return r

    raw = ask(messages)
    if not stream:  # a stream's headers went out with its first progress comment
        assert "session" in raw.headers["x-recap-compaction"]
        assert int(raw.headers["x-recap-tokens-after"]) < int(raw.headers["x-recap-tokens-before"])
    assert fake.problems == []
    (sent,) = fake.message_requests()
    forwarded = sent.json
    # tools and the client's system go up as sent; the summary is a block after them.
    assert forwarded["tools"] == TOOLS and forwarded["system"][:1] == system
    assert len(forwarded["system"]) == 2 and FRAME_OPEN in forwarded["system"][1]["text"]
    # The recent window is the client's messages as sent, in order, ending where it ended.
    tail = forwarded["messages"]
    assert len(tail) < len(messages) and messages[len(messages) - len(tail) :] == tail
    assert cache_breakpoints(forwarded) == cache_breakpoints(
        {"system": system, "messages": messages}
    )
    assert cache_breakpoints(forwarded) <= MAX_BREAKPOINTS
    (line,) = [x for x in logs.access(1) if x["path"] == "/v1/messages"]
    assert line["conversation"] == f"long-{stream}" and line["classification"] == "turn_start"
    assert {"layer": "session", "action": "compacted"}.items() <= line["compactions"][0].items()
    # The next turn reuses the stored summary: the same prefix, so the cache reads it.
    more = mark_last(
        [
            *messages,
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "One more."},
        ]
    )
    ask(more)
    second = fake.message_requests()[-1].json
    assert second["system"] == forwarded["system"] and fake.problems == []
    assert second["messages"][: len(tail) - 1] == tail[:-1]


def test_a_long_tool_loop_with_thinking_stays_valid_streamed_and_not(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    url = compacting(loop={"loop_trigger_tool_rounds": 3, "loop_recent_tool_rounds": 3})
    n = iter(range(10_000))
    fake.respond = lambda body: Answer(
        text="Next file.", thinking="Read on.", calls=[("read_file", {"path": f"m{next(n)}.py"})]
    )
    c = client(url, **{"x-claude-code-session-id": "loop-1"})
    history: list[dict[str, Any]] = [{"role": "user", "content": "Review every module."}]
    for step in range(14):
        kwargs: dict[str, Any] = dict(
            model=MODEL, max_tokens=1000, tools=TOOLS, thinking=THINKING,
            messages=mark_last(history),
        )  # fmt: skip
        if step % 2:
            with c.messages.stream(**kwargs) as s:
                answer = s.get_final_message()
        else:
            answer = c.messages.create(**kwargs)
        blocks = [b.model_dump(exclude_none=True) for b in answer.content]
        history.append({"role": "assistant", "content": blocks})
        (use,) = [b for b in blocks if b["type"] == "tool_use"]
        rows = "\n".join(f"line {j}: value_{step}_{j}" for j in range(40))
        history.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": rows}],
            }
        )
    assert fake.problems == []
    last = fake.message_requests()[-1].json["messages"]
    assert len(last) < len(history)
    # The turn's user message, with the working summary joined to it, then raw rounds.
    first = last[0]["content"]
    assert (
        first[0] == {"type": "text", "text": "Review every module."}
        and FRAME_OPEN in first[1]["text"]
    )
    assert all(m["content"][0]["type"] == "thinking" for m in last[1:] if m["role"] == "assistant")


def test_a_user_summary_role_merges_the_summary_into_the_first_user_message(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    url = compacting(session={"summary_role": "user"})
    system, messages = conversation(marker="u")
    client(url).messages.create(model=MODEL, max_tokens=1000, system=system, messages=messages)
    assert fake.problems == []
    forwarded = fake.message_requests()[-1].json
    assert forwarded["system"] == system
    first = forwarded["messages"][0]
    assert first["role"] == "user" and FRAME_OPEN in first["content"][0]["text"]


def test_a_compacting_stream_sends_progress_comments_then_the_events(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    url = compacting()
    system, messages = conversation(marker="p")
    body = {
        "model": MODEL,
        "max_tokens": 500,
        "system": system,
        "messages": messages,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert ": recap compacting" in lines
    events = [line for line in lines if line.startswith("event:")]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    assert lines.index(": recap compacting") < lines.index(events[0])
    # And the SDK reads such a stream (comments and all).
    system, messages = conversation(marker="p2")
    with client(url).messages.stream(
        model=MODEL, max_tokens=500, system=system, messages=messages
    ) as stream:
        assert stream.get_final_message().content[0].type == "text"


def test_an_upstream_error_after_progress_comments_is_an_error_event(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    url = compacting()
    fake.respond = lambda body: Answer(
        status=529, error=error_body("Overloaded", "overloaded_error")
    )
    system, messages = conversation(marker="e")
    body = {
        "model": MODEL,
        "max_tokens": 500,
        "system": system,
        "messages": messages,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert ": recap compacting" in lines and lines[-2] == "event: error"
    assert json.loads(lines[-1].removeprefix("data: ")) == error_body(
        "Overloaded", "overloaded_error"
    )
    system, messages = conversation(marker="e2")
    with pytest.raises(anthropic.APIStatusError, match="Overloaded"):  # noqa: SIM117
        with client(url).messages.stream(
            model=MODEL, max_tokens=500, system=system, messages=messages
        ) as stream:
            for _ in stream:
                pass


def test_recaps_own_errors_are_in_anthropics_shape(upstream: str, tmp_path: Path) -> None:
    config = make_config(
        upstream,
        tmp_path,
        tenants={"a": {"api_keys": ["key-a"], "upstream": {"base_url": "http://127.0.0.1:9/v1"}}},
    )
    with serve(create_app(config)) as url:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            client(url, key="wrong").messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": "Hi."}]
            )
        assert denied.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Invalid proxy API key."},
        }
        # The upstream cannot be reached: a 502 the SDK reads as an API error of its own.
        r = httpx.post(
            f"{url}/v1/messages",
            json={"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "Hi."}]},
            headers={"x-api-key": "key-a"},
        )
        assert r.status_code == 502 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "api_error"
        # The count_tokens pass-through answers in the same shape.
        r = httpx.post(f"{url}/v1/messages/count_tokens", json={}, headers={"x-api-key": "nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_upstream_prompt_too_long_is_recovered_by_compacting_harder(
    compacting: Callable[..., str], fake: FakeMessages, logs: LogCapture
) -> None:
    url = compacting()
    limit = 6000

    def respond(body: dict[str, Any]) -> Answer:
        n = fake.count(json.dumps(body["messages"])) + fake.count(json.dumps(body.get("system")))
        if n > limit:
            message = f"prompt is too long: {n} tokens > {limit} maximum"
            return Answer(status=400, error=error_body(message))
        return Answer(text="Fits now.")

    fake.respond = respond
    system, messages = conversation(30, marker="o")
    raw = client(url, **{"x-claude-code-session-id": "over-1"}).messages.with_raw_response.create(
        model=MODEL, max_tokens=500, system=system, messages=messages
    )
    assert raw.parse().content[0].text == "Fits now."  # type: ignore[union-attr]
    assert raw.headers["x-recap-overflow-retry"] == "1"
    assert fake.problems == []
    (line,) = [x for x in logs.access(1) if x["path"] == "/v1/messages"]
    assert line["overflow_retry"] is True and line["overflow_limit"] == limit


def test_keys_go_where_the_messages_api_carries_them(
    upstream: str, tmp_path: Path, fake: FakeMessages
) -> None:
    """A proxy key in x-api-key (Claude Code's ANTHROPIC_API_KEY) or as a Bearer token picks
    the tenant; the upstream gets the tenant's own key as x-api-key, on the chat call, the
    summarizer's Messages call and the count_tokens pass-through, and never the proxy key."""
    config = compacting_config(
        upstream,
        tmp_path,
        tenants={
            "a": {
                "api_keys": ["proxy-key-a"],
                "upstream": {"base_url": upstream + "/v1", "api_key": "sk-ant-real"},
                "compaction": {"session": {"min_saving_tokens": 500}, "trim": {"enabled": False}},
                "summarizer": {"quality_guard": False},
            }
        },
    )
    with serve(create_app(config)) as url:
        system, messages = conversation(marker="k")
        r = httpx.post(
            f"{url}/v1/messages",
            json={"model": MODEL, "max_tokens": 500, "system": system, "messages": messages},
            headers={"x-api-key": "proxy-key-a", "anthropic-version": "2023-06-01"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert "session" in r.headers["x-recap-compaction"]
        client(url, key="proxy-key-a").messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi."}]
        )
    summary = fake.message_requests("summarize")
    assert summary and all(s.path == "/v1/messages" for s in summary)
    assert summary[0].headers["anthropic-version"] == "2023-06-01"
    for rec in fake.requests:
        assert rec.headers.get("x-api-key") == "sk-ant-real", rec.path
        assert "authorization" not in rec.headers and "proxy-key-a" not in json.dumps(rec.headers)
    assert fake.chat_requests("summarize") == []  # asked in the request's own API
    assert [r.path for r in fake.requests].count("/v1/messages/count_tokens") == 1


def test_conversation_keys_from_claude_codes_header_and_the_body(
    plain: str, logs: LogCapture
) -> None:
    c = client(plain)
    hi = [{"role": "user", "content": "Hi."}]
    c.messages.create(model="m", max_tokens=9, messages=hi,
                      extra_headers={"x-claude-code-session-id": "cc-1"})  # fmt: skip
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-2"})
    c.messages.create(model="m", max_tokens=9, messages=hi, metadata={"user_id": user_id})
    c.messages.create(model="m", max_tokens=9, messages=hi, metadata={"user_id": "user-3"})
    c.messages.create(model="m", max_tokens=9, messages=hi, system="S.")
    keys = [x["conversation"] for x in logs.access(4) if x["path"] == "/v1/messages"]
    assert keys[:3] == ["cc-1", "cc-2", "user-3"] and keys[3].startswith("auto-")


def test_cached_prompt_tokens_calibrate_the_budget(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    """The upstream counts three times what Recap does, and serves most of the prompt from
    its cache: `input_tokens` alone is a few tokens; with the cache's counts it says so."""
    fake.count = lambda text: 3 * max(1, len(text) // 4)
    url = compacting()
    c = client(url)
    system, messages = conversation(8, marker="c1")
    first = c.messages.with_raw_response.create(
        model=MODEL, max_tokens=500, system=system, messages=messages,
        extra_headers={"x-claude-code-session-id": "cal-a"},
    )  # fmt: skip
    assert first.headers["x-recap-compaction"] == "none"
    usage = first.parse().usage
    assert usage.input_tokens < usage.cache_creation_input_tokens  # type: ignore[operator]
    system, messages = conversation(20, marker="c2")
    second = c.messages.with_raw_response.create(
        model=MODEL, max_tokens=500, system=system, messages=messages,
        extra_headers={"x-claude-code-session-id": "cal-b"},
    )  # fmt: skip
    assert "session" in second.headers["x-recap-compaction"]
    assert fake.problems == []


def test_the_same_history_is_not_compacted_without_that_usage(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    # The control for the test above: an upstream counting as Recap does.
    url = compacting()
    system, messages = conversation(20, marker="c2")
    raw = client(url).messages.with_raw_response.create(
        model=MODEL, max_tokens=500, system=system, messages=messages,
        extra_headers={"x-claude-code-session-id": "cal-c"},
    )  # fmt: skip
    assert raw.headers["x-recap-compaction"] == "none"


def test_a_body_it_cannot_read_is_forwarded_and_logged(
    plain: str, fake: FakeMessages, logs: LogCapture
) -> None:
    raw = b'{"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}'
    r = httpx.post(
        f"{plain}/v1/messages", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["type"] == "error"  # the upstream's own answer
    assert fake.requests[-1].body == raw
    (line,) = [x for x in logs.access(1) if x["path"] == "/v1/messages"]
    assert line["passthrough"] == "bad_item"


def test_a_long_loop_of_large_results_is_trimmed_with_placeholders(
    upstream: str, tmp_path: Path, fake: FakeMessages
) -> None:
    tenant = {
        "upstream": {"base_url": upstream + "/v1"},
        "compaction": {"session": {"enabled": False}, "loop": {"enabled": False}},
    }
    config = compacting_config(upstream, tmp_path, tenants={"t": tenant})
    history = tool_loop(12, result_chars=3000)
    body = {"model": MODEL, "max_tokens": 500, "tools": TOOLS, "messages": mark_last(history)}
    with serve(create_app(config)) as url:
        r = httpx.post(f"{url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert "trim" in r.headers["x-recap-compaction"] and fake.problems == []
    sent = fake.message_requests()[-1].json["messages"]
    results = [
        b for m in sent if m["role"] == "user" for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]  # fmt: skip
    trimmed = [b for b in results if "recap://message/" in str(b["content"])]
    assert trimmed and len(results) == 12
    assert all(b["tool_use_id"].startswith("toolu_loop_") for b in trimmed)
    # The newest rounds are the client's own; the last block keeps its breakpoint.
    assert sent[-4:] == mark_last(history)[-4:]
    assert sent[-1]["content"][-1]["cache_control"] == EPHEMERAL


def test_compact_now_on_a_messages_conversation_asks_in_the_messages_api(
    compacting: Callable[..., str], fake: FakeMessages
) -> None:
    """An operator's "Compact now" on a Claude Code conversation: the summarizer is asked in
    the Messages API, as the conversation's own requests were, not in Chat Completions (which
    an Anthropic-only upstream does not serve)."""
    url = compacting(
        admin_keys=["admin-key"],
        session={"min_new_tokens": 10**9, "trigger_ratio": 0.99, "recent_turns": 2},
    )
    system, messages = conversation(turns=30, marker="manual")
    c = client(url, **{"x-claude-code-session-id": "manual-1"})
    c.messages.create(model=MODEL, max_tokens=1000, system=system, messages=messages)
    assert fake.message_requests("summarize") == []  # nothing compacted on its own
    r = httpx.post(
        f"{url}/v1/recap/conversations/manual-1/compact",
        params={"tenant": "default"},
        headers={"authorization": "Bearer admin-key"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert [q for q in fake.requests if q.path == "/v1/chat/completions"] == []
    (asked,) = fake.message_requests("summarize")
    assert asked.json["model"] == MODEL and fake.problems == []
