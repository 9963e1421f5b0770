"""Transcript rendering for the summarizer, on real taubench sessions and odd shapes."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.planning.transcript import (
    detect_language,
    head_tail,
    render_transcript,
    render_within,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "taubench-airline-dev.jsonl"
RESULT = re.compile(r"^Tool result \[([^\]]*)\]: ", re.MULTILINE)


@cache
def sessions() -> tuple[dict[str, Any], ...]:
    lines = DATA.read_text(encoding="utf-8").splitlines()
    return tuple(json.loads(line) for line in lines)


def without_tool_names(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The session with the `name` dropped from tool results, so names must come from calls."""
    out = copy.deepcopy(messages)
    for m in out:
        if m["role"] == "tool":
            del m["name"]
    return out


# --- head_tail ------------------------------------------------------------------


@given(st.text(max_size=3000), st.integers(min_value=0, max_value=2000))
def test_head_tail_bounds_and_keeps_ends(text: str, max_chars: int) -> None:
    out = head_tail(text, max_chars)
    assert len(out) <= max_chars
    if len(text) <= max_chars:
        assert out == text
        return
    m = re.search(r"…\[(\d+) chars omitted\]…", out)
    if m is None:  # too small for a marker: a plain prefix
        assert text.startswith(out)
        return
    head, tail = out[: m.start()], out[m.end() :]
    assert text.startswith(head)
    assert text.endswith(tail)
    assert int(m.group(1)) == len(text) - len(head) - len(tail)
    assert len(out) == max_chars


def test_head_tail_keeps_an_error_at_the_end_of_a_long_log() -> None:
    log = "\n".join(f"step {i}: ok" for i in range(2000)) + "\nERROR: disk full on /var/lib"
    out = head_tail(log, 400)
    assert out.startswith("step 0: ok")
    assert out.endswith("ERROR: disk full on /var/lib")


# --- real sessions --------------------------------------------------------------


def test_first_session_reads_as_a_conversation() -> None:
    messages = sessions()[0]["messages"][1:]  # the pinned policy prompt is not summarised
    text = render_transcript(messages, max_item_chars=4000)
    assert text.startswith("User: Hi! I'm looking to book a flight from New York to Seattle")
    assert 'Assistant called tool get_user_details({"user_id":"mia_li_3668"})' in text
    assert "Tool result [book_reservation]: Error: payment amount does not add up" in text
    assert "Tool result [think]: (empty)" in text
    assert '"reservation_id": "HATHAT"' in text  # tool results carry the facts gold actions need
    assert text.endswith("User: Thank you so much for your help! ###STOP###")
    assert "None" not in text.split("Assistant called tool")[0]  # null content is not "None"


def test_reused_call_id_resolves_to_the_nearest_preceding_call() -> None:
    # Session 0 reuses call_oIHazX6yQrB8hUwl4cRilFKj: first get_user_details, later calculate.
    text = render_transcript(without_tool_names(sessions()[0]["messages"]))
    names = RESULT.findall(text)
    assert names[0] == "get_user_details"
    assert "calculate" in names
    assert text.index("Tool result [calculate]: 255.0") > text.index(
        "Tool result [get_user_details]"
    )


def test_every_tool_result_name_resolves_from_its_call_across_all_sessions() -> None:
    for session in sessions():
        messages = session["messages"]
        expected = [m["name"] for m in messages if m["role"] == "tool"]
        assert RESULT.findall(render_transcript(without_tool_names(messages))) == expected


def test_calls_name_wins_over_the_results_own_name() -> None:
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculate", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "stale_name", "content": "2"},
        {"role": "tool", "tool_call_id": "c9", "name": "orphan_tool", "content": "x"},
        {"role": "tool", "tool_call_id": "c8", "content": "y"},
    ]
    assert RESULT.findall(render_transcript(messages)) == ["calculate", "orphan_tool", "?"]


def test_items_are_cut_to_max_item_chars_on_real_data() -> None:
    for session in sessions()[:20]:
        text = render_transcript(session["messages"], max_item_chars=300)
        items = text.split("\n\n")
        # Multi-paragraph contents split here too, so each piece is at most one item.
        assert max(len(i) for i in items) <= 300
        assert "chars omitted]…" in text  # the policy prompt alone is far longer


def test_assistant_text_and_tool_calls_both_render() -> None:
    both = next(
        m
        for s in sessions()
        for m in s["messages"]
        if m["role"] == "assistant" and m.get("content") and m.get("tool_calls")
    )
    text = render_transcript([both])
    assert text.startswith("Assistant: " + both["content"].strip()[:40])
    assert f"Assistant called tool {both['tool_calls'][0]['function']['name']}(" in text


# --- odd shapes -------------------------------------------------------------------


def test_odd_messages_render_something_sensible() -> None:
    messages: list[Any] = [
        None,
        42,
        "stray string",
        {},
        {"role": "user"},
        {"role": "user", "content": 3.5},
        {"role": "user", "content": {"weird": True}},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "这张截图里的报错是什么意思？"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "..."}},
                {"type": "mystery"},
                "loose text",
                None,
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": "not a list"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                None,
                {"id": 7, "function": {"name": "read_file", "arguments": {"path": "/etc/hosts"}}},
                {"id": "x", "function": "broken"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "lookup", "arguments": '{"q": 1}'},
        },
        {"role": "function", "name": "lookup", "content": "found"},
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "system", "content": "Reminder: answer in Chinese."},
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "critic", "content": "looks fine"},
        {"role": None, "content": "no role"},
    ]
    text = render_transcript(messages)
    for expected in [
        "Message: 42",
        "Message: stray string",
        "User: (empty)",
        "User: 3.5",
        'User: {"weird": true}',
        "User: 这张截图里的报错是什么意思？\n[image]\n[audio]\n[mystery]\nloose text",
        "Assistant called tool ?()",
        'Assistant called tool read_file({"path": "/etc/hosts"})',
        "Assistant called tool ?(broken)",
        'Assistant called tool lookup({"q": 1})',
        "Tool result [lookup]: found",
        "Assistant: I can't help with that.",
        "System: Reminder: answer in Chinese.",
        "System: Be brief.",
        "Critic: looks fine",
        "Message: no role",
    ]:
        assert expected in text, expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
message_like = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "tool", "function", "system", "x"])
        | json_values,
        "content": json_values,
        "tool_calls": json_values,
        "tool_call_id": json_values,
        "function_call": json_values,
        "name": json_values,
    },
)


@given(st.lists(message_like | json_values, max_size=8), st.integers(min_value=0, max_value=200))
def test_render_never_raises(messages: list[Any], max_item_chars: int) -> None:
    text = render_transcript(messages, max_item_chars)
    assert isinstance(text, str)
    assert isinstance(detect_language(messages), str)


# --- language -----------------------------------------------------------------------

CHINESE_SESSION: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": "帮我看看 proxy/config.py 里的 load_config 为什么读不到环境变量 RECAP_API_KEY",
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "proxy/config.py"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "def load_config(path):\n    ..."},
    {
        "role": "assistant",
        "content": "问题在于 `${RECAP_API_KEY:-}` 的默认值分支：变量为空字符串时也会取默认值。",
    },
    {
        "role": "user",
        "content": (
            "Traceback (most recent call last):\n"
            '  File "proxy/app.py", line 12, in <module>\n'
            "    config = load_config(sys.argv[1])\n"
            "KeyError: 'RECAP_API_KEY' while reading the upstream section of the "
            "configuration file at /etc/recap/config.yaml"
        ),
    },
    {"role": "user", "content": "改完之后还是报这个错，继续查一下，不要改动测试文件"},
]


def test_chinese_session_renders_and_is_detected_as_chinese() -> None:
    text = render_transcript(CHINESE_SESSION)
    assert "User: 帮我看看 proxy/config.py 里的 load_config" in text
    assert "Tool result [read_file]: def load_config(path):" in text
    assert "Assistant: 问题在于" in text
    # One pasted English traceback does not outvote the user's own language.
    assert detect_language(CHINESE_SESSION) == "Chinese"


def test_taubench_sessions_are_english() -> None:
    assert {detect_language(s["messages"]) for s in sessions()} == {"English"}


@pytest.mark.parametrize(
    ("messages", "language"),
    [
        (
            [
                {
                    "role": "user",
                    "content": "My colleague 张伟 booked flight HAT136 for me, please check it.",
                }
            ],
            "English",
        ),
        ([{"role": "user", "content": "このファイルの設定を確認してください。"}], "Japanese"),
        ([{"role": "user", "content": "예약을 취소하고 싶어요"}], "Korean"),
        ([{"role": "user", "content": "请把 README.md 翻译成英文"}], "Chinese"),
        ([{"role": "user", "content": [{"type": "text", "text": "继续"}]}], "Chinese"),
        (
            [
                {"role": "system", "content": "你是一个助手"},
                {"role": "assistant", "content": "好的"},
            ],
            "Chinese",
        ),
        ([{"role": "user", "content": "12345 ???"}], "English"),
        ([], "English"),
    ],
)
def test_detect_language(messages: list[Any], language: str) -> None:
    assert detect_language(messages) == language


def test_render_within_cuts_the_largest_items_first_then_the_whole() -> None:
    def count(text: str) -> int:
        return len(text) // 4

    big = {"role": "tool", "tool_call_id": "c", "content": "HEAD " + "x" * 40_000 + " TAIL"}
    small = [{"role": "user", "content": f"question {i}"} for i in range(5)]
    messages = [*small, big]
    text = render_within(messages, 100_000, 2000, count)
    assert count(text) <= 2000
    # The small items are whole; the large one keeps its head and tail.
    assert all(f"User: question {i}" in text for i in range(5))
    assert "HEAD" in text and "TAIL" in text and "chars omitted]" in text
    # What already fits is rendered as always.
    assert render_within(small, 4000, 2000, count) == render_transcript(small, 4000)
    # Many small items over the budget: the transcript keeps its head and tail.
    many = [{"role": "user", "content": f"q{i} " + "y" * 150} for i in range(400)]
    text = render_within(many, 4000, 1000, count)
    assert count(text) <= 1000 and "q0 " in text and "q399 " in text


# The summary's language is the user's, whatever the agent and its tools write (issue
# 23.26): a Chinese user whose agent answers and fetches in English, and the reverse.
ZH_USER_EN_AGENT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent. Answer in English."},
    {"role": "user", "content": "帮我看看为什么测试失败了，不要改数据库。"},
    {"role": "assistant", "content": "Let me run the test suite and read the failing test first."},
    {"role": "tool", "tool_call_id": "c1", "content": "FAILED tests/test_db.py::test_migrate"},
    {"role": "assistant", "content": "The migration test fails because the schema is stale."},
    {"role": "tool", "tool_call_id": "c2", "content": "ALTER TABLE users ADD COLUMN email"},
]
EN_USER_ZH_PAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "你是一个助手。"},
    {"role": "user", "content": "Summarise this Chinese news site for me in a few lines."},
    {"role": "tool", "tool_call_id": "c1", "content": "今日新闻：央行宣布降息，股市大涨。"},
    {"role": "assistant", "content": "页面标题是今日新闻。"},
    {"role": "tool", "tool_call_id": "c2", "content": "天气预报：明天有雨，气温下降。"},
]


@pytest.mark.parametrize(
    ("messages", "language"), [(ZH_USER_EN_AGENT, "Chinese"), (EN_USER_ZH_PAGES, "English")]
)
def test_the_language_is_the_users_not_the_agents_or_its_tools(
    messages: list[dict[str, Any]], language: str
) -> None:
    assert detect_language(messages) == language
