"""The Responses answer recorder: what the archive keeps of a streamed answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.dialects.responses_answer import RESPONSES_SUMMARY, ResponsesRecorder

pytestmark = pytest.mark.quick


def sse(*events: dict[str, Any], tail: bytes = b"") -> bytes:
    out = b"".join(
        b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in events
    )
    return out + tail


FINAL = {
    "id": "resp_1",
    "status": "completed",
    "model": "m",
    "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hello there"}]}],
    "usage": {"input_tokens": 7, "output_tokens": 2},
}
EVENTS = (
    {"type": "response.created", "response": {**FINAL, "status": "in_progress", "output": []}},
    {"type": "response.output_text.delta", "delta": "Hello"},
    {"type": "response.output_text.delta", "delta": " there"},
    {"type": "response.output_item.done", "item": FINAL["output"][0]},
)


def recorded(body: bytes, chunk: int = 7) -> dict[str, Any]:
    recorder = ResponsesRecorder(streamed=True)
    for i in range(0, len(body), chunk):
        recorder.feed(body[i : i + chunk])
    return recorder.result()


def test_the_final_event_gives_the_whole_response() -> None:
    answer = recorded(sse(*EVENTS, {"type": "response.completed", "response": FINAL}))
    assert answer["message"] == {"role": "assistant", "content": "Hello there"}
    assert answer["usage"] == FINAL["usage"] and answer["finish_reason"] == "completed"


def test_a_final_event_that_is_not_last_is_still_found() -> None:
    body = sse(*EVENTS, {"type": "response.completed", "response": FINAL}, tail=b"data: [DONE]\n\n")
    assert recorded(body)["usage"] == FINAL["usage"]


def test_a_stream_cut_before_its_final_event_keeps_what_came() -> None:
    answer = recorded(sse(*EVENTS))
    assert answer["message"] == {"role": "assistant", "content": "Hello there"}
    assert answer["usage"] is None


def test_a_summary_answer_is_its_message_text_reasoning_left_out() -> None:
    answer = {
        "status": "completed",
        "model": "gpt-x",
        "output": [
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gA"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "<summary>x</summary>"}],
            },
        ],
        "usage": {"input_tokens": 900, "output_tokens": 40},
    }
    read = RESPONSES_SUMMARY.answer(answer)
    assert (read.text, read.finish, read.input_tokens, read.output_tokens, read.model) == (
        "<summary>x</summary>",
        "stop",
        900,
        40,
        "gpt-x",
    )
    cut = {**answer, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    assert RESPONSES_SUMMARY.answer(cut).finish == "length"
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    called = RESPONSES_SUMMARY.answer({**answer, "output": [answer["output"][0], call]})
    assert called.text is None  # a tool call is no summary
