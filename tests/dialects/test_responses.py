"""The Responses adapter's parse and render, directly (pure), on the items OpenAI defines."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from proxy.dialects.base import Parsed, PassReason, Unparsed
from proxy.dialects.responses import ITEMS, ResponsesDialect
from proxy.history.attachments import PDF_TOKENS_PER_PAGE
from proxy.history.conversation import check_history, tool_rounds, valid_cut_points
from proxy.history.messages import Classification, classify
from proxy.history.tokens import TokenCounter
from proxy.planning.framing import summary_message
from proxy.planning.trim import without_attachments
from tests.fake_responses import input_problems

pytestmark = pytest.mark.quick

D = ResponsesDialect()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(n: int, name: str = "lookup") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{n}",
        "call_id": f"call_{n}",
        "name": name,
        "arguments": json.dumps({"n": n}),
        "status": "completed",
    }


def output(n: int, text: str = "result") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": f"{text} {n}"}


def reasoning(n: int) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{n}", "summary": [], "encrypted_content": "gAAA" * 9}


def answer(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


ITEMS_LOOP: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    user("Find it."),
    reasoning(1),
    call(1),
    call(2),
    output(1),
    output(2),
    {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    {"type": "item_reference", "id": "msg_0"},
    {"type": "brand_new_item", "x": 1},
    reasoning(2),
    answer("Checking."),
    call(3),
    output(3),
]


def valid(body: dict[str, Any]) -> bool:
    """OpenAI would take it (the made-up item type aside, which only tests grouping)."""
    return [p for p in input_problems(body) if "brand_new_item" not in p] == []


def parse(body: dict[str, Any]) -> Parsed:
    parsed = D.parse(json.dumps(body).encode())
    assert isinstance(parsed, Parsed)
    return parsed


def rendered(parsed: Parsed, messages: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(D.render(parsed, messages))
    return out


def test_items_group_into_a_valid_neutral_history() -> None:
    parsed = parse({"model": "m", "instructions": "Pinned.", "input": ITEMS_LOOP})
    m = parsed.messages
    assert [x["role"] for x in m] == [
        "system", "developer", "user", "assistant", "tool", "tool", "assistant", "tool",
    ]  # fmt: skip
    # The reasoning item rides with the calls after it; the parallel calls are one round.
    assert [c["id"] for c in m[3]["tool_calls"]] == ["call_1", "call_2"]
    assert m[3][ITEMS] == [reasoning(1), call(1), call(2)]
    # Opaque items (built-in call, reference, unknown type, reasoning) go with what follows.
    assert [i.get("type") for i in m[6][ITEMS]] == [
        "web_search_call", "item_reference", "brand_new_item", "reasoning", "message",
        "function_call",
    ]  # fmt: skip
    assert m[6]["content"] == [{"type": "text", "text": "Checking."}]
    assert check_history(m[1:]) == []
    assert classify(m) == Classification.TOOL_CONTINUATION
    # No cut inside a round: never between a call and its output.
    assert [(r.start, r.end) for r in tool_rounds(m)] == [(3, 6), (6, 8)]
    assert 4 not in valid_cut_points(m) and 7 not in valid_cut_points(m)


def test_unchanged_view_renders_the_very_items() -> None:
    body = {"model": "m", "instructions": "Pinned.", "input": ITEMS_LOOP, "store": False}
    parsed = parse(body)
    assert rendered(parsed, parsed.messages) == body
    # Dropping whole neutral messages drops exactly their items, nothing else.
    out = rendered(parsed, [parsed.messages[0], parsed.messages[1], *parsed.messages[6:]])
    assert out["input"] == [ITEMS_LOOP[0], *ITEMS_LOOP[7:]]
    assert valid(out)


def test_a_summary_is_a_message_item_and_the_rest_stays_valid() -> None:
    parsed = parse({"model": "m", "input": [user("Old."), *ITEMS_LOOP[1:]]})
    summary = summary_message("They asked.", "system", "English", "session")
    out = rendered(parsed, [summary, *parsed.messages[1:]])
    first = out["input"][0]
    assert first == {"type": "message", "role": "system", "content": summary["content"]}
    assert out["input"][1:] == ITEMS_LOOP[1:]
    assert valid(out)


def test_a_trimmed_result_keeps_its_item_with_the_placeholder() -> None:
    parsed = parse({"model": "m", "input": ITEMS_LOOP[1:]})
    tool = parsed.messages[2]
    assert tool["tool_call_id"] == "call_1"
    trimmed = {**tool, "content": "[trimmed: see recap://message/abc]"}
    out = rendered(parsed, [*parsed.messages[:2], trimmed, *parsed.messages[3:]])
    assert out["input"][4] == {**output(1), "output": "[trimmed: see recap://message/abc]"}
    assert out["input"][:4] == ITEMS_LOOP[1:5] and out["input"][5:] == ITEMS_LOOP[6:]


def test_an_attachment_placeholder_keeps_the_other_parts_as_sent() -> None:
    text = {"type": "input_text", "text": "What is this?"}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    item = {"type": "message", "role": "user", "content": [text, image]}
    parsed = parse({"model": "m", "input": [item, answer("A cat."), user("Thanks.")]})
    neutral = parsed.messages[0]
    assert neutral["content"][1] == {
        "type": "image_url",
        "image_url": {"url": image["image_url"], "detail": "low"},
    }
    shortened = without_attachments(neutral)
    assert shortened is not None
    out = rendered(parsed, [shortened, *parsed.messages[1:]])
    parts = out["input"][0]["content"]
    assert parts[0] == text and parts[1]["type"] == "input_text"
    assert "image" in parts[1]["text"]
    assert input_problems(out) == []


def test_classification_follows_the_last_item() -> None:
    assert classify(parse({"input": "Hi"}).messages) == Classification.TURN_START
    assert classify(parse({"input": [user("a"), answer("b")]}).messages) == Classification.OTHER
    last = [user("a"), call(1), output(1)]
    assert classify(parse({"input": last}).messages) == Classification.TOOL_CONTINUATION


def test_server_held_and_unreadable_histories_are_not_parsed() -> None:
    def reason(body: Any) -> PassReason:
        got = D.parse(json.dumps(body).encode())
        assert isinstance(got, Unparsed)
        return got.reason

    assert reason({"input": "Hi", "previous_response_id": "resp_1"}) == PassReason.SERVER_HISTORY
    assert reason({"input": "Hi", "conversation": "conv_1"}) == PassReason.SERVER_HISTORY
    assert reason({"model": "m"}) == PassReason.NO_HISTORY
    assert reason({"input": ["x"]}) == PassReason.BAD_ITEM
    assert reason([1]) == PassReason.NOT_OBJECT
    assert isinstance(D.parse(b"{"), Unparsed)
    # An explicit null is no server history.
    assert isinstance(D.parse(b'{"input": "Hi", "previous_response_id": null}'), Parsed)


def test_a_reasoning_item_between_a_message_and_its_call_keeps_its_place() -> None:
    """`message, reasoning, function_call, output`: the call does not join the message
    across the reasoning item (re-rendered, that would be `message, function_call,
    reasoning, output`, and the reasoning would no longer precede the call it led to)."""
    items = [user("Find it."), answer("Let me look."), reasoning(5), call(5), output(5)]
    parsed = parse({"model": "m", "input": items})
    m = parsed.messages
    assert [x[ITEMS] for x in m[1:]] == [
        [answer("Let me look.")],
        [reasoning(5), call(5)],
        [output(5)],
    ]
    assert rendered(parsed, parsed.messages)["input"] == items
    # Rewritten around it (a summary for the first message), the order still holds.
    summary = summary_message("They asked.", "system", "English", "session")
    assert rendered(parsed, [summary, *m[1:]])["input"][1:] == items[1:]


def test_an_input_file_part_weighs_its_pages_not_its_base64() -> None:
    """An `input_file` part is the neutral `file` attachment, weighed as a PDF's pages (its
    base64 is 530 K characters: over 100K tokens if it were text)."""
    pdf = b"%PDF-1.7\n" + b"1 0 obj << /Type /Page >> endobj\n" * 3 + b"%" + b"x" * 400_000
    data = "data:application/pdf;base64," + base64.b64encode(pdf).decode()
    part = {"type": "input_file", "filename": "r.pdf", "file_data": data}
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Sum up."}, part],
    }
    parsed = parse({"model": "m", "input": [item]})
    (message,) = parsed.messages
    assert message["content"][1] == {
        "type": "file",
        "file": {"filename": "r.pdf", "file_data": data},
    }
    weight = TokenCounter().count_message(message)
    assert 3 * PDF_TOKENS_PER_PAGE <= weight < 3 * PDF_TOKENS_PER_PAGE + 100
    assert rendered(parsed, parsed.messages)["input"] == [item]
