"""The loop compaction planned whole: one snapshot in, the decision and its call out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from proxy.config import LoopCompaction, SessionCompaction
from proxy.history.conversation import turn_starts
from proxy.history.messages import Message, is_pinned
from proxy.planning.budget import MIN_TRANSCRIPT_TOKENS, call_limits, item_weights
from proxy.planning.framing import prompt_chars, summary_message
from proxy.planning.loop import LoopState, loop_view, plan_loop
from proxy.planning.loop_calls import (
    NEXT_ROUND,
    LoopSnapshot,
    applied_view,
    compaction_outcome,
    failed_outcome,
    may_apply,
    plan_loop_ahead,
    plan_loop_compaction,
    replaced_chars,
    with_applied,
)
from proxy.planning.outcome import CompactionOutcome, Layer
from proxy.planning.session_calls import SceneWeight
from proxy.planning.transcript import render_transcript
from tests.history.test_conversation import count, count_text, tool_loop

pytestmark = pytest.mark.quick

POLICY = LoopCompaction()  # 5 rounds to trigger beyond 5 kept
SESSION = SessionCompaction(max_summary_chars=1200, max_item_chars=800)
WINDOW = 128_000


def scene(tokens: int = 200, window: int = 32_000) -> SceneWeight:
    return SceneWeight(window, None, lambda values: tokens)


def snapshot(rounds: int = 12, **changes: object) -> LoopSnapshot:
    snap = LoopSnapshot(
        tool_loop(rounds=rounds), None, POLICY, SESSION, WINDOW, count, count_text, scene()
    )
    return dataclasses.replace(snap, **changes)  # type: ignore[arg-type]


def test_one_call_plans_what_plan_loop_decides_and_renders_the_transcript() -> None:
    snap = snapshot()
    plan = plan_loop_compaction(snap)
    alone = plan_loop(snap.messages, None, POLICY, count, WINDOW)
    # A summarizer window with room for every due round: the decision plan_loop makes alone.
    assert plan.compacts and plan.decision == alone and alone.compact_rounds == (0, 7)
    assert plan.call is not None and alone.compact_span is not None
    a, b = alone.compact_span
    assert list(plan.call.span) == list(snap.messages[a:b])
    assert plan.call.transcript == render_transcript(plan.call.span, SESSION.max_item_chars)
    assert plan.values == {
        "existing_summary": "",
        "goal": "Fix the failing build.",
        "max_summary_chars": prompt_chars(SESSION.max_summary_chars),
        "language": "English",
    }
    assert plan.goal == "Fix the failing build." and plan.reason == "tool_rounds"
    assert plan.covered_after == 7 and plan.max_tokens > 0
    assert plan.summary_index == turn_starts(snap.messages)[-1] + 1
    # Pure: the same snapshot, the same plan.
    assert plan_loop_compaction(snap) == plan


def test_instructions_among_the_due_rounds_are_no_summarizer_input() -> None:
    messages = tool_loop(rounds=12)
    note = {"role": "system", "content": "Pinned: never push to main."}
    messages.insert(8, note)  # inside the third round's span
    plan = plan_loop_compaction(snapshot(messages=messages))
    assert plan.call is not None and plan.decision.compact_span is not None
    a, b = plan.decision.compact_span
    assert a < 8 < b
    assert note not in plan.call.span and all(not is_pinned(m) for m in plan.call.span)
    assert "never push to main" not in str(plan.call.transcript)


def test_the_turns_goal_is_cut_to_the_item_cap() -> None:
    messages = tool_loop(rounds=12)
    messages[3] = {"role": "user", "content": "Fix it. " + "details " * 1000}
    plan = plan_loop_compaction(snapshot(messages=messages))
    assert plan.compacts and plan.goal.startswith("Fix it.")
    assert len(plan.goal) < 1000 < len(str(messages[3]["content"]))


def test_the_summarizer_window_bounds_the_rounds_folded_at_once() -> None:
    # Room for a few of the seven due rounds only: the others wait for the next step.
    snap = snapshot(scene=scene(window=2000))
    plan = plan_loop_compaction(snap)
    assert plan.compacts and plan.decision.compact_rounds is not None
    assert 1 <= plan.decision.compact_rounds[1] < 7
    limits = call_limits(
        2000,
        None,
        200,
        "",
        max_chars=SESSION.max_summary_chars,
        language="English",
        count_text=count_text,
        item_tokens=item_weights(snap.messages, SESSION.max_item_chars, count_text),
    )
    assert plan.max_tokens == limits.max_tokens
    assert plan.call is not None and plan.call.transcript is not None
    assert count_text(plan.call.transcript) <= limits.budget.first


def test_the_working_summary_merged_into_takes_its_room_and_is_the_scenes() -> None:
    seen: list[Mapping[str, str | int]] = []

    def weigh(values: Mapping[str, str | int]) -> int:
        seen.append(values)
        return 200

    weight = SceneWeight(3500, None, weigh)
    short = plan_loop_compaction(snapshot(rounds=20, scene=weight, state=LoopState("s", 3)))
    long = plan_loop_compaction(
        snapshot(rounds=20, scene=weight, state=LoopState("so far " * 500, 3))
    )
    assert short.decision.compact_rounds is not None and long.decision.compact_rounds is not None
    assert short.decision.compact_rounds[0] == long.decision.compact_rounds[0] == 3
    # The longer summary leaves the transcript less room: fewer rounds fit one call.
    assert long.decision.compact_rounds[1] < short.decision.compact_rounds[1]
    assert long.values["existing_summary"] == "so far " * 500
    assert {v["existing_summary"] for v in seen} == {"s", "so far " * 500}


def test_a_scene_that_fills_the_summarizer_window_leaves_the_call_no_transcript() -> None:
    # The summarizer's window less its output and margin leaves under the minimum.
    plan = plan_loop_compaction(snapshot(scene=scene(tokens=0, window=MIN_TRANSCRIPT_TOKENS + 150)))
    assert plan.compacts and plan.call is not None
    assert plan.call.transcript is None and plan.call.span


def test_below_the_triggers_nothing_is_planned_nor_weighed_and_the_skip_says_why() -> None:
    seen: list[Mapping[str, str | int]] = []

    def weigh(values: Mapping[str, str | int]) -> int:
        seen.append(values)
        return 100

    weight = SceneWeight(32_000, None, weigh)
    snap = snapshot(rounds=6, scene=weight)
    plan = plan_loop_compaction(snap)
    assert not plan.compacts and plan.call is None and plan.values == {}
    assert seen == []  # nothing due: the scene is never rendered
    skipped = plan.skipped()
    assert (skipped.layer, skipped.action, skipped.skip_reason) == (
        Layer.LOOP,
        "skipped",
        "below_threshold",
    )
    assert skipped.extra == {"tool_rounds": 6}
    state = LoopState("s", 7)
    covered = plan_loop_compaction(snapshot(rounds=12, scene=weight, state=state))
    assert covered.skipped().skip_reason == "below_threshold" and seen == []


def test_may_apply_only_with_rounds_not_below_both_triggers() -> None:
    assert may_apply(snapshot(rounds=12))
    # The stored state is not read: the probe is made before it is looked up.
    assert not may_apply(snapshot(rounds=3, state=LoopState("s", 2)))
    # Over the token trigger with no tool round yet: nothing to apply.
    huge: list[Message] = [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "x" * 800_000},
    ]
    assert plan_loop(huge, None, POLICY, count, WINDOW).skip_reason != "below_threshold"
    assert not may_apply(snapshot(messages=huge))


@dataclass(frozen=True)
class Answer:
    input_tokens: int = 900
    output_tokens: int = 80
    restored_references: int = 1
    retried: bool = True
    salvaged: int = 0
    model: str = "small"


@pytest.mark.parametrize("old", [None, LoopState("old " * 50, 3)])
def test_the_outcome_counts_the_rounds_folded_and_the_tokens_saved(old: LoopState | None) -> None:
    snap = snapshot(rounds=20, state=old)
    plan = plan_loop_compaction(snap)
    decision = plan.decision
    assert decision.compact_rounds is not None and decision.compact_span is not None
    new = LoopState("s" * 400, plan.covered_after)
    outcome = compaction_outcome(plan, snap, new, Answer(), duration_ms=12)
    before = sum(map(count, snap.messages))
    replaced = snap.messages[decision.boundary(decision.covered_rounds) : decision.compact_span[1]]
    old_tokens = count_text(old.summary) if old else 0
    assert outcome.action == "compacted" and outcome.trigger == "tool_rounds"
    assert outcome.tokens_before == before
    assert outcome.tokens_after == before - sum(map(count, replaced)) + 100 - old_tokens
    assert outcome.count == plan.covered_after - decision.covered_rounds
    assert outcome.covers == plan.covered_after and outcome.calls == 1
    assert (outcome.summarizer_tokens_in, outcome.summarizer_tokens_out) == (900, 80)
    assert outcome.restored_references == 1 and outcome.length_retries == 1
    assert outcome.duration_ms == 12 and outcome.extra == {"tool_rounds": 20}
    chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in replaced)
    assert replaced_chars(plan, snap, new) == (chars + (len(old.summary) if old else 0), 400)


def test_a_failed_call_reports_the_working_set_unchanged() -> None:
    snap = snapshot()
    plan = plan_loop_compaction(snap)
    outcome = failed_outcome(plan, snap, "timeout", True, duration_ms=5)
    before = sum(map(count, snap.messages))
    assert outcome.action == "failed" and outcome.failure == "timeout"
    assert outcome.tokens_before == outcome.tokens_after == before
    assert outcome.length_retries == 1 and outcome.trigger == "tool_rounds"
    assert outcome.extra == {"tool_rounds": 12} and outcome.duration_ms == 5


@pytest.mark.parametrize(
    "outcome",
    [
        CompactionOutcome(Layer.LOOP, "skipped", "tool_rounds", "nothing_to_compact"),
        CompactionOutcome(Layer.LOOP, "compacted", "tool_rounds", count=5, covers=5),
        CompactionOutcome(Layer.LOOP, "failed", "tokens", failure="timeout"),
    ],
)
def test_an_applied_working_summary_is_this_layers_work(outcome: CompactionOutcome) -> None:
    out = with_applied(outcome, LoopState("s", 7))
    assert out.covers == 7
    assert out.action == ("applied" if outcome.action == "skipped" else outcome.action)
    assert (out.skip_reason, out.failure, out.count) == (
        outcome.skip_reason,
        outcome.failure,
        outcome.count,
    )


def test_the_applied_view_frames_the_working_summary_in_the_turns_language() -> None:
    messages = tool_loop(rounds=12)
    messages[1:4] = [
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "你好！"},
        {"role": "user", "content": "请修复构建失败的问题。"},
    ]
    session = dataclasses.replace(SESSION, summary_role="user")
    snap = snapshot(messages=messages, session=session)
    plan = plan_loop_compaction(snap)
    state = LoopState("已读取日志", 7)
    view = applied_view(snap, plan, state)
    framed = summary_message("已读取日志", "user", "Chinese", "loop")
    assert view == loop_view(messages, 7, framed)
    assert view[4] == framed and view[:4] == messages[:4]


def test_planned_ahead_the_next_steps_fold_is_made_of_the_rounds_this_view_holds() -> None:
    # 9 rounds: not due now (5 beyond the 5 kept would be 10); with the next step's round,
    # 5 of these 9 are due, and none of the unknown round.
    snap = snapshot(rounds=9)
    assert not plan_loop_compaction(snap).compacts
    ahead, plan = plan_loop_ahead(snap)
    assert list(ahead.messages) == [*snap.messages, *NEXT_ROUND]
    assert len(plan.decision.rounds) == 10  # the placeholder is a round of its own
    assert plan.compacts and plan.decision.compact_rounds == (0, 5)
    assert plan.call is not None and all(m not in NEXT_ROUND for m in plan.call.span)
    # Far from due even then: nothing.
    _, early = plan_loop_ahead(snapshot(rounds=6))
    assert not early.compacts and early.call is None
