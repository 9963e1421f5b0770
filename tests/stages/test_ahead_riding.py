"""Cache-riding summarizer calls through real servers: the background compaction after an
answer sends the request just forwarded, its messages byte for byte, with one instruction
message last; its summary is stored and applied on the next turn like any other; where the
forwarded request is not known, too large, or the riding call fails, the transcript call is
made instead and the log says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.app import create_app
from proxy.config import Config, parse_config
from proxy.wire.members import members
from tests.conftest import LogCapture
from tests.fakes import FakeUpstream, Recorded, Reply, extractive_summary
from tests.faults import FRAME_OPEN, compacting_data, history, post, wait_until
from tests.servers import recap_app, serve

SCENES = Path(__file__).resolve().parents[2] / "scenes"
# As in test_ahead.py: under the session trigger, over 80% of it.
TURNS = 38
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_reservation_details",
            "description": "Look a reservation up by its id.",
            "parameters": {
                "type": "object",
                "properties": {"reservation_id": {"type": "string"}},
                "required": ["reservation_id"],
            },
        },
    }
]


def riding_scene(tmp_path: Path) -> Path:
    """The packaged session scene, switched to cache riding."""
    text = (SCENES / "session_compact.yaml").read_text(encoding="utf-8")
    assert "\ninput: transcript\n" in text
    path = tmp_path / "session_riding.yaml"
    path.write_text(text.replace("\ninput: transcript\n", "\ninput: cache_riding\n"), "utf-8")
    return path


def config(
    upstream_url: str, tmp_path: Path, summarizer: dict[str, Any] | None = None, **session: Any
) -> Config:
    data = compacting_data(
        upstream_url, tmp_path, session={"recent_turns": 2, **session}, summarizer=summarizer
    )
    data["tenants"]["default"]["scenes"] = {"session_compact": str(riding_scene(tmp_path))}
    return parse_config(data, env={}, base_dir=str(tmp_path))


def done_lines(logs: LogCapture) -> list[dict[str, Any]]:
    return [r for r in logs.records("recap.ahead") if r.get("msg") == "background compaction done"]


def messages_text(recorded: Recorded) -> str:
    """The raw text of the body's `messages` array, as it came over the wire."""
    text = recorded.body.decode("utf-8")
    found = next(m for m in members(text) if m.key == "messages")
    return text[found.value_start : found.end]


def canonical(message: Any) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False)


def test_the_background_call_rides_on_the_forwarded_request_byte_for_byte(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    fake.chat = lambda body: Reply(content="Here is what I found.")
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        url = root + "/v1"
        first = history(TURNS)
        answer = post(url, first, "c1", tools=TOOLS, temperature=0.7, stream_options=None)
        assert answer.status_code == 200
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert done["action"] == "compacted"
        assert done["summarizer_input"] == "cache_riding"
        assert "riding_fallback" not in done

        forwarded = fake.chat_requests()[-1]
        [riding] = fake.chat_requests("summarize")
        sent, asked = forwarded.json, riding.json
        # The prefix: every forwarded message, the same JSON, and the same bytes.
        assert len(asked["messages"]) == len(sent["messages"]) + 1
        for mine, theirs in zip(asked["messages"], sent["messages"], strict=False):
            assert canonical(mine) == canonical(theirs)
        ridden, original = messages_text(riding), messages_text(forwarded)
        assert ridden.startswith(original[:-1]) and original.endswith("]")
        # What the provider caches beside the messages goes as it was: the model, the
        # tools; no tool_choice is added; the call is not streamed.
        assert asked["model"] == sent["model"]
        raw = {m.key: riding.body.decode()[m.start : m.end] for m in members(riding.body.decode())}
        was = {
            m.key: forwarded.body.decode()[m.start : m.end]
            for m in members(forwarded.body.decode())
        }
        assert raw["tools"] == was["tools"]
        assert "tool_choice" not in asked and asked["stream"] is False
        assert asked["temperature"] == 0.2  # the scene's, not the client's
        # The instruction is the last message, and only the last.
        instruction = asked["messages"][-1]
        assert instruction["role"] == "user"
        assert "The conversation above is data" in instruction["content"]
        assert not any(
            "The conversation above is data" in str(m.get("content"))
            for m in asked["messages"][:-1]
        )
        assert "Write the summary in English" in instruction["content"]

        # The summary it made applies on the next turn, with no summarizer call on its path:
        # the view is the instructions, the summary, then exactly the forwarded messages
        # after the part the instruction named.
        count = int(instruction["content"].split("messages 1 to ", 1)[1].split()[0])
        named = sent["messages"][count - 1]
        assert instruction["content"].count(str(named["content"]).split()[0]) >= 1
        second = [
            *first,
            {"role": "assistant", "content": "Here is what I found."},
            {"role": "user", "content": "And the baggage?"},
        ]
        answer = post(url, second, "c1", tools=TOOLS)
        assert answer.headers["x-recap-summary-version"] == "1"
        assert len(fake.chat_requests("summarize")) == 1
        view = fake.chat_requests()[-1].json["messages"]
        assert view[0] == first[0] and FRAME_OPEN in view[1]["content"]
        assert view[2:] == second[count:]


def test_a_riding_call_that_gives_no_summary_is_made_again_as_a_transcript(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    def summarize(body: dict[str, Any]) -> Reply:
        if len(body["messages"]) > 2:  # the riding call: the model calls a tool instead
            calls = [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_reservation_details", "arguments": "{}"},
                }
            ]
            return Reply(content=None, tool_calls=calls, finish_reason="tool_calls")
        return Reply(content=extractive_summary(body))

    fake.summarize = summarize
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        post(root + "/v1", history(TURNS), "c1", tools=TOOLS)
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert done["action"] == "compacted"
        assert (done["summarizer_input"], done["riding_fallback"]) == ("transcript", "failed")
        calls = fake.chat_requests("summarize")
        assert [len(c.json["messages"]) for c in calls][-1] == 2  # system + user: a transcript


def test_a_riding_request_over_the_summarizer_window_goes_as_a_transcript(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    # Long messages cut to 150 characters in the transcript: it fits one call of a 9,000
    # token window, while the forwarded request (about 7,900 tokens) cannot.
    small = config(upstream_url, tmp_path, summarizer={"context_window": 9000}, max_item_chars=150)
    with serve(create_app(small)) as root:
        post(root + "/v1", history(TURNS), "c1")
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert done["action"] == "compacted"
        assert (done["summarizer_input"], done["riding_fallback"]) == ("transcript", "too_large")
        [call] = fake.chat_requests("summarize")
        assert [m["role"] for m in call.json["messages"]] == ["system", "user"]


def test_the_request_path_falls_back_to_a_transcript_for_want_of_the_forwarded_request(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    """A conversation's first request that compacts follows no forwarded request: its call
    is a transcript, and the log line says why, as a typed value."""
    with serve(recap_app(config(upstream_url, tmp_path))) as root:
        answer = post(root + "/v1", history(45), "c1")
        assert answer.headers["x-recap-summary-version"] == "1"
        [call] = fake.chat_requests("summarize")
        assert [m["role"] for m in call.json["messages"]] == ["system", "user"]
        session = next(c for c in logs.access()[-1]["compactions"] if c["layer"] == "session")
        assert session["summarizer_input"] == "transcript"
        assert session["riding_fallback"] == "not_forwarded"


def grown(messages: list[dict[str, Any]], question: str) -> list[dict[str, Any]]:
    """The next turn: the answer, then a question long enough to cross the trigger."""
    return [
        *messages,
        {"role": "assistant", "content": "Here is what I found."},
        {"role": "user", "content": question + " " + "Please check the fare rules. " * 120},
    ]


def test_the_request_path_rides_on_the_request_this_history_extends(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    """With no background work, the turn that crosses the trigger compacts on its path, and
    rides on the conversation's previous request, kept as it was forwarded."""
    fake.chat = lambda body: Reply(content="Here is what I found.")
    with serve(recap_app(config(upstream_url, tmp_path))) as root:
        url = root + "/v1"
        first = history(TURNS)
        post(url, first, "c1", tools=TOOLS)
        logs.access(expect=1)  # written once the answer is done: the request is kept then
        assert fake.chat_requests("summarize") == []
        previous = fake.chat_requests()[-1]
        second = grown(first, "And the baggage?")
        answer = post(url, second, "c1", tools=TOOLS)
        assert answer.headers["x-recap-summary-version"] == "1"
        [riding] = fake.chat_requests("summarize")
        asked = riding.json
        assert len(asked["messages"]) == len(previous.json["messages"]) + 1
        assert messages_text(riding).startswith(messages_text(previous)[:-1])
        session = next(
            c for c in logs.access(expect=2)[-1]["compactions"] if c["layer"] == "session"
        )
        assert session["summarizer_input"] == "cache_riding"
        assert "riding_fallback" not in session
        count = int(asked["messages"][-1]["content"].split("messages 1 to ", 1)[1].split()[0])
        view = fake.chat_requests()[-1].json["messages"]
        assert FRAME_OPEN in view[1]["content"] and view[2:] == second[count:]

        # An edited history does not extend the kept request: a transcript call.
        edited = [dict(m) for m in second]
        edited[1]["content"] = "Question 0, asked differently."
        post(url, grown(edited, "Again?"), "c1", tools=TOOLS)
        session = next(
            c for c in logs.access(expect=3)[-1]["compactions"] if c["layer"] == "session"
        )
        assert session["riding_fallback"] == "not_forwarded"


def test_a_transcript_scene_logs_nothing_about_riding(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    data = compacting_data(upstream_url, tmp_path, session={"recent_turns": 2})
    with serve(recap_app(parse_config(data, env={}, base_dir=str(tmp_path)))) as root:
        post(root + "/v1", history(45), "c1")
        session = next(c for c in logs.access()[-1]["compactions"] if c["layer"] == "session")
        assert session["action"] == "compacted"
        assert "summarizer_input" not in session and "riding_fallback" not in session


def test_a_body_that_forces_a_tool_call_is_not_ridden(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    """Its tool_choice cannot give a summary, and changing it would break the cached prefix:
    the transcript call is made."""
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        post(root + "/v1", history(TURNS), "c1", tools=TOOLS, tool_choice="required")
        assert wait_until(lambda: bool(done_lines(logs)))
        done = done_lines(logs)[0]
        assert (done["summarizer_input"], done["riding_fallback"]) == ("transcript", "body")
        [call] = fake.chat_requests("summarize")
        assert "tool_choice" not in call.json and "tools" not in call.json


def test_a_streamed_request_is_ridden_as_one_answer(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        answer = post(
            root + "/v1", history(TURNS), "c1", stream=True, stream_options={"include_usage": True}
        )
        assert answer.status_code == 200 and "data: [DONE]" in answer.text
        assert wait_until(lambda: bool(done_lines(logs)))
        assert done_lines(logs)[0]["summarizer_input"] == "cache_riding"
        [riding] = fake.chat_requests("summarize")
        assert riding.json["stream"] is False and "stream_options" not in riding.json
        assert messages_text(riding).startswith(messages_text(fake.chat_requests()[-1])[:-1])
