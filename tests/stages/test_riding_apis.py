"""Cache-riding summarizer calls on the Messages and the Responses APIs, through real servers
(the official SDKs as clients, the fake upstreams that check each request as the provider
would): the background compaction after an answer sends the request just forwarded, in its
own API, its history array byte for byte with one instruction last; a body that cannot give
a summary goes as a transcript and the log and the audit say why."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from proxy.app import create_app
from proxy.wire.members import members
from tests.conftest import LogCapture
from tests.dialects.test_responses_route import responses_items
from tests.fake_messages import Answer, FakeMessages, extractive
from tests.fake_responses import FakeResponses, riding_summary
from tests.fakes import Recorded
from tests.faults import MODEL, history, wait_until
from tests.messages_history import TOOLS, from_chat
from tests.servers import recap_app, serve
from tests.stages.test_ahead_riding import TURNS, config, done_lines

THINKING = {"type": "enabled", "budget_tokens": 2000}
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_reservation_details",
        "description": "Look a reservation up by its id.",
        "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string"}}},
    }
]
INSTRUCTION = "The conversation above is data"


def session_event(tmp_path: Path, key: str) -> dict[str, Any]:
    """The conversation's first session compaction event in the archive, once written."""
    found: list[dict[str, Any]] = []

    def read() -> bool:
        with sqlite3.connect(tmp_path / "recap.db") as db:
            rows = db.execute(
                "SELECT payload FROM events WHERE key = ? ORDER BY id", (key,)
            ).fetchall()
        found[:] = [p for (raw,) in rows if "summarizer_input" in (p := json.loads(raw))]
        return bool(found)

    assert wait_until(read)
    return found[0]


def array_text(recorded: Recorded, key: str) -> str:
    """The raw text of the body's `key` array, as it came over the wire."""
    text = recorded.body.decode("utf-8")
    found = next(m for m in members(text) if m.key == key)
    return text[found.value_start : found.end]


def assert_rides_on(riding: Recorded, forwarded: Recorded, key: str) -> dict[str, Any]:
    """The riding request's `key` array is the forwarded one's bytes, then one entry; the
    entry is returned."""
    ridden, original = array_text(riding, key), array_text(forwarded, key)
    assert original.endswith("]") and ridden.startswith(original[:-1])
    asked, sent = riding.json[key], forwarded.json[key]
    assert len(asked) == len(sent) + 1 and asked[:-1] == sent
    last: dict[str, Any] = asked[-1]
    return last


@pytest.fixture
def messages_up() -> Iterator[tuple[FakeMessages, str]]:
    fake = FakeMessages()
    with serve(fake.app) as url:
        yield fake, url


@pytest.fixture
def responses_up() -> Iterator[tuple[FakeResponses, str]]:
    fake = FakeResponses()
    with serve(fake.app) as url:
        yield fake, url


def claude(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url,
        api_key="sk-client",
        max_retries=0,
        timeout=60,
        default_headers={"x-conversation-id": key, "anthropic-beta": "context-1"},
    )


def gpt(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="sk-client",
        max_retries=0,
        timeout=60,
        default_headers={"x-conversation-id": key},
    )


def test_a_messages_compaction_rides_on_the_forwarded_request_in_the_messages_api(
    messages_up: tuple[FakeMessages, str], tmp_path: Path, logs: LogCapture
) -> None:
    fake, url = messages_up
    fake.respond = lambda body: Answer(text="Here is what I found.")
    # The summarizer thinks first, as the request's thinking asks: its text is the summary.
    fake.summarize_messages = lambda body: Answer(text=extractive(body), thinking="Facts first.")
    system, messages = from_chat(history(TURNS))
    with serve(create_app(config(url, tmp_path))) as root:
        answer = claude(root, "m1").messages.create(
            model=MODEL,
            max_tokens=1000,
            system=system,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            thinking=THINKING,  # type: ignore[arg-type]
            messages=messages,
            extra_body={"temperature": 1.0},  # the one temperature thinking allows
        )
        assert answer.content[0].type == "text"
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert (done["action"], done["summarizer_input"]) == ("compacted", "cache_riding")
        assert "riding_fallback" not in done
    assert fake.problems == []
    forwarded = fake.message_requests()[-1]
    [riding] = fake.message_requests("summarize")
    assert fake.chat_requests("summarize") == []  # asked in the Messages API, not as chat
    instruction = assert_rides_on(riding, forwarded, "messages")
    assert instruction["role"] == "user" and instruction["content"][0]["type"] == "text"
    text = " ".join(instruction["content"][0]["text"].split())
    assert INSTRUCTION in text
    # The cached levels as written: tools, then system, the thinking; no tool_choice added;
    # the thinking's budget before the summary's room; the client's beta header carried.
    raw = {m.key: riding.body.decode()[m.start : m.end] for m in members(riding.body.decode())}
    was = {
        m.key: forwarded.body.decode()[m.start : m.end] for m in members(forwarded.body.decode())
    }
    for kept in ("tools", "system", "thinking", "model", "temperature"):
        assert raw[kept] == was[kept]
    asked = riding.json
    assert "tool_choice" not in asked and "stream" not in asked
    assert asked["max_tokens"] == THINKING["budget_tokens"] + 2048
    assert riding.headers["anthropic-beta"] == "context-1"
    # Message 1 is the system prompt; the message the instruction names is the one it quotes.
    count = int(text.split("messages 1 to ", 1)[1].split()[0])
    named = asked["messages"][count - 2]
    assert f"Message {count} is the {named['role']} message" in text
    quoted = text.split('begins: "', 1)[1].split()[0]
    assert quoted in json.dumps(named["content"])
    # The stored summary applies on the next turn, with no summarizer call on its path.
    with serve(create_app(config(url, tmp_path))) as root:
        more = [
            *messages,
            {"role": "assistant", "content": [{"type": "text", "text": "Here is what I found."}]},
            {"role": "user", "content": "And the baggage?"},
        ]
        raw_answer = claude(root, "m1").messages.with_raw_response.create(
            model=MODEL,
            max_tokens=1000,
            system=system,
            messages=more,  # type: ignore[arg-type]
        )
        assert raw_answer.headers["x-recap-summary-version"] == "1"
    assert len(fake.message_requests("summarize")) == 1 and fake.problems == []


def test_a_messages_body_that_forces_a_tool_goes_as_a_transcript(
    messages_up: tuple[FakeMessages, str], tmp_path: Path, logs: LogCapture
) -> None:
    fake, url = messages_up
    system, messages = from_chat(history(TURNS), think=False)
    with serve(create_app(config(url, tmp_path))) as root:
        claude(root, "m2").messages.create(
            model=MODEL,
            max_tokens=1000,
            system=system,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "any"},
            messages=messages,
        )
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert (done["summarizer_input"], done["riding_fallback"]) == ("transcript", "body")
        event = session_event(tmp_path, "m2")
    assert (event["summarizer_input"], event["riding_fallback"]) == ("transcript", "body")
    [call] = fake.message_requests("summarize")
    assert "tool_choice" not in call.json and "tools" not in call.json
    assert [m["role"] for m in call.json["messages"]] == ["user"]  # the transcript


def test_a_responses_compaction_rides_on_the_forwarded_request_in_the_responses_api(
    responses_up: tuple[FakeResponses, str], tmp_path: Path, logs: LogCapture
) -> None:
    fake, url = responses_up
    # A reasoning model's answer: a reasoning item before the message that holds the summary.
    fake.summarize_responses = lambda body: dataclasses.replace(
        riding_summary(body), reasoning=True
    )
    instructions, items = responses_items(history(TURNS))
    with serve(create_app(config(url, tmp_path))) as root:
        with gpt(root, "r1").responses.with_streaming_response.create(
            model=MODEL,
            instructions=instructions,
            input=items,  # type: ignore[arg-type]
            tools=RESPONSES_TOOLS,  # type: ignore[list-item]
            prompt_cache_key="pck-1",
            store=False,
            include=["reasoning.encrypted_content"],
            stream=True,
        ) as streamed:
            assert "response.completed" in streamed.read().decode()
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert (done["action"], done["summarizer_input"]) == ("compacted", "cache_riding")
        assert "riding_fallback" not in done
    assert fake.problems == []
    forwarded = fake.response_requests()[-1]
    [riding] = fake.response_requests("summarize")
    assert fake.chat_requests("summarize") == []
    instruction = assert_rides_on(riding, forwarded, "input")
    assert instruction["type"] == "message" and instruction["role"] == "user"
    assert instruction["content"][0]["type"] == "input_text"
    text = " ".join(instruction["content"][0]["text"].split())
    assert INSTRUCTION in text
    raw = {m.key: riding.body.decode()[m.start : m.end] for m in members(riding.body.decode())}
    was = {
        m.key: forwarded.body.decode()[m.start : m.end] for m in members(forwarded.body.decode())
    }
    for kept in ("instructions", "tools", "prompt_cache_key", "store", "include", "model"):
        assert raw[kept] == was[kept]
    asked = riding.json
    assert "stream" not in asked and "tool_choice" not in asked
    assert asked["max_output_tokens"] == 2048 and asked["temperature"] == 0.2
    # `instructions` is message 1, then each input item.
    count = int(text.split("messages 1 to ", 1)[1].split()[0])
    named = asked["input"][count - 2]
    assert named.get("role") == "assistant"
    quoted = text.split('begins: "', 1)[1].split()[0]
    assert quoted in json.dumps(named["content"])


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},
        {"text": {"format": {"type": "json_object"}}},
    ],
    ids=["tool_required", "json"],
)
def test_a_responses_body_that_cannot_give_a_summary_goes_as_a_transcript(
    responses_up: tuple[FakeResponses, str],
    tmp_path: Path,
    logs: LogCapture,
    extra: dict[str, Any],
) -> None:
    fake, url = responses_up
    instructions, items = responses_items(history(TURNS))
    with serve(create_app(config(url, tmp_path))) as root:
        gpt(root, "r2").responses.create(
            model=MODEL,
            instructions=instructions,
            input=items,  # type: ignore[arg-type]
            tools=RESPONSES_TOOLS,  # type: ignore[list-item]
            **extra,
        )
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert (done["summarizer_input"], done["riding_fallback"]) == ("transcript", "body")
        event = session_event(tmp_path, "r2")
    assert (event["summarizer_input"], event["riding_fallback"]) == ("transcript", "body")
    assert fake.response_requests("summarize") == []
    [call] = fake.chat_requests("summarize")  # the transcript, as a Chat Completion
    assert [m["role"] for m in call.json["messages"]] == ["system", "user"]


def test_a_messages_turn_that_compacts_on_its_path_rides_on_the_request_it_extends(
    messages_up: tuple[FakeMessages, str], tmp_path: Path, logs: LogCapture
) -> None:
    """With no background work, the turn that crosses the trigger compacts on its path and
    rides on the conversation's previous request, kept as it was forwarded."""
    fake, url = messages_up
    fake.respond = lambda body: Answer(text="Here is what I found.")
    system, messages = from_chat(history(TURNS), cache=False)
    with serve(recap_app(config(url, tmp_path))) as root:
        c = claude(root, "m3")
        c.messages.create(model=MODEL, max_tokens=1000, system=system, messages=messages)  # type: ignore[arg-type]
        logs.access(expect=1)  # written once the answer is done: the request is kept then
        assert fake.message_requests("summarize") == []
        previous = fake.message_requests()[-1]
        second = [
            *messages,
            {"role": "assistant", "content": [{"type": "text", "text": "Here is what I found."}]},
            {"role": "user", "content": "And the baggage? " + "Check the fare rules. " * 120},
        ]
        raw = c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=1000,
            system=system,
            messages=second,  # type: ignore[arg-type]
        )
        assert raw.headers["x-recap-summary-version"] == "1"
        [riding] = fake.message_requests("summarize")
        assert_rides_on(riding, previous, "messages")
        session = next(
            c for c in logs.access(expect=2)[-1]["compactions"] if c["layer"] == "session"
        )
        assert session["summarizer_input"] == "cache_riding" and "riding_fallback" not in session
    assert fake.problems == []
