"""Tests for proxy.history.conversation: turns, tool rounds, cut points and the validity check.

Also home of the history generators the compaction planner tests replay (long sessions
with parallel calls, reused ids, long outputs, confirmation resumes; long tool loops) and of
the helpers that chain real tau-bench sessions into one long conversation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.history.conversation import (
    ToolRound,
    Turn,
    check_history,
    match_results,
    tool_rounds,
    turn_cut_points,
    turn_starts,
    turns,
    valid_cut_points,
)

Msg = dict[str, Any]


# --- shared helpers (imported by tests/planning/test_{session,loop,trim}.py) --------------


def count(m: Any) -> int:
    """A deterministic stand-in for the token counter: about 4 characters a token."""
    return len(json.dumps(m, ensure_ascii=False)) // 4 + 4


def count_text(text: str) -> int:
    return len(text) // 4


def chain(sessions: Sequence[dict[str, Any]]) -> list[Msg]:
    """Several tau-bench sessions as one conversation: later sessions lose their system message."""
    out: list[Msg] = []
    for n, s in enumerate(sessions):
        msgs = s["messages"]
        out.extend(msgs if n == 0 else [m for m in msgs if m["role"] != "system"])
    return out


def by_task(taubench: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    tasks: dict[int, list[dict[str, Any]]] = {}
    for s in taubench:
        tasks.setdefault(s["task_id"], []).append(s)
    return tasks


def call(call_id: str, name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    arguments = json.dumps(args or {})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_output(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"row {i}: "
        + " ".join(rng.choice(["alpha", "beta", "航班", "gamma", "42"]) for _ in range(12))
        for i in range(lines)
    )


def long_session(
    seed: int = 0, n_turns: int = 80, max_rounds: int = 4, max_lines: int = 60
) -> list[Msg]:
    """A generated session: parallel calls, ids reused from a small pool, long outputs,
    assistant messages with both text and calls, and confirmation resumes (empty user)."""
    rng = random.Random(seed)
    msgs: list[Msg] = [{"role": "system", "content": "You are a careful agent."}]
    pool = [f"call_{k}" for k in range(6)]
    for t in range(n_turns):
        msgs.append(
            {"role": "user", "content": f"Request {t}: " + "please help " * rng.randint(1, 20)}
        )
        for r in range(rng.randint(0, max_rounds)):
            ids = rng.sample(pool, rng.randint(1, 3))
            calls = [call(i, rng.choice(["search", "read_file", "shell"]), {"q": t}) for i in ids]
            content = f"Step {r}, checking." if rng.random() < 0.3 else None
            msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            for i in rng.sample(ids, len(ids)):  # results in any order
                name = next(c["function"]["name"] for c in calls if c["id"] == i)
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": i,
                        "name": name,
                        "content": tool_output(rng, rng.randint(1, max_lines)),
                    }
                )
            if rng.random() < 0.1:
                msgs.append({"role": "user", "content": ""})  # confirmation resume
        msgs.append({"role": "assistant", "content": f"Done with request {t}."})
    return msgs


def tool_loop(rounds: int = 60, lines: int = 30, parallel: int = 1, seed: int = 1) -> list[Msg]:
    """One turn: a system prompt, an earlier exchange, a user task and `rounds` tool rounds.
    Call ids repeat every few rounds, as real clients do."""
    rng = random.Random(seed)
    msgs: list[Msg] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Fix the failing build."},
    ]
    for r in range(rounds):
        ids = [f"call_{(r + k) % 4}_{k}" for k in range(parallel)]
        msgs.append(
            {"role": "assistant", "content": None, "tool_calls": [call(i, "shell") for i in ids]}
        )
        for i in ids:
            msgs.append({"role": "tool", "tool_call_id": i, "content": tool_output(rng, lines)})
    return msgs


def assert_valid(messages: Sequence[Any]) -> None:
    problems = check_history(messages)
    assert problems == [], problems


# --- turns ------------------------------------------------------------------------------------


def test_turns_start_at_user_messages_with_content_only() -> None:
    msgs: list[Msg] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "book a flight"},
        {"role": "assistant", "content": None, "tool_calls": [call("a", "book")]},
        {"role": "tool", "tool_call_id": "a", "content": "needs confirmation"},
        {"role": "user", "content": ""},  # confirmation resume: same turn
        {"role": "assistant", "content": "Booked."},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
        {"role": "user", "content": []},
    ]
    assert turn_starts(msgs) == [1, 6]
    assert turns(msgs) == [Turn(1, 6), Turn(6, 8)]
    assert turn_cut_points(msgs) == [1, 6]


def test_turns_of_history_without_user_messages_is_empty() -> None:
    assert turns([{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]) == []
    assert turn_starts(["garbage", None, 3]) == []


# --- tool rounds ------------------------------------------------------------------------------


def test_parallel_calls_form_one_round_with_results_in_any_order() -> None:
    msgs: list[Msg] = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [call("a", "f"), call("b", "g")],
        },
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "assistant", "content": "Done."},
    ]
    assert tool_rounds(msgs) == [ToolRound(1, 4, ("a", "b"))]
    assert valid_cut_points(msgs) == [0, 1, 4, 5]


def test_reused_ids_match_the_nearest_open_call() -> None:
    msgs: list[Msg] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call("x", "f")]},
        {"role": "tool", "tool_call_id": "x", "content": "1"},
        {"role": "assistant", "content": None, "tool_calls": [call("x", "f")]},
        {"role": "tool", "tool_call_id": "x", "content": "2"},
    ]
    assert match_results(msgs) == {2: 1, 4: 3}
    assert tool_rounds(msgs) == [ToolRound(1, 3, ("x",)), ToolRound(3, 5, ("x",))]


def test_an_unanswered_call_does_not_steal_a_later_result_of_its_id() -> None:
    msgs: list[Msg] = [
        {"role": "assistant", "content": None, "tool_calls": [call("x", "f")]},
        {"role": "user", "content": "never mind"},
        {"role": "assistant", "content": None, "tool_calls": [call("x", "f")]},
        {"role": "tool", "tool_call_id": "x", "content": "r"},
    ]
    assert match_results(msgs) == {3: 2}
    assert tool_rounds(msgs) == [ToolRound(0, 1, ("x",)), ToolRound(2, 4, ("x",))]
    assert check_history(msgs) == ["message 0: no result for call(s) x"]


def test_legacy_function_call_is_a_round() -> None:
    msgs: list[Msg] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "function_call": {"name": "w", "arguments": "{}"}},
        {"role": "function", "name": "w", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert tool_rounds(msgs) == [ToolRound(1, 3, ("function_call:w",))]
    assert valid_cut_points(msgs) == [0, 1, 3, 4]
    assert_valid(msgs)


def test_a_late_result_stretches_its_round_so_nothing_cuts_between() -> None:
    msgs: list[Msg] = [
        {"role": "assistant", "content": None, "tool_calls": [call("x", "f")]},
        {"role": "user", "content": "hm"},
        {"role": "tool", "tool_call_id": "x", "content": "late"},
        {"role": "user", "content": "ok"},
    ]
    assert tool_rounds(msgs) == [ToolRound(0, 3, ("x",))]
    assert valid_cut_points(msgs) == [0, 3, 4]
    assert turn_cut_points(msgs) == [3]


def test_an_orphan_result_stays_with_what_precedes_it() -> None:
    msgs: list[Msg] = [
        {"role": "user", "content": "q"},
        {"role": "tool", "tool_call_id": "nobody", "content": "?"},
        {"role": "assistant", "content": "a"},
    ]
    assert tool_rounds(msgs) == []
    assert valid_cut_points(msgs) == [0, 2, 3]


# --- cut points on real and generated histories -----------------------------------------------


def _assert_cuts_exact(msgs: list[Msg]) -> None:
    """A valid history splits into two valid halves exactly at its valid cut points."""
    cuts = set(valid_cut_points(msgs))
    for i in range(1, len(msgs)):
        halves_ok = not check_history(msgs[:i]) and not check_history(msgs[i:])
        assert halves_ok == (i in cuts), (i, check_history(msgs[:i]), check_history(msgs[i:]))


def test_cut_points_are_exactly_the_valid_splits_of_real_sessions(
    taubench: list[dict[str, Any]],
) -> None:
    for session in taubench[:30]:
        msgs = session["messages"]
        assert_valid(msgs)
        _assert_cuts_exact(msgs)


def test_cut_points_are_exactly_the_valid_splits_of_generated_sessions() -> None:
    msgs = long_session(seed=3, n_turns=40)
    assert len(msgs) > 200
    assert_valid(msgs)
    _assert_cuts_exact(msgs)
    assert any(len(r.call_ids) > 1 for r in tool_rounds(msgs))


def test_every_real_session_and_chain_is_valid_and_rounds_cover_all_results(
    taubench: list[dict[str, Any]],
) -> None:
    reused = 0
    for sessions in by_task(taubench).values():
        msgs = chain(sessions)
        assert_valid(msgs)
        results = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
        assert sorted(match_results(msgs)) == results
        ids = [c["id"] for m in msgs for c in m.get("tool_calls") or []]
        reused += len(ids) != len(set(ids))
    assert reused > 10  # the data's known quirk is really exercised


# --- check_history ----------------------------------------------------------------------------


def test_check_history_names_each_problem() -> None:
    cases: list[tuple[Any, str]] = [
        ("not a list", "messages is not a list"),
        ([], "no messages"),
        ([42], "message 0: not an object"),
        ([{"content": "x"}], "message 0: unknown role None"),
        ([{"role": "user"}], "message 0: user message without content"),
        ([{"role": "user", "content": 3}], "message 0: content is neither text nor a list"),
        ([{"role": "tool", "tool_call_id": "a", "content": "r"}], "without a preceding call"),
        ([{"role": "assistant", "content": None}], "without content or tool calls"),
        ([{"role": "assistant", "content": None, "tool_calls": []}], "not a non-empty list"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}],
            "tool call 0 has no id",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [call("a", "f")] * 2}],
            "repeats id 'a'",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [call("a", "f")]}],
            "message 0: no result for call(s) a",
        ),
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [call("a", "f")]},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
                {"role": "tool", "tool_call_id": "a", "content": "2"},
            ],
            "message 2: tool result 'a' answers no open call of message 0",
        ),
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [call("a", "f")]},
                {"role": "user", "content": "wait"},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
            ],
            "message 2: tool result 'a' without a preceding call",
        ),
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [call("a", "f")]},
                {"role": "tool", "content": "1"},
            ],
            "message 1: tool message without tool_call_id",
        ),
        (
            [{"role": "function", "name": "w", "content": "1"}],
            "function result 'function_call:w' without a preceding call",
        ),
    ]
    for messages, expected in cases:
        problems = check_history(messages)
        assert any(expected in p for p in problems), (messages, problems)


def test_check_history_flags_a_call_awaiting_results_at_the_end(
    taubench: list[dict[str, Any]],
) -> None:
    msgs = taubench[0]["messages"]
    last_call = max(i for i, m in enumerate(msgs) if m.get("tool_calls"))
    assert check_history(msgs[: last_call + 1]) == [
        f"message {last_call}: no result for call(s) {msgs[last_call]['tool_calls'][0]['id']}"
    ]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "tool", "function", "system", "x"]) | _json,
        "content": st.none() | st.text(max_size=5) | _json,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": st.sampled_from(["a", "b"]) | _json,
                    "function": st.fixed_dictionaries({"name": st.text(max_size=2)}) | _json,
                },
            )
            | _json,
            max_size=3,
        )
        | _json,
        "tool_call_id": st.sampled_from(["a", "b"]) | _json,
        "function_call": _json,
        "name": _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_message | _json, max_size=8) | _json)
def test_garbage_is_reported_never_raised(messages: Any) -> None:
    problems = check_history(messages)
    assert isinstance(problems, list)
    if isinstance(messages, list):
        turns(messages)
        rounds = tool_rounds(messages)
        cuts = valid_cut_points(messages)
        assert cuts[0] == 0 and cuts[-1] == len(messages)
        for r in rounds:
            assert not any(r.start < c < r.end for c in cuts)
