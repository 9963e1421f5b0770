"""Tests for proxy.planning.trim: placeholders for old tool results, and the last resort."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import TrimCompaction
from proxy.history.conversation import check_history, tool_rounds, turn_starts
from proxy.history.messages import Message, fingerprint
from proxy.planning.trim import (
    ARCHIVE_SCHEME,
    TrimPlan,
    apply_trim,
    fit_to_window,
    plan_trim,
    trimmed_content,
)
from tests.history.test_conversation import (
    assert_valid,
    by_task,
    call,
    chain,
    count,
    long_session,
    tool_loop,
)

POLICY = TrimCompaction()  # 50% of the window, keep 3 rounds, results over 2000 characters


def dumps(messages: list[Message]) -> bytes:
    return json.dumps(messages, ensure_ascii=False).encode()


def test_nothing_is_trimmed_below_the_trigger() -> None:
    messages = tool_loop(rounds=10, lines=60)
    total = sum(map(count, messages))
    plan = plan_trim(messages, POLICY, int(total / 0.5) + 10, count, len(messages))
    assert plan == TrimPlan()
    assert apply_trim(messages, plan) == messages


def test_old_large_results_become_placeholders_and_nothing_else_changes() -> None:
    messages = long_session(seed=4, n_turns=30, max_lines=80)
    original = copy.deepcopy(messages)
    plan = plan_trim(messages, POLICY, 20000, count, len(messages))
    trimmed = apply_trim(messages, plan)
    assert messages == original  # never mutated
    assert plan.trimmed == len(plan.replacements) > 20
    recent = tool_rounds(messages)[-POLICY.trim_keep_recent :]
    saved = 0
    for i, (old, new) in enumerate(zip(messages, trimmed, strict=True)):
        if i not in plan.replacements:
            assert new is old
            continue
        assert old["role"] == "tool" and i < recent[0].start
        assert len(old["content"]) > POLICY.trim_min_chars
        assert {k: v for k, v in new.items() if k != "content"} == {
            k: v for k, v in old.items() if k != "content"
        }
        content = new["content"]
        lines = old["content"].splitlines()
        assert f"tool: {old['name']}" in content and f"call id: {old['tool_call_id']}" in content
        assert f"{len(old['content'])} characters, {len(lines)} lines" in content
        assert f"{ARCHIVE_SCHEME}{fingerprint(old)}" in content
        assert f"first line: {lines[0][:200]}" in content
        assert content.endswith(lines[-1][-200:])
        saved += len(old["content"]) - len(content)
    assert saved == plan.saved_chars
    assert sum(map(count, trimmed)) < sum(map(count, messages)) / 2
    assert_valid(trimmed)


def test_user_messages_answers_excluded_tools_and_protected_tail_are_kept() -> None:
    messages = long_session(seed=5, n_turns=30, max_lines=80)
    for m in messages:  # make every message long enough to be a candidate
        if m["role"] in ("user", "assistant") and isinstance(m.get("content"), str):
            m["content"] += " long" * 1000
    policy = TrimCompaction(trim_exclude_tools=("shell",), trim_keep_recent=0)
    protect_from = len(messages) // 2
    plan = plan_trim(messages, policy, 20000, count, protect_from)
    assert plan.replacements
    for i in plan.replacements:
        assert messages[i]["role"] == "tool" and messages[i]["name"] != "shell"
        assert i < protect_from
    skipped = [
        i
        for i, m in enumerate(messages[:protect_from])
        if m["role"] == "tool" and m["name"] == "shell" and len(m["content"]) > 2000
    ]
    assert skipped  # there were shell results to skip


def test_tool_name_comes_from_the_call_when_the_result_has_none() -> None:
    result = {"role": "tool", "tool_call_id": "c1", "content": "x\n" * 3000}
    messages: list[Message] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "grep")]},
        result,
        {"role": "assistant", "content": "done"},
    ]
    plan = plan_trim(messages, TrimCompaction(trim_keep_recent=0), 100, count, len(messages))
    assert "tool: grep;" in plan.replacements[2]["content"]
    excluded = TrimCompaction(trim_keep_recent=0, trim_exclude_tools=("grep",))
    assert plan_trim(messages, excluded, 100, count, len(messages)).trimmed == 0


def test_text_parts_are_trimmed_other_parts_are_not() -> None:
    parts = [{"type": "text", "text": "a" * 3000}, {"type": "text", "text": "\nend"}]
    image = [{"type": "image_url", "image_url": {"url": "data:..." + "A" * 5000}}]
    messages: list[Message] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call("a", "f"), call("b", "g")]},
        {"role": "tool", "tool_call_id": "a", "content": parts},
        {"role": "tool", "tool_call_id": "b", "content": image},
        {"role": "assistant", "content": "done"},
    ]
    plan = plan_trim(messages, TrimCompaction(trim_keep_recent=0), 100, count, len(messages))
    assert list(plan.replacements) == [2]
    assert "3004 characters, 2 lines" in plan.replacements[2]["content"]


def test_trimming_is_byte_stable_across_requests(taubench: list[dict[str, Any]]) -> None:
    """A trimmed message gives the same bytes in every later request, so the prefix that
    upstream prompt caches hold keeps matching."""
    tasks = by_task(taubench)
    conversation = chain([s for t in range(10) for s in tasks[t]])
    policy = TrimCompaction(trim_min_chars=500, trim_keep_recent=2)
    seen: dict[int, str] = {}
    previous: list[Message] | None = None
    requests = 0
    for end in range(2, len(conversation) + 1):
        messages = conversation[:end]
        if messages[-1]["role"] not in ("user", "tool"):
            continue
        plan = plan_trim(messages, policy, 8000, count, len(messages))
        out = apply_trim(messages, plan)
        assert_valid(out)
        for i, m in plan.replacements.items():
            text = json.dumps(m, ensure_ascii=False)
            assert seen.setdefault(i, text) == text
        if previous is not None:
            # Besides results trimmed for the first time, every message keeps its bytes.
            for i, before in enumerate(previous):
                if not (i in plan.replacements and before is conversation[i]):
                    assert dumps([out[i]]) == dumps([before])
        previous = out
        requests += 1
    assert len(seen) > 50 and requests > 100


def test_placeholder_is_a_function_of_the_message() -> None:
    m = {
        "role": "tool",
        "tool_call_id": "x",
        "name": "f",
        "content": "first\n" + "mid\n" * 900 + "last",
    }
    a = trimmed_content(m, m["content"], "f")
    assert a == trimmed_content(copy.deepcopy(m), m["content"], "f")
    assert a.splitlines()[-2:] == ["first line: first", "last line: last"]
    single = {**m, "content": "[" + "1, " * 3000 + "2]"}
    b = trimmed_content(single, single["content"], "f")
    assert "first line: [1, 1," in b and b.endswith("1, 2]") and len(b) < 800


def _turns_conversation(n: int) -> list[Message]:
    messages: list[Message] = [{"role": "system", "content": "s"}]
    for t in range(n):
        messages += [
            {"role": "user", "content": f"q{t}"},
            {"role": "assistant", "content": None, "tool_calls": [call(f"c{t % 3}", "f")]},
            {"role": "tool", "tool_call_id": f"c{t % 3}", "content": "r" * 2000},
            {"role": "assistant", "content": f"a{t}"},
        ]
    return messages


def test_fit_to_window_drops_whole_old_turns_first() -> None:
    messages = _turns_conversation(10)
    summary = {"role": "system", "content": "<summary>"}
    messages.insert(1, summary)
    current = turn_starts(messages)[-1]
    window = 2000
    out, dropped = fit_to_window(1, messages, 1, current, window, count)
    assert sum(map(count, out)) <= window
    assert out[:2] == messages[:2] and out[-4:] == messages[-4:]
    assert dropped == len(messages) - len(out) and dropped % 4 == 0
    assert_valid(out)
    assert fit_to_window(1, messages, 1, current, 10**6, count) == (messages, 0)


def test_fit_to_window_then_drops_rounds_of_the_running_turn_keeping_the_newest() -> None:
    messages = tool_loop(rounds=20, lines=40)
    current = turn_starts(messages)[-1]
    out, dropped = fit_to_window(1, messages, None, current, 3000, count)
    assert out[0] is messages[0] and messages[current] in out
    assert out[-2:] == messages[-2:]
    assert dropped > 0 and out.index(messages[current]) == 1  # the hello turn went first
    assert_valid(out)
    # Too big even then: the protected messages are what remains.
    out, _ = fit_to_window(1, messages, None, current, 10, count)
    assert out == [messages[0], messages[current], *messages[-2:]]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 12),
    window=st.integers(50, 6000),
    keep=st.integers(0, 4),
    data=st.data(),
)
def test_trim_and_fit_always_leave_a_valid_history(
    n: int, window: int, keep: int, data: st.DataObject
) -> None:
    messages = long_session(seed=data.draw(st.integers(0, 10**6)), n_turns=n, max_lines=80)
    policy = TrimCompaction(trim_keep_recent=keep, trim_min_chars=data.draw(st.integers(0, 3000)))
    protect_from = data.draw(st.integers(0, len(messages)))
    out = apply_trim(messages, plan_trim(messages, policy, window, count, protect_from))
    assert check_history(out) == check_history(messages) == []
    current = turn_starts(out)[-1]
    fitted, dropped = fit_to_window(1, out, None, current, window, count)
    assert check_history(fitted) == []
    assert len(fitted) + dropped == len(out)
    assert out[current] in fitted and fitted[0] is out[0]


def test_fit_drops_earlier_turns_but_keeps_the_loop_summary() -> None:
    big = "x" * 4000
    msgs: list[dict] = [{"role": "system", "content": "sys"}]
    for t in range(3):  # earlier turns, raw
        msgs += [
            {"role": "user", "content": f"turn {t} {big}"},
            {"role": "assistant", "content": big},
        ]
    current = len(msgs)
    msgs.append({"role": "user", "content": "current goal"})
    loop_summary = len(msgs)
    msgs.append({"role": "system", "content": "<recap-summary>working</recap-summary>"})
    for r in range(3):
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{r}",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{r}", "content": big},
        ]

    def count(m: dict) -> int:
        return len(str(m.get("content") or "")) // 4 + 4

    out, dropped = fit_to_window(1, msgs, None, current, 4000, count, loop_summary)
    assert dropped > 0
    assert msgs[loop_summary] in out and msgs[current] in out and out[0] == msgs[0]
    assert all(m not in out for m in msgs[1:current])  # the earlier turns went first
    assert check_history(out) == []
