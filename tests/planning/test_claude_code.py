"""Which Messages requests are Claude Code's compaction, and the answer Recap gives one."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from proxy.planning.claude_code import (
    answer_text,
    may_be_request,
    message_object,
    stream_events,
    summary_request,
)
from proxy.planning.framing import FRAME_CLOSE, FRAME_OPEN
from tests.claude_code_bodies import FOCUSED_PROMPT, PARTIAL_PROMPT, SUMMARY_PROMPT, auto, manual
from tests.messages_history import tool_loop

LOOP = tool_loop(3)
ANSWERED = [*LOOP, {"role": "assistant", "content": [{"type": "text", "text": "All read."}]}]


def test_the_auto_prompt_is_a_message_of_its_own() -> None:
    messages = auto(ANSWERED)
    asked = summary_request({"messages": messages})
    assert asked is not None and asked.history == messages[:-1]
    assert may_be_request(json.dumps({"messages": messages}).encode())


def test_the_manual_prompt_is_a_block_after_the_tool_results() -> None:
    messages = manual(LOOP)
    asked = summary_request({"messages": messages})
    assert asked is not None
    assert asked.history[-1]["content"] == messages[-1]["content"][:-1]
    assert asked.history[:-1] == messages[:-1]


@pytest.mark.parametrize(
    "messages",
    [
        auto(ANSWERED, FOCUSED_PROMPT),  # the user's own focus: the upstream follows it
        auto(ANSWERED, PARTIAL_PROMPT),  # the partial variant keeps earlier context
        auto(ANSWERED, SUMMARY_PROMPT + "\n\nAnd also this."),  # not where it ends
        auto(ANSWERED, "Please summarise: " + SUMMARY_PROMPT),  # not where it opens
        [{"role": "user", "content": SUMMARY_PROMPT}],  # nothing to summarise
        [*ANSWERED, {"role": "assistant", "content": SUMMARY_PROMPT}],
        auto(
            [{"role": "user", "content": "# Compact Instructions\nKeep all code."}, *ANSWERED[1:]]
        ),
    ],
    ids=["focus", "partial", "trailing", "leading", "alone", "assistant", "instructed"],
)
def test_anything_else_is_left_to_the_upstream(messages: list[Any]) -> None:
    assert summary_request({"messages": messages}) is None


def test_the_answer_is_the_framed_summary_inside_summary_tags() -> None:
    text = answer_text("Read a.py. A </summary> tag and <analysis> in it.", "English")
    inner = re.fullmatch(r"<summary>\n(.*)\n</summary>", text, re.S)
    assert inner is not None
    body = inner.group(1)
    # Claude Code keeps what is between the first <summary> and the next </summary>.
    assert "</summary>" not in body and "<analysis>" not in body and "‹/summary>" in body
    assert FRAME_OPEN in body and body.endswith(FRAME_CLOSE)


def test_the_streamed_answer_is_anthropics_event_sequence() -> None:
    message = message_object("msg_1", "claude-x", "x" * 4500, 900, 50)
    events = list(stream_events(message))
    assert [e for e, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert (
        "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta") == "x" * 4500
    )
    assert events[-2][1]["usage"] == {"output_tokens": 50}
