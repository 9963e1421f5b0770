"""Claude Code's compaction requests at the Messages route, through real servers: answered
from Recap's summary (the anthropic SDK reads the answer), or left to the upstream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from proxy.app import create_app
from proxy.planning.claude_code import OPENING
from proxy.planning.framing import FRAME_OPEN
from tests.claude_code_bodies import FOCUSED_PROMPT, auto, manual
from tests.conftest import LogCapture
from tests.fake_messages import Answer, FakeMessages
from tests.faults import MODEL, compacting_config
from tests.messages_history import TOOLS, tool_loop
from tests.servers import serve

SESSION = {"x-claude-code-session-id": "cc-session-1"}


@pytest.fixture
def fake() -> FakeMessages:
    return FakeMessages(strict=False)


@pytest.fixture
def recap(fake: FakeMessages, tmp_path: Path) -> Iterator[str]:
    with serve(fake.app) as up, serve(create_app(compacting_config(up, tmp_path))) as url:
        yield url


def ask(url: str, messages: list[Any], **extra: Any) -> Any:
    c = anthropic.Anthropic(
        base_url=url, api_key="sk-client", max_retries=0, default_headers=SESSION
    )
    return c.messages.with_raw_response.create(
        model=MODEL, max_tokens=4000, system="You are Claude Code.", tools=TOOLS,
        messages=messages, **extra,
    )  # fmt: skip


def upstream_prompts(fake: FakeMessages) -> list[Any]:
    return [r for r in fake.message_requests() if OPENING.encode() in r.body]


def test_a_manual_compaction_is_answered_from_recaps_summary(
    recap: str, fake: FakeMessages, logs: LogCapture
) -> None:
    raw = ask(recap, manual(tool_loop(6)))
    text = raw.parse().content[0].text
    assert text.startswith("<summary>\n") and text.endswith("\n</summary>") and FRAME_OPEN in text
    assert upstream_prompts(fake) == [] and fake.message_requests() == []
    (summary,) = fake.message_requests("summarize")
    # The client's own key, where its SDK put it (this SDK: a Bearer token).
    assert summary.headers["anthropic-version"] == "2023-06-01"
    assert summary.headers["authorization"] == "Bearer sk-client"
    (line,) = [x for x in logs.access(1) if x["path"] == "/v1/messages"]
    assert line["remote_compaction"] == "claude_code" and line["conversation"] == "cc-session-1"
    assert line["remote_compaction_version"] == 1 and line["remote_compaction_reused"] is False
    # Asked again (Claude Code asks once more when the answer has no tags): the same version.
    again = ask(recap, manual(tool_loop(6)))
    assert again.parse().content[0].text == text
    assert len(fake.message_requests("summarize")) == 1


def test_an_auto_compaction_stream_is_answered_with_progress_then_events(
    recap: str, fake: FakeMessages
) -> None:
    history = [*tool_loop(6), {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}]
    body = {"model": MODEL, "max_tokens": 4000, "messages": auto(history), "stream": True}
    with httpx.stream("POST", f"{recap}/v1/messages", json=body, headers=SESSION, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == ": recap compacting"
    events = [line for line in lines if line.startswith("event:")]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    c = anthropic.Anthropic(
        base_url=recap, api_key="sk-client", max_retries=0, default_headers=SESSION
    )
    with c.messages.stream(model=MODEL, max_tokens=4000, messages=auto(history)) as stream:
        final = stream.get_final_message()
    assert FRAME_OPEN in final.content[0].text  # type: ignore[union-attr]
    assert upstream_prompts(fake) == []


def test_a_compaction_with_the_users_own_focus_goes_to_the_upstream(
    recap: str, fake: FakeMessages
) -> None:
    fake.respond = lambda body: Answer(text="<summary>the upstream's</summary>")
    raw = ask(recap, manual(tool_loop(6), FOCUSED_PROMPT))
    assert raw.parse().content[0].text == "<summary>the upstream's</summary>"
    assert len(upstream_prompts(fake)) == 1


def test_a_summary_recap_cannot_make_is_left_to_the_upstream(
    recap: str, fake: FakeMessages, logs: LogCapture
) -> None:
    fake.summarize_messages = lambda body: Answer(status=500)
    fake.respond = lambda body: Answer(text="<summary>the upstream's</summary>")
    raw = ask(recap, manual(tool_loop(6)))
    assert raw.parse().content[0].text == "<summary>the upstream's</summary>"
    assert len(upstream_prompts(fake)) == 1
    # Streamed, the stream opened by the progress comment goes on with the upstream's events.
    body = {"model": MODEL, "max_tokens": 4000, "messages": manual(tool_loop(6)), "stream": True}
    with httpx.stream("POST", f"{recap}/v1/messages", json=body, headers=SESSION, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == ": recap compacting" and lines[-2] == "event: message_stop"
    remote = [x.get("remote_compaction") for x in logs.access(2) if x["path"] == "/v1/messages"]
    assert remote == ["claude_code_upstream", "claude_code_upstream"]


def test_a_passthrough_tenant_leaves_it_to_the_upstream(fake: FakeMessages, tmp_path: Path) -> None:
    with serve(fake.app) as up:
        config = compacting_config(
            up,
            tmp_path,
            tenants={
                "t": {"upstream": {"base_url": up + "/v1"}, "remote_compaction": "passthrough"}
            },
        )
        with serve(create_app(config)) as url:
            ask(url, manual(tool_loop(6)))
    assert len(upstream_prompts(fake)) == 1 and fake.message_requests("summarize") == []
