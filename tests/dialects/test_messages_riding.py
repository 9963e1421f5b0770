"""The Messages API's cache-riding request: the forwarded `messages` bytes, one user turn
more; thinking, cache markers and tools as sent; the instruction numbering the part as the
model sees it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.dialects.base import Parsed, Refusal
from proxy.dialects.messages import MessagesDialect
from proxy.dialects.messages_answer import MESSAGES_SUMMARY
from proxy.dialects.messages_riding import MessagesRiding
from proxy.dialects.riding import riding_request
from proxy.wire.members import members
from tests.faults import history
from tests.messages_history import EPHEMERAL, TOOLS, from_chat

pytestmark = pytest.mark.quick

RIDING = MessagesRiding()
THINKING = {"type": "enabled", "budget_tokens": 2000}


def raw_of(body: bytes) -> dict[str, str]:
    text = body.decode()
    return {m.key: text[m.value_start : m.end] for m in members(text)}


def forwarded(**extra: Any) -> bytes:
    system, messages = from_chat(history(6))
    body = {
        "model": "claude-x",
        "max_tokens": 8000,
        "system": system,
        "tools": TOOLS,
        "messages": messages,
        "stream": True,
        "metadata": {"user_id": "u-1"},
        **extra,
    }
    return json.dumps(body, indent=1, ensure_ascii=False).encode()


def test_the_registry_names_this_request_sent_in_the_messages_api() -> None:
    request = riding_request("messages")
    assert isinstance(request, MessagesRiding) and request.call is MESSAGES_SUMMARY
    assert request.carried == ("anthropic-beta",)


def test_the_messages_bytes_are_kept_and_one_user_turn_ends_them() -> None:
    sent = forwarded(thinking=THINKING)
    assert RIDING.check(sent) is None
    out = RIDING.body(sent, "Summarise 1 to 5.", "claude-x", {"temperature": 0.2, "max_tokens": 99})
    before, after = raw_of(sent), raw_of(out)
    assert after["messages"].startswith(before["messages"][:-1].rstrip())
    body = json.loads(out)
    assert body["messages"][:-1] == json.loads(sent)["messages"]
    assert body["messages"][-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "Summarise 1 to 5."}],
    }
    # The cached levels and the thinking as written; the cache markers where they were.
    for kept in ("model", "system", "tools", "thinking", "metadata"):
        assert after[kept] == before[kept]
    assert EPHEMERAL in [b.get("cache_control") for b in body["system"]]
    # Not streamed; the thinking's budget comes before the summary's own room; with thinking
    # on, no temperature (Anthropic refuses a changed one).
    assert "stream" not in body and body["max_tokens"] == 2000 + 99
    assert "temperature" not in body
    # What the window must leave free for the answer (the fit of the riding call).
    assert RIDING.output_limit(sent, 99) == body["max_tokens"]
    assert RIDING.output_limit(forwarded(), 99) == 99


def test_without_thinking_the_limit_is_the_summary_s_and_sampling_the_scene_s() -> None:
    sent = forwarded(top_p=0.9, temperature=1.0)
    body = json.loads(RIDING.body(sent, "go", "small", {"temperature": 0.2, "max_tokens": 99}))
    assert body["max_tokens"] == 99 and body["temperature"] == 0.2
    assert "top_p" not in body  # current models take one of the two
    assert body["model"] == "small"
    only_top_p = json.loads(RIDING.body(forwarded(), "go", "claude-x", {"top_p": 0.5}))
    assert only_top_p["top_p"] == 0.5 and only_top_p["max_tokens"] == 4096


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": {"type": "any"}},
        {"tool_choice": {"type": "tool", "name": "read_file"}},
        {"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
        {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
    ],
)
def test_a_body_that_forces_a_tool_or_a_structure_is_not_ridden(extra: dict[str, Any]) -> None:
    assert RIDING.check(forwarded(**extra)) is Refusal.NO_SUMMARY


def test_a_free_tool_choice_rides_and_a_body_without_messages_does_not() -> None:
    assert RIDING.check(forwarded(tool_choice={"type": "auto"})) is None
    assert RIDING.check(forwarded(tool_choice={"type": "none"})) is None
    assert RIDING.check(b'{"model": "m", "max_tokens": 1}') is Refusal.UNREADABLE
    assert RIDING.check(b"[]") is Refusal.UNREADABLE


def parsed_of(raw: bytes) -> Parsed:
    parsed = MessagesDialect().parse(raw)
    assert isinstance(parsed, Parsed)
    return parsed


def test_the_instruction_counts_the_system_prompt_then_each_message() -> None:
    view = parsed_of(forwarded()).messages
    body = json.loads(forwarded())["messages"]
    # The first turn's tool round: user, assistant with the call, the user turn of its
    # result, then the answer.
    roles = [m["role"] for m in view]
    answer = roles.index("assistant", roles.index("tool"))
    numbered = RIDING.number(forwarded(), view, answer + 1)
    assert numbered is not None and numbered.role == "assistant"
    # System is message 1; the answer is that many messages into `messages`.
    assert body[numbered.count - 2]["role"] == "assistant"
    assert body[numbered.count - 2]["content"][0]["text"] == view[answer]["content"]


def test_a_summary_shown_in_the_system_prompt_is_in_message_1() -> None:
    parsed = parsed_of(forwarded())
    summary = {"role": "system", "content": "<recap-summary>Earlier.</recap-summary>"}
    view = [parsed.messages[0], summary, *parsed.messages[3:]]
    sent = MessagesDialect().render(parsed, view)
    assert json.loads(sent)["system"][-1]["text"] == summary["content"]
    numbered = RIDING.number(sent, view, 3)  # the system, the summary, one message
    assert numbered is not None and numbered.count == 2
    assert RIDING.number(sent, view, 2) is None  # nothing of `messages` folded


def test_a_fold_that_ends_inside_one_message_cannot_be_numbered() -> None:
    results = [
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"},
                {"type": "text", "text": "Now b.py"},
            ],
        },
    ]
    raw = json.dumps({"model": "m", "max_tokens": 9, "messages": results}).encode()
    view = parsed_of(raw).messages
    assert [m["role"] for m in view] == ["user", "assistant", "tool", "user"]
    assert RIDING.number(raw, view, 3) is None  # the result and the text are one message
    whole = RIDING.number(raw, view, 4)
    assert whole is not None and (whole.count, whole.role) == (3, "user")


def test_a_text_block_recap_merged_into_a_message_is_lined_up_from_the_other_side() -> None:
    """A user-role summary becomes a block of the first kept user message (before the
    fold's end), a working summary one of a later user message (after it): the count is
    taken from the side with no merge, and the roles must agree."""
    parsed = parsed_of(forwarded())
    roles = [m["role"] for m in parsed.messages]
    turn = roles.index("user", 2)  # the second turn's user message: a turn start
    summary = {"role": "user", "content": "<recap-summary>Earlier.</recap-summary>"}
    view = [parsed.messages[0], summary, *parsed.messages[turn:]]
    sent = MessagesDialect().render(parsed, view)
    entries = json.loads(sent)["messages"]
    assert len(entries) == len(view) - 2  # the summary is a block of the first entry
    answer = [m["role"] for m in view].index("assistant")
    numbered = RIDING.number(sent, view, answer + 1)
    assert numbered is not None and numbered.role == "assistant"
    assert entries[numbered.count - 2]["content"][0]["text"] == view[answer]["content"]
    # A block merged after the fold: the count is taken from the start.
    plain = parsed.messages
    last_user = max(i for i, m in enumerate(plain) if m["role"] == "user")
    note = {"role": "user", "content": "<recap-working-summary>x</recap-working-summary>"}
    later = [*plain[:last_user], note, *plain[last_user:]]
    merged = MessagesDialect().render(parsed, later)
    assert len(json.loads(merged)["messages"]) == len(json.loads(forwarded())["messages"])
    fold = turn + answer - 1  # the same answer, in the view without the summary
    first = RIDING.number(forwarded(), plain, fold)
    assert first is not None and plain[fold - 1]["content"] == view[answer]["content"]
    assert RIDING.number(merged, later, fold) == first
