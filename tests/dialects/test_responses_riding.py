"""The Responses API's cache-riding request: the forwarded `input` bytes, one user message
item more, sent in the Responses API; what forces another answer, a string input or a
history the upstream holds is not ridden."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.dialects.base import Parsed, Refusal
from proxy.dialects.responses import ResponsesDialect
from proxy.dialects.responses_answer import RESPONSES_SUMMARY
from proxy.dialects.responses_riding import ResponsesRiding
from proxy.dialects.riding import riding_request
from proxy.wire.members import members
from tests.dialects.test_responses_route import responses_items
from tests.faults import history

pytestmark = pytest.mark.quick

RIDING = ResponsesRiding()
TOOLS = [{"type": "function", "name": "get_reservation_details", "parameters": {}}]


def raw_of(body: bytes) -> dict[str, str]:
    text = body.decode()
    return {m.key: text[m.value_start : m.end] for m in members(text)}


def forwarded(**extra: Any) -> bytes:
    instructions, items = responses_items(history(6))
    body = {
        "model": "gpt-x",
        "instructions": instructions,
        "input": items,
        "tools": TOOLS,
        "stream": True,
        "stream_options": {"include_obfuscation": False},
        "background": False,
        "prompt_cache_key": "k1",
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 5000,
        "temperature": 0.9,
        **extra,
    }
    return json.dumps(body, indent=1, ensure_ascii=False).encode()


def test_the_registry_names_this_request_sent_in_the_responses_api() -> None:
    request = riding_request("responses")
    assert isinstance(request, ResponsesRiding) and request.call is RESPONSES_SUMMARY


def test_the_input_bytes_are_kept_and_one_user_message_item_ends_them() -> None:
    sent = forwarded()
    assert RIDING.check(sent) is None
    out = RIDING.body(sent, "Summarise 1 to 5.", "gpt-x", {"temperature": 0.2, "max_tokens": 99})
    before, after = raw_of(sent), raw_of(out)
    assert after["input"].startswith(before["input"][:-1].rstrip())
    body = json.loads(out)
    assert body["input"][:-1] == json.loads(sent)["input"]
    assert body["input"][-1] == {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Summarise 1 to 5."}],
    }
    for kept in ("model", "instructions", "tools", "prompt_cache_key", "store", "include"):
        assert after[kept] == before[kept]
    for dropped in ("stream", "stream_options", "background"):
        assert dropped not in body
    assert body["max_output_tokens"] == 99 and body["temperature"] == 0.2


def test_with_reasoning_the_client_s_sampling_goes_as_it_was() -> None:
    sent = forwarded(reasoning={"effort": "low"})
    body = json.loads(RIDING.body(sent, "go", "small", {"temperature": 0.2, "max_tokens": 99}))
    assert body["temperature"] == 0.9 and body["reasoning"] == {"effort": "low"}
    assert body["model"] == "small"


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        ({"tool_choice": "required"}, Refusal.NO_SUMMARY),
        ({"tool_choice": {"type": "function", "name": "f"}}, Refusal.NO_SUMMARY),
        ({"tool_choice": {"type": "file_search"}}, Refusal.NO_SUMMARY),
        ({"tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, "no"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "no"),
        ({"text": {"format": {"type": "json_object"}}}, Refusal.NO_SUMMARY),
        ({"previous_response_id": "resp_1"}, Refusal.UNREADABLE),
        ({"conversation": "conv_1"}, Refusal.UNREADABLE),
        ({"input": "Just one message."}, Refusal.UNREADABLE),
    ],
)
def test_what_cannot_give_a_summary_of_this_history_is_not_ridden(
    extra: dict[str, Any], refusal: Refusal | str
) -> None:
    expected = Refusal.NO_SUMMARY if refusal == "no" else refusal
    assert RIDING.check(forwarded(**extra)) is expected


def test_a_free_choice_and_a_text_format_ride() -> None:
    for extra in (
        {"tool_choice": "auto"},
        {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
        {"text": {"format": {"type": "text"}, "verbosity": "low"}},
    ):
        assert RIDING.check(forwarded(**extra)) is None


def test_the_instruction_counts_the_instructions_then_each_item() -> None:
    sent = forwarded()
    parsed = ResponsesDialect().parse(sent)
    assert isinstance(parsed, Parsed)
    view = parsed.messages
    items = json.loads(sent)["input"]
    roles = [m["role"] for m in view]
    # The first tool round's answer: the call (its reasoning and the call: 2 items), its
    # output, then the answer.
    answer = roles.index("assistant", roles.index("tool"))
    numbered = RIDING.number(sent, view, answer + 1)
    assert numbered is not None and numbered.role == "assistant"
    named = items[numbered.count - 2]  # instructions are message 1
    assert named["type"] == "message" and named["role"] == "assistant"
    assert named["content"][0]["text"] == view[answer]["content"][0]["text"]
    # A summary Recap made is one item; without instructions, items count from 1.
    summary = {"role": "system", "content": "<recap-summary>Earlier.</recap-summary>"}
    bare = json.loads(sent)
    del bare["instructions"]
    raw = json.dumps(bare).encode()
    parsed = ResponsesDialect().parse(raw)
    assert isinstance(parsed, Parsed)
    shown = [summary, *parsed.messages[3:]]
    rendered = ResponsesDialect().render(parsed, shown)
    again = RIDING.number(rendered, shown, 2)
    assert again is not None and again.count == 1 + len(parsed.messages[3]["recap_items"])
