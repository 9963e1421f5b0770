"""The Messages adapter's parse and render, directly (pure), on the blocks Anthropic defines:
every history rendered back is one the API accepts (tests.fake_messages.request_problems)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.dialects.base import Parsed, PassReason, Unparsed
from proxy.dialects.messages import (
    BLOCKS,
    MessagesDialect,
    cache_breakpoints,
    key_fields,
    rendered,
)
from proxy.dialects.messages_answer import ANTHROPIC_ERRORS, MESSAGES_SUMMARY
from proxy.errors import InternalError, Unauthorized
from proxy.history.conversation import check_history, tool_rounds, turn_starts
from proxy.history.messages import Classification, classify
from proxy.planning.fidelity import plan_fidelity
from proxy.planning.framing import summary_message
from proxy.planning.loop import loop_view
from proxy.planning.session import session_view
from proxy.planning.trim import trimmed_content, without_attachments
from tests.fake_messages import request_problems
from tests.messages_history import EPHEMERAL, thinking, tool_loop

D = MessagesDialect()
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9aw"
    "AAAABJRU5ErkJggg=="
)


def body(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "claude-x", "max_tokens": 1024, "messages": messages, **extra}


def parsed(b: dict[str, Any]) -> Parsed:
    got = D.parse(json.dumps(b).encode())
    assert isinstance(got, Parsed)
    return got


def render(p: Parsed, view: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(D.render(p, view))
    return out


SYSTEM = [
    {"type": "text", "text": "billing header"},
    {"type": "text", "text": "You are an agent.", "cache_control": EPHEMERAL},
]
LOOP = [
    {"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]},
    {
        "role": "assistant",
        "content": [
            thinking("read it first"),
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.py"}},
            {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"path": "b.py"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_2",
                "content": [{"type": "text", "text": "print(2)"}],
                "is_error": False,
                "cache_control": EPHEMERAL,
            },
        ],
    },
]


def test_an_unchanged_view_renders_the_very_body() -> None:
    b = body(LOOP, system=SYSTEM, tools=[{"name": "Read", "input_schema": {"type": "object"}}])
    p = parsed(b)
    assert render(p, list(p.messages)) == b
    # Each message comes back as the very object the client sent.
    system, messages = rendered(p, p.messages)
    assert system == [] and all(m is o for m, o in zip(messages, p.body["messages"], strict=True))


def test_blocks_map_onto_the_neutral_view() -> None:
    p = parsed(body(LOOP, system=SYSTEM))
    system, user, answer, first, second = p.messages
    assert system["role"] == "system" and system["content"][1]["text"] == "You are an agent."
    assert user["role"] == "user" and user["content"] == [{"type": "text", "text": "Fix the bug."}]
    assert answer["content"] == "Reading." and [c["id"] for c in answer["tool_calls"]] == [
        "toolu_1",
        "toolu_2",
    ]
    assert json.loads(answer["tool_calls"][0]["function"]["arguments"]) == {"path": "a.py"}
    assert answer[BLOCKS][0]["type"] == "thinking"  # carried with its answer, verbatim
    assert first == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "print(1)",
        BLOCKS: [LOOP[2]["content"][0]],
    }
    assert second["content"] == [{"type": "text", "text": "print(2)"}]
    assert check_history(p.messages) == []
    assert [(r.start, r.end) for r in tool_rounds(p.messages)] == [(2, 5)]
    assert classify(p.messages) == Classification.TOOL_CONTINUATION


def test_a_user_message_with_text_after_its_results_starts_a_turn() -> None:
    # Claude Code's /compact: its instruction is a text block after the last tool result.
    last = {
        "role": "user",
        "content": [*LOOP[2]["content"], {"type": "text", "text": "Summarise this."}],
    }
    p = parsed(body([*LOOP[:2], last]))
    assert [m["role"] for m in p.messages] == ["user", "assistant", "tool", "tool", "user"]
    assert classify(p.messages) == Classification.TURN_START
    assert turn_starts(p.messages) == [0, 4]


def test_runs_of_results_and_other_blocks_each_become_their_messages() -> None:
    def result(n: int) -> dict[str, Any]:
        return {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": f"out {n}"}

    text = [{"type": "text", "text": t} for t in ("a", "b")]
    call = [{"type": "tool_use", "id": f"toolu_{n}", "name": "Read", "input": {}} for n in (1, 2)]
    answer = {"role": "assistant", "content": [text[0], call[0], text[1], call[1]]}
    user = {"role": "user", "content": [text[0], result(1), result(2), text[1], result(3)]}
    b = body([{"role": "user", "content": "Go."}, answer, user])
    p = parsed(b)
    said = p.messages[1]
    assert said["content"] == "a\n\nb" and [c["id"] for c in said["tool_calls"]] == [
        "toolu_1",
        "toolu_2",
    ]
    assert said[BLOCKS] == answer["content"]
    runs = p.messages[2:]
    assert [m["role"] for m in runs] == ["user", "tool", "tool", "user", "tool"]
    assert [m[BLOCKS] for m in runs] == [[b] for b in user["content"]]
    assert [m.get("tool_call_id") for m in runs] == [None, "toolu_1", "toolu_2", None, "toolu_3"]
    assert render(p, list(p.messages)) == b
    # Without the second text block's run, its neighbours stay apart (the client's own).
    _, messages = rendered(p, [*p.messages[:5], p.messages[6]])
    assert messages[-1]["content"] == [text[0], result(1), result(2), result(3)]


@pytest.mark.parametrize(
    ("raw", "reason", "detail"),
    [
        (b"{", PassReason.NOT_JSON, "body is not JSON"),
        (b'{"model": "m"}', PassReason.NO_HISTORY, "messages missing or not a list"),
        (b'{"messages": [{"role": "system", "content": "x"}]}', PassReason.BAD_ITEM,
         "message 0 is not a user or assistant message"),
        (b'{"messages": [{"role": "user", "content": 3}]}', PassReason.BAD_ITEM,
         "message 0 content is neither text nor blocks"),
        (b'{"messages": [{"role": "user", "content": ["x"]}]}', PassReason.BAD_ITEM,
         "message 0 content is neither text nor blocks"),
        (b'{"messages": [], "system": 7}', PassReason.BAD_ITEM,
         "system is neither text nor a list of blocks"),
    ],
)  # fmt: skip
def test_bodies_it_cannot_work_on_say_why(raw: bytes, reason: PassReason, detail: str) -> None:
    got = D.parse(raw)
    assert isinstance(got, Unparsed) and (got.reason, got.detail) == (reason, detail)


def _history(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(turns):
        out.append({"role": "user", "content": f"Question {i}"})
        out.append({"role": "assistant", "content": [{"type": "text", "text": f"Answer {i}"}]})
    out.append(
        {"role": "user", "content": [{"type": "text", "text": "Last", "cache_control": EPHEMERAL}]}
    )
    return out


def test_a_system_summary_is_a_block_after_the_clients_system() -> None:
    b = body(_history(4), system=SYSTEM)
    p = parsed(b)
    pinned, rest = p.messages[:1], p.messages[1:]
    summary = summary_message("Earlier: questions 0-1.", "system", "English", "session")
    out = render(p, session_view(pinned, rest, 4, summary))
    assert out["system"][:2] == SYSTEM and out["system"][2] == {
        "type": "text",
        "text": summary["content"],
    }
    assert "cache_control" not in out["system"][2]  # Recap adds no breakpoint
    assert out["messages"] == b["messages"][4:]
    assert request_problems(out) == []
    assert cache_breakpoints(out) == cache_breakpoints(b) == 2


def test_a_text_system_becomes_blocks_and_no_system_gets_one() -> None:
    summary = summary_message("S.", "system", "English", "session")
    for system, first in (("Be brief.", [{"type": "text", "text": "Be brief."}]), (None, [])):
        extra = {"system": system} if system else {}
        p = parsed(body(_history(3), **extra))
        pinned = p.messages[:1] if system else []
        out = render(p, session_view(pinned, p.messages[len(pinned) :], 2, summary))
        assert out["system"] == [*first, {"type": "text", "text": summary["content"]}]
        assert request_problems(out) == []


def test_a_user_summary_is_merged_into_the_first_user_message() -> None:
    b = body(_history(4))
    p = parsed(b)
    summary = summary_message("S.", "user", "English", "session")
    out = render(p, session_view([], p.messages, 4, summary))
    assert "system" not in out
    first = out["messages"][0]
    assert first["role"] == "user"
    assert first["content"] == [
        {"type": "text", "text": summary["content"]},
        {"type": "text", "text": "Question 2"},
    ]
    assert out["messages"][1:] == b["messages"][5:]
    assert request_problems(out) == []


def test_a_loop_summary_joins_the_turns_user_message_and_thinking_stays_with_its_round() -> None:
    messages = tool_loop(8)
    p = parsed(body(messages, thinking={"type": "enabled", "budget_tokens": 2000}))
    summary = summary_message("Rounds 0-4 read.", "system", "English", "loop")
    view = loop_view(p.messages, 5, summary)
    out = render(p, view)
    assert request_problems(out) == []
    turn = out["messages"][0]
    assert turn["content"] == [
        {"type": "text", "text": messages[0]["content"]},
        {"type": "text", "text": summary["content"]},
    ]
    # The kept rounds are the client's own messages, thinking and all.
    assert out["messages"][1:] == messages[1 + 2 * 5 :]


def test_the_clients_own_adjacent_user_messages_stay_apart() -> None:
    # Claude Code sends two user messages in a row after its own compaction.
    b = body([
        {"role": "user", "content": "Summary of before."},
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": "<system-reminder>files</system-reminder>"},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ])  # fmt: skip
    p = parsed(b)
    # Rewritten copies of the block messages (a user text message is never rewritten).
    view = [m if isinstance(m["content"], str) else dict(m) for m in p.messages]
    out = render(p, view)
    assert out["messages"] == b["messages"]


def test_a_drop_that_makes_two_user_messages_adjacent_merges_them() -> None:
    # A turn that ended in a tool result (interrupted), then a dropped turn.
    b = body([*LOOP, {"role": "user", "content": "Dropped."},
              {"role": "assistant", "content": [{"type": "text", "text": "Gone."}]},
              {"role": "user", "content": "Now this."}])  # fmt: skip
    p = parsed(b)
    view = [
        m
        for m in p.messages
        if m.get("content") not in ("Dropped.",) and m.get("content") != "Gone."
    ]
    out = render(p, view)
    assert request_problems(out) == []
    assert out["messages"][-1] == {
        "role": "user",
        "content": [*LOOP[2]["content"], {"type": "text", "text": "Now this."}],
    }


def test_a_trimmed_result_keeps_its_block_fields_and_marker() -> None:
    p = parsed(body(LOOP))
    result = p.messages[3]
    placeholder = trimmed_content(result, "print(2)", "Read")
    view = [*p.messages[:3], {**result, "content": placeholder}]
    out = render(p, view)
    block = out["messages"][2]["content"][1]
    assert block == {**LOOP[2]["content"][1], "content": placeholder}
    assert out["messages"][2]["content"][0] is not None and request_problems(out) == []
    assert out["messages"][:2] == LOOP[:2]


def test_an_old_image_placeholder_takes_the_images_place_and_marker() -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG},
        "cache_control": EPHEMERAL,
    }
    seen = {"role": "user", "content": [{"type": "text", "text": "See."}, image]}
    b = body([seen, {"role": "assistant", "content": "A cat."}, *_history(1)])
    p = parsed(b)
    assert p.messages[0]["content"][1]["type"] == "image_url"  # weighed as an image
    slim = without_attachments(p.messages[0])
    assert slim is not None
    out = render(p, [slim, *p.messages[1:]])
    first = out["messages"][0]["content"]
    assert first[0] == {"type": "text", "text": "See."}
    assert first[1]["type"] == "text" and "attachment" in first[1]["text"]
    assert first[1]["cache_control"] == EPHEMERAL
    assert request_problems(out) == []


def test_a_shortened_old_answer_keeps_its_thinking_and_valid_input() -> None:
    long = {
        "role": "assistant",
        "content": [
            thinking("plan"),
            {"type": "text", "text": "x" * 600},
            {"type": "text", "text": "y" * 600},
            {"type": "tool_use", "id": "toolu_9", "name": "Write", "input": {"text": "z" * 3000}},
        ],
    }
    result = {"type": "tool_result", "tool_use_id": "toolu_9", "content": "ok"}
    b = body([{"role": "user", "content": "Write."}, long,
              {"role": "user", "content": [result]},
              {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
              {"role": "user", "content": "Next."}])  # fmt: skip
    p = parsed(b)
    shortened = plan_fidelity(p.messages, 500, 200, 3)
    assert set(shortened) == {1}
    out = render(p, [shortened.get(i, m) for i, m in enumerate(p.messages)])
    blocks = out["messages"][1]["content"]
    assert [x["type"] for x in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0] == long["content"][0]
    assert len(blocks[1]["text"]) <= 500 and "recap://message/" in blocks[1]["text"]
    assert set(blocks[2]["input"]) == {"recap_shortened", "archived"}
    assert request_problems(out) == []


def test_keys_prefer_a_session_id_inside_user_id() -> None:
    claude_code = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s-1"})
    assert key_fields({"metadata": {"user_id": claude_code}})[0] == (
        "metadata.user_id.session_id",
        "s-1",
    )
    assert key_fields({"metadata": {"user_id": "user-7"}}) == [("metadata.user_id", "user-7")]
    assert key_fields({}) == [("metadata.user_id", None)]


def test_breakpoints_are_counted_on_tools_system_and_blocks() -> None:
    b = body(
        LOOP, system=SYSTEM, tools=[{"name": "t", "input_schema": {}, "cache_control": EPHEMERAL}]
    )
    assert cache_breakpoints(b) == 3


def test_recaps_errors_are_in_anthropics_shape() -> None:
    assert json.loads(ANTHROPIC_ERRORS.body(Unauthorized("Missing proxy API key."))) == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Missing proxy API key."},
    }
    event = ANTHROPIC_ERRORS.event(InternalError("boom"))
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ", 1)[1])["error"]["type"] == "api_error"


def test_an_upstream_error_after_the_stream_began_is_an_error_event() -> None:
    upstream = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    event = D.error_event(json.dumps(upstream).encode(), 529)
    assert event == b"event: error\ndata: " + json.dumps(upstream).encode() + b"\n\n"
    text = D.error_event(b"bad gateway", 502)
    assert json.loads(text.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "bad gateway"},
    }


def test_the_summary_call_is_a_messages_request() -> None:
    call = MESSAGES_SUMMARY
    sent = call.request(
        "claude-haiku", "SYS", "USER", {"temperature": 0.2, "top_p": 1, "max_tokens": 900}
    )
    assert sent == {
        "model": "claude-haiku",
        "system": "SYS",
        "messages": [{"role": "user", "content": "USER"}],
        "temperature": 0.2,
        "max_tokens": 900,
    }
    assert request_problems(sent) == []
    assert call.path == "/v1/messages" and call.headers == {"anthropic-version": "2023-06-01"}
    assert call.credentials("sk-ant") == {"x-api-key": "sk-ant"}
    answer = call.answer({
        "type": "message", "model": "claude-haiku", "stop_reason": "max_tokens",
        "content": [{"type": "text", "text": "<summary>S</summary>"}],
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 5},
    })  # fmt: skip
    assert (answer.text, answer.finish, answer.input_tokens, answer.output_tokens) == (
        "<summary>S</summary>",
        "length",
        100,
        5,
    )
    with pytest.raises(KeyError):
        call.answer({"type": "error", "error": {}})
