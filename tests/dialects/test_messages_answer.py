"""Reading a Messages answer as it is relayed: JSON and Anthropic's typed SSE events."""

from __future__ import annotations

import json
from typing import Any

from proxy.dialects.messages_answer import MESSAGES_SUMMARY, MessagesRecorder, prompt_tokens
from tests.fake_messages import Answer, FakeMessages, stream_events

USAGE = {
    "input_tokens": 12,
    "cache_creation_input_tokens": 30,
    "cache_read_input_tokens": 900,
    "output_tokens": 7,
}


def message(answer: Answer) -> dict[str, Any]:
    return FakeMessages()._message({"model": "claude-x"}, answer, 12, 900, 30)


def sse(msg: dict[str, Any], *, ping_comments: bool = False) -> bytes:
    out = b""
    for kind, data in stream_events(msg):
        if ping_comments:
            out += b": keepalive\n\n"
        out += f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
    return out


def test_a_stream_is_rebuilt_block_by_block() -> None:
    msg = message(
        Answer(text="Reading the file now.", thinking="plan", calls=[("Read", {"p": "a"})])
    )
    raw = sse(msg, ping_comments=True)
    recorder = MessagesRecorder(streamed=True)
    for i in range(0, len(raw), 17):  # in pieces, as they arrive
        recorder.feed(raw[i : i + 17])
    got = recorder.result()
    assert got["message"]["recap_blocks"] == msg["content"]
    assert got["message"]["content"] == "Reading the file now."
    call = got["message"]["tool_calls"][0]
    assert call["function"]["name"] == "Read" and json.loads(call["function"]["arguments"]) == {
        "p": "a"
    }
    assert got["finish_reason"] == "tool_use" and got["model"] == "claude-x"
    assert got["usage"] == USAGE and prompt_tokens(got["usage"]) == 942


def test_a_json_answer_is_read_whole() -> None:
    msg = message(Answer(text="Hi."))
    recorder = MessagesRecorder(streamed=False)
    recorder.feed(json.dumps(msg).encode())
    got = recorder.result()
    assert got["message"]["content"] == "Hi." and got["usage"] == USAGE
    assert got["finish_reason"] == "end_turn"


def test_an_error_event_is_kept() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    raw = (
        sse(message(Answer(text="partial")))[:200]
        + b"event: error\ndata: "
        + json.dumps(error).encode()
        + b"\n\n"
    )
    recorder = MessagesRecorder(streamed=True)
    recorder.feed(raw)
    assert recorder.result()["error"] == error["error"]


def test_past_its_limit_the_copy_is_marked_truncated() -> None:
    recorder = MessagesRecorder(streamed=True, limit=100)
    recorder.feed(sse(message(Answer(text="x" * 500))))
    assert recorder.result() == {"message": None, "truncated": True, "unparsed": True}


def test_a_summary_answer_with_thinking_first_is_its_text() -> None:
    answer = {
        "type": "message",
        "model": "claude-x",
        "content": [
            {"type": "thinking", "thinking": "Let me list the facts.", "signature": "sig"},
            {"type": "text", "text": "<summary>x</summary>"},
        ],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 900, "output_tokens": 40},
    }
    read = MESSAGES_SUMMARY.answer(answer)
    assert (read.text, read.finish, read.input_tokens, read.output_tokens) == (
        "<summary>x</summary>",
        "stop",
        910,
        40,
    )
    assert MESSAGES_SUMMARY.answer({**answer, "stop_reason": "max_tokens"}).finish == "length"
