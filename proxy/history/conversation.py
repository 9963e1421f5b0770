"""Structure of a chat history: turns, tool rounds, where it may be cut, whether it is valid.

Used by every planner (session, loop, trim) between classification and planning, and by
tests and benchmarks to prove that each history we forward would be accepted upstream.
Pure and tolerant: messages are the client's raw JSON objects, possibly malformed; nothing
here raises on odd input or mutates a message.

Vocabulary (seed 003):
- A turn starts at a user message WITH content. A user message without content is a
  confirmation resume: it continues the running turn.
- A tool round is an assistant message that calls tools (`tool_calls`, or the legacy
  `function_call`) plus every result that answers it. Tool call ids are not unique
  within a session (clients reuse them), so a result belongs to the nearest preceding
  call with its id that has not been answered yet.
- A cut point is an index i where history[:i] and history[i:] can be separated without
  leaving a call without its results or a result without its call.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.history.messages import has_content

RESULT_ROLES = frozenset({"tool", "function"})
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Legacy function calls carry no id: the function name stands in for it.
_LEGACY_PREFIX = "function_call:"


@dataclass(frozen=True)
class Turn:
    """Messages [start, end) of one turn; start is its user message."""

    start: int
    end: int


@dataclass(frozen=True)
class ToolRound:
    """Messages [start, end): the calling assistant message and the results answering it.

    `call_ids` are the calls' ids in order (a legacy function call appears as
    "function_call:<name>"). In a valid history the round is contiguous; in a broken one a
    late result stretches `end`, which only makes cutting more careful.
    """

    start: int
    end: int
    call_ids: tuple[str, ...]


def is_turn_start(message: Any) -> bool:
    return isinstance(message, Mapping) and message.get("role") == "user" and has_content(message)


def turn_starts(messages: Sequence[Any]) -> list[int]:
    return [i for i, m in enumerate(messages) if is_turn_start(m)]


def turns(messages: Sequence[Any]) -> list[Turn]:
    """Each turn runs from its user message to the next turn's; anything before the first
    turn (pinned messages, a greeting by the assistant) belongs to no turn."""
    starts = turn_starts(messages)
    return [Turn(s, e) for s, e in itertools.pairwise([*starts, len(messages)])]


def calls_of(message: Any) -> list[tuple[str, str]]:
    """(call id, function name) of each call an assistant message makes; [] if none."""
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return []
    out: list[tuple[str, str]] = []
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if not isinstance(call, Mapping):
                continue
            call_id = call.get("id")
            function = call.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
            out.append((call_id if isinstance(call_id, str) else "", _text(name)))
    function_call = message.get("function_call")
    if isinstance(function_call, Mapping):
        name = _text(function_call.get("name"))
        out.append((_LEGACY_PREFIX + name, name))
    return out


def result_key(message: Any) -> str | None:
    """The call id a tool (or legacy function) result answers; None if it is not a result."""
    if not isinstance(message, Mapping):
        return None
    role = message.get("role")
    if role == "tool":
        call_id = message.get("tool_call_id")
        return call_id if isinstance(call_id, str) else ""
    if role == "function":
        return _LEGACY_PREFIX + _text(message.get("name"))
    return None


def match_results(messages: Sequence[Any]) -> dict[int, int]:
    """Index of each result -> index of the assistant message whose call it answers.

    A result answers the nearest preceding unanswered call with its id. Results that answer
    nothing (orphans) are absent from the map.
    """
    open_calls: dict[str, list[int]] = {}
    matched: dict[int, int] = {}
    for i, m in enumerate(messages):
        for call_id, _ in calls_of(m):
            open_calls.setdefault(call_id, []).append(i)
        key = result_key(m)
        if key is not None:
            stack = open_calls.get(key)
            if stack:
                matched[i] = stack.pop()
    return matched


def tool_rounds(messages: Sequence[Any]) -> list[ToolRound]:
    """Every tool round, in order of its calling message."""
    ends: dict[int, int] = {}
    ids: dict[int, tuple[str, ...]] = {}
    for i, m in enumerate(messages):
        calls = calls_of(m)
        if calls:
            ends[i] = i + 1
            ids[i] = tuple(call_id for call_id, _ in calls)
    for result, call in match_results(messages).items():
        ends[call] = max(ends[call], result + 1)
    return [ToolRound(start, ends[start], ids[start]) for start in sorted(ends)]


def valid_cut_points(messages: Sequence[Any]) -> list[int]:
    """Indices i (0..len inclusive) where messages[:i] / messages[i:] orphan nothing.

    Inside a tool round is never a cut point, nor is the place just before a result (an
    orphaned result stays with whatever precedes it). 0 and len(messages) always are.
    """
    n = len(messages)
    depth = [0] * (n + 2)
    for r in tool_rounds(messages):
        depth[r.start + 1] += 1
        depth[r.end] -= 1
    out: list[int] = []
    inside = 0
    for i in range(n + 1):
        inside += depth[i]
        if i in (0, n) or (inside == 0 and result_key(messages[i]) is None):
            out.append(i)
    return out


def turn_cut_points(messages: Sequence[Any]) -> list[int]:
    """Valid cut points just before a turn-starting user message: where sessions are cut."""
    return [
        i for i in valid_cut_points(messages) if i < len(messages) and is_turn_start(messages[i])
    ]


def check_history(messages: Any) -> list[str]:
    """Problems that would make an OpenAI-compatible upstream reject this history; [] if none.

    Checked: every message an object with a known role; content where the role needs it;
    tool_calls well formed; each result right after the call it answers (only results may
    sit between a call and its answer), at most once; every call answered before the next
    non-result message. A call at the very end is flagged too: a request never ends with a
    call awaiting results. Never raises.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        return ["messages is not a list"]
    if not messages:
        return ["no messages"]
    problems: list[str] = []
    # The round being answered: index of its calling message, ids still unanswered.
    round_at: int | None = None
    waiting: list[str] = []

    def close_round() -> None:
        nonlocal round_at
        if round_at is not None and waiting:
            problems.append(f"message {round_at}: no result for call(s) {', '.join(waiting)}")
        round_at = None
        waiting.clear()

    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            close_round()
            problems.append(f"message {i}: not an object")
            continue
        role = m.get("role")
        key = result_key(m)
        if key is not None:
            problems.extend(_check_result(i, m, key, round_at, waiting))
            continue
        close_round()
        if not isinstance(role, str) or role not in _ROLES:
            problems.append(f"message {i}: unknown role {role!r}")
            continue
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            problems.append(f"message {i}: content is neither text nor a list of parts")
        if role == "assistant":
            problems.extend(_check_calls(i, m))
            calls = calls_of(m)
            if not calls and content is None:
                problems.append(f"message {i}: assistant message without content or tool calls")
            if calls:
                round_at = i
                waiting.extend(call_id for call_id, _ in calls)
        elif content is None:
            problems.append(f"message {i}: {role} message without content")
    close_round()
    return problems


def _check_result(
    i: int, m: Mapping[str, Any], key: str, round_at: int | None, waiting: list[str]
) -> list[str]:
    problems: list[str] = []
    what = "function result" if m.get("role") == "function" else "tool result"
    if m.get("role") == "tool" and not key:
        problems.append(f"message {i}: tool message without tool_call_id")
    elif round_at is None:
        problems.append(f"message {i}: {what} {key!r} without a preceding call")
    elif key not in waiting:
        problems.append(f"message {i}: {what} {key!r} answers no open call of message {round_at}")
    else:
        waiting.remove(key)
    if m.get("content") is None:
        problems.append(f"message {i}: {what} without content")
    return problems


def _check_calls(i: int, m: Mapping[str, Any]) -> list[str]:
    tool_calls = m.get("tool_calls")
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list) or not tool_calls:
        return [f"message {i}: tool_calls is not a non-empty list"]
    problems: list[str] = []
    seen: set[str] = set()
    for n, call in enumerate(tool_calls):
        where = f"message {i}: tool call {n}"
        if not isinstance(call, Mapping):
            problems.append(f"{where} is not an object")
            continue
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            problems.append(f"{where} has no id")
        elif call_id in seen:
            problems.append(f"{where} repeats id {call_id!r}")
        else:
            seen.add(call_id)
        function = call.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            problems.append(f"{where} has no function name")
        elif not isinstance(function.get("arguments"), str):
            problems.append(f"{where} arguments are not a string")
    return problems


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
