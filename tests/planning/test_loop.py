"""Tests for proxy.planning.loop: a tool loop replayed step by step, as a client sends it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from proxy.config import LoopCompaction
from proxy.history.conversation import tool_rounds, turn_starts
from proxy.history.messages import Classification, Message, classify
from proxy.planning.loop import LoopPlan, LoopState, loop_view, plan_loop
from tests.history.test_conversation import assert_valid, by_task, call, chain, count, tool_loop

pytestmark = pytest.mark.quick

POLICY = LoopCompaction()  # 5 rounds to trigger beyond 5 kept


@dataclass
class Step:
    messages: list[Message]
    state: LoopState | None
    plan: LoopPlan
    view: list[Message]


def working_summary(covered: int) -> Message:
    return {"role": "system", "content": f"<working-summary rounds={covered}>"}


def replay(conversation: Sequence[Message], policy: LoopCompaction = POLICY) -> Iterator[Step]:
    """One tool_continuation request after each complete round, with a per-turn store."""
    states: dict[int, LoopState] = {}  # keyed by the turn's start, as the chain hash would
    for end in range(1, len(conversation) + 1):
        messages = list(conversation[:end])
        if classify(messages) is not Classification.TOOL_CONTINUATION:
            continue
        if end < len(conversation) and conversation[end].get("role") == "tool":
            continue  # parallel results still arriving: not a request
        start = turn_starts(messages)[-1]
        state = states.get(start)
        plan = plan_loop(messages, state, policy, count)
        covered = plan.covered_rounds
        if plan.compact_rounds is not None:
            covered = plan.compact_rounds[1]
            states[start] = LoopState(f"rounds 0..{covered}", covered)
        view = loop_view(messages, covered, working_summary(covered))
        yield Step(messages, state, plan, view)


def test_sixty_step_loop_costs_a_call_every_five_steps() -> None:
    conversation = tool_loop(rounds=60)
    steps = list(replay(conversation))
    assert len(steps) == 60
    calls = [n for n, s in enumerate(steps) if s.plan.compact_rounds is not None]
    assert len(calls) <= 60 // POLICY.loop_trigger_tool_rounds
    assert len(calls) >= 10
    assert all(b - a >= POLICY.loop_trigger_tool_rounds for a, b in itertools.pairwise(calls))
    for step in steps:
        assert_valid(step.view)
        turn = turn_starts(step.messages)[-1]
        # Up to and including the user message, as sent; then the summary if any.
        assert step.view[: turn + 1] == step.messages[: turn + 1]
        raw = [r for r in tool_rounds(step.view) if r.start > turn]
        assert len(raw) < POLICY.loop_recent_tool_rounds + POLICY.loop_trigger_tool_rounds
        assert step.view[-1] is step.messages[-1]
        if step.plan.compact_rounds is not None:
            a, b = step.plan.compact_rounds
            assert a == step.plan.covered_rounds
            assert len(step.plan.rounds) - b == POLICY.loop_recent_tool_rounds
            assert step.plan.trigger == "tool_rounds"
            assert step.view[turn + 1] == working_summary(b)
            assert step.plan.compact_span == (step.plan.boundary(a), step.plan.rounds[b - 1].end)


def test_views_between_compactions_only_grow_at_the_end() -> None:
    steps = list(replay(tool_loop(rounds=30, parallel=3)))
    checked = 0
    for before, after in itertools.pairwise(steps):
        if after.plan.compact_rounds is None:
            assert after.view[: len(before.view)] == before.view
            checked += 1
    assert checked > 15


def test_parallel_calls_and_reused_ids_stay_whole() -> None:
    conversation = tool_loop(rounds=25, parallel=3)
    ids = [c["id"] for m in conversation for c in m.get("tool_calls") or []]
    assert len(ids) > len(set(ids))  # ids are reused within the turn
    for step in replay(conversation):
        assert_valid(step.view)
        for r in tool_rounds(step.view):
            assert r.end - r.start == 4 or r.start < turn_starts(step.view)[-1]


def test_token_trigger_compacts_with_few_huge_rounds() -> None:
    conversation = tool_loop(rounds=6, lines=400)
    policy = LoopCompaction(loop_trigger_tokens=20000)
    steps = list(replay(conversation, policy))
    fired = [s for s in steps if s.plan.compact_rounds is not None]
    assert fired and all(s.plan.trigger == "tokens" for s in fired)
    for s in steps:
        assert_valid(s.view)
        raw = sum(map(count, s.view[turn_starts(s.view)[-1] + 2 :]))
        if s.plan.compact_rounds is not None:
            # What stays raw fits in half the budget unless it is the newest round alone.
            assert raw <= 10000 or len(s.plan.rounds) - s.plan.compact_rounds[1] == 1
    # Hysteresis by tokens too: not on every step.
    assert len(fired) < len(steps) - 1


def test_confirmation_resume_is_part_of_the_turn_and_stays_when_trailing() -> None:
    conversation = tool_loop(rounds=12)
    conversation.append({"role": "user", "content": ""})  # the user approved a pending action
    start = turn_starts(conversation)[-1]
    plan = plan_loop(conversation, None, POLICY, count)
    assert plan.turn_start == start == 3
    assert plan.compact_rounds == (0, 7)
    view = loop_view(conversation, 7, working_summary(7))
    assert view[-1] == {"role": "user", "content": ""}
    assert view[: start + 2] == [*conversation[: start + 1], working_summary(7)]
    assert_valid(view)


def test_rolling_summary_starts_after_covered_rounds() -> None:
    conversation = tool_loop(rounds=22)
    plan = plan_loop(conversation, LoopState("s", 7), POLICY, count)
    assert plan.covered_rounds == 7
    assert plan.compact_rounds == (7, 17)
    assert plan.compact_span == (plan.rounds[6].end, plan.rounds[16].end)


def test_state_that_does_not_fit_is_ignored_and_odd_inputs_skip() -> None:
    conversation = tool_loop(rounds=3)
    plan = plan_loop(conversation, LoopState("s", 9), POLICY, count)
    assert plan.covered_rounds == 0 and plan.skip_reason == "below_threshold"
    assert loop_view(conversation, 9, working_summary(9)) == conversation
    assert loop_view(conversation, 0, working_summary(0)) == conversation
    no_turn = [
        {"role": "system", "content": "s"},
        {"role": "tool", "tool_call_id": "x", "content": "r"},
    ]
    assert plan_loop(no_turn, None, POLICY, count).skip_reason == "no_turn"
    assert loop_view(no_turn, 2, working_summary(2)) == no_turn
    disabled = dataclasses.replace(POLICY, enabled=False)
    assert plan_loop(tool_loop(rounds=40), None, disabled, count).skip_reason == "disabled"


def test_the_newest_round_always_stays_raw() -> None:
    policy = LoopCompaction(loop_recent_tool_rounds=0, loop_trigger_tool_rounds=1)
    conversation = tool_loop(rounds=2)
    plan = plan_loop(conversation, None, policy, count)
    assert plan.compact_rounds == (0, 1)
    huge = tool_loop(rounds=1, lines=2000)
    assert plan_loop(huge, None, LoopCompaction(loop_trigger_tokens=100), count).skip_reason == (
        "nothing_to_compact"
    )


def test_loop_views_of_real_sessions_are_valid(taubench: list[dict[str, Any]]) -> None:
    policy = LoopCompaction(loop_trigger_tool_rounds=1, loop_recent_tool_rounds=1)
    compactions = 0
    for sessions in list(by_task(taubench).values())[:25]:
        for step in replay(chain(sessions), policy):
            assert_valid(step.view)
            compactions += step.plan.compact_rounds is not None
    assert compactions > 10


def test_late_legacy_and_text_messages_between_rounds_stay_raw() -> None:
    conversation: list[Message] = [
        {"role": "user", "content": "go"},
        *[
            m
            for r in range(11)
            for m in (
                {"role": "assistant", "content": None, "tool_calls": [call(f"c{r}", "f")]},
                {"role": "tool", "tool_call_id": f"c{r}", "content": "ok"},
                {"role": "assistant", "content": f"note {r}"},
            )
        ],
        {"role": "assistant", "content": None, "function_call": {"name": "w", "arguments": "{}"}},
        {"role": "function", "name": "w", "content": "sunny"},
    ]
    plan = plan_loop(conversation, None, POLICY, count)
    assert len(plan.rounds) == 12 and plan.compact_rounds == (0, 7)
    view = loop_view(conversation, 7, working_summary(7))
    assert view[2] == {"role": "assistant", "content": "note 6"}  # after round 6, raw
    assert view[-2:] == conversation[-2:]
    assert_valid(view)


def test_rounds_folded_at_once_fit_a_transcript_budget() -> None:
    from proxy.planning.budget import TranscriptBudget

    messages = tool_loop(rounds=12, lines=6)
    weights = [count(m) for m in messages]
    rounds = [r for r in tool_rounds(messages) if r.start > turn_starts(messages)[-1]]
    plain = plan_loop(messages, None, POLICY, count)
    assert plain.compact_rounds == (0, 7)  # 12 rounds, 5 kept raw
    # Room for the first three rounds: the other four wait for the next step.
    first = plain.boundary(0)
    limit = sum(weights[first : rounds[2].end])

    def budget() -> TranscriptBudget:
        return TranscriptBudget(first=limit, later=0, tokens=lambda i: weights[i])

    plan = plan_loop(messages, None, POLICY, count, None, budget)
    assert plan.compact_rounds == (0, 3)
    # The next step folds from there: progress on every step.
    state = LoopState("s", 3)
    later = plan_loop([*messages, *tool_loop(rounds=1)[-2:]], state, POLICY, count, None, budget)
    assert later.compact_rounds is not None and later.compact_rounds[0] == 3
    # One round larger than the budget is still folded (the caller renders it shortened).
    tiny = plan_loop(
        messages, None, POLICY, count, None, lambda: TranscriptBudget(1, 0, budget().tokens)
    )
    assert tiny.compact_rounds == (0, 1)
