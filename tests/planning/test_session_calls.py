"""The session compaction planned whole: one snapshot in, the decision and every call out."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from proxy.config import SessionCompaction
from proxy.history.conversation import turn_starts
from proxy.history.messages import Message, is_pinned, split_pinned
from proxy.planning.budget import MIN_TRANSCRIPT_TOKENS
from proxy.planning.outcome import CompactionOutcome, Layer
from proxy.planning.session import AppliedSummary, plan_session, session_view
from proxy.planning.session_calls import (
    SceneWeight,
    SessionSnapshot,
    SummaryRun,
    applied_view,
    compaction_outcome,
    plan_ahead,
    plan_compaction,
    with_applied,
)
from proxy.planning.transcript import render_transcript
from tests.history.test_conversation import count, count_text, long_session

pytestmark = pytest.mark.quick

WINDOW = 8000
POLICY = SessionCompaction(
    min_new_tokens=3000,
    min_new_messages=4,
    min_compact_messages=4,
    min_saving_tokens=300,
    recent_turns=2,
    max_summary_chars=1200,
    max_batch_messages=12,
    max_rounds_per_request=3,
)


def scene(tokens: int = 200, window: int = 32_000) -> SceneWeight:
    return SceneWeight(window, None, lambda values: tokens)


def snapshot(body_end: int = 120, **changes: object) -> SessionSnapshot:
    messages = long_session(seed=3, n_turns=40)[:body_end]
    # End at a turn start: the request being planned is a new user message.
    while messages[-1]["role"] != "user":
        messages.pop()
    pinned, body = split_pinned(messages)
    snap = SessionSnapshot(pinned, body, None, POLICY, WINDOW, count, count_text, scene())
    return dataclasses.replace(snap, **changes)  # type: ignore[arg-type]


def test_one_call_plans_what_plan_session_decides_and_renders_every_transcript() -> None:
    snap = snapshot()
    plan = plan_compaction(snap)
    alone = plan_session(snap.pinned, snap.body, None, POLICY, WINDOW, count, count_text)
    assert plan.compacts and plan.decision.trigger == alone.trigger
    assert [(c.start, c.end) for c in plan.calls] == list(plan.decision.batches)
    for call in plan.calls:
        span = [m for m in snap.body[call.start : call.end] if not is_pinned(m)]
        assert list(call.span) == span
        # Within its room, a transcript is the span rendered whole.
        assert call.transcript == render_transcript(span, POLICY.max_item_chars)
    asked = snap.body[turn_starts(snap.body)[-1]]
    assert plan.current == asked["content"]
    assert plan.values["language"] == "English"
    assert plan.max_tokens > 0 and plan.reason == plan.decision.trigger
    # Pure: the same snapshot, the same plan.
    assert plan_compaction(snap) == plan


def test_a_shared_key_never_shows_the_current_message() -> None:
    plan = plan_compaction(snapshot(shared=True))
    assert plan.compacts and plan.current == "" and plan.values["current_message"] == ""


def test_a_scene_that_fills_the_summarizer_window_leaves_no_call_a_transcript() -> None:
    # The summarizer's window less its output and margin leaves under the minimum.
    heavy = scene(tokens=0, window=MIN_TRANSCRIPT_TOKENS + 150)
    plan = plan_compaction(snapshot(scene=heavy))
    assert plan.compacts
    assert plan.calls[0].transcript is None


def test_below_the_triggers_nothing_is_planned_and_the_skip_says_why() -> None:
    plan = plan_compaction(snapshot(body_end=12))
    assert not plan.compacts and plan.calls == ()
    skipped = plan.skipped(plan.decision.skip_reason, reused=True)
    assert skipped.action == "skipped" and skipped.skip_reason == "below_threshold"
    assert skipped.extra == {"reused": True}


def test_forced_is_manual_in_the_audit_trail() -> None:
    plan = plan_compaction(snapshot(body_end=30, force=True))
    assert plan.compacts and plan.decision.trigger == "forced" and plan.reason == "manual"


@dataclass(frozen=True)
class Answer:
    input_tokens: int = 900
    output_tokens: int = 80
    restored_references: int = 1
    retried: int = 1
    salvaged: int = 0
    model: str = "small"


def test_the_outcome_counts_what_the_calls_folded_and_saved() -> None:
    snap = snapshot()
    plan = plan_compaction(snap)
    run = SummaryRun(None, "m")
    for k, call in enumerate(plan.calls):
        run.add(Answer(), AppliedSummary("s" * 400, call.end, k + 1))
    outcome = compaction_outcome(plan, snap, run, duration_ms=12)
    end = plan.calls[-1].end
    removed = sum(count(m) for m in snap.body[:end])
    assert outcome.action == "compacted" and outcome.count == end
    assert outcome.tokens_after == plan.decision.tokens_before - (removed - 100)
    assert outcome.summarizer_tokens_in == 900 * len(plan.calls)
    assert outcome.length_retries == len(plan.calls) and run.model == "small"
    assert outcome.calls == len(plan.calls) and outcome.duration_ms == 12


def test_a_run_that_failed_before_any_version_reports_failed_with_nothing_saved() -> None:
    snap = snapshot()
    plan = plan_compaction(snap)
    run = SummaryRun(None, "m", failure="timeout")
    outcome = compaction_outcome(plan, snap, run, duration_ms=5)
    assert outcome.action == "failed" and outcome.failure == "timeout"
    assert outcome.tokens_after == plan.decision.tokens_before and outcome.count == 0


@pytest.mark.parametrize(
    "outcome",
    [
        None,
        CompactionOutcome(Layer.SESSION, "skipped", "context_ratio", "anti_loop"),
        CompactionOutcome(Layer.SESSION, "compacted", "min_new_tokens", count=8),
    ],
)
def test_an_applied_summary_is_this_layers_work(outcome: CompactionOutcome | None) -> None:
    applied = AppliedSummary("earlier", 6, 3)
    out = with_applied(outcome, applied)
    assert (out.version, out.covers) == (3, 6)
    if outcome is None or outcome.action == "skipped":
        assert out.action == "applied"
        assert out.skip_reason == (outcome.skip_reason if outcome else None)
    else:
        assert out.action == "compacted" and out.count == 8


def test_the_applied_view_frames_the_summary_in_the_covered_parts_language() -> None:
    body: list[Message] = [
        {"role": "user", "content": "请帮我查一下订单"},
        {"role": "assistant", "content": "好的"},
        {"role": "user", "content": "谢谢"},
    ]
    view = applied_view([], body, AppliedSummary("订单已查", 2, 1), POLICY)
    assert view[1:] == body[2:]
    framed = view[0]
    assert "订单已查" in str(framed["content"]) and "摘要" in str(framed["content"])
    assert view == session_view([], body, 2, framed)


def scene_values_seen() -> tuple[list[Mapping[str, str | int]], SceneWeight]:
    seen: list[Mapping[str, str | int]] = []

    def weigh(values: Mapping[str, str | int]) -> int:
        seen.append(values)
        return 100

    return seen, SceneWeight(32_000, None, weigh)


def test_the_scene_is_weighed_with_the_summary_it_merges_into_and_only_when_it_compacts() -> None:
    seen, weight = scene_values_seen()
    plan_compaction(snapshot(body_end=12, scene=weight))
    assert seen == []  # nothing to cut: the scene is never rendered
    applied = AppliedSummary("so far", 4, 1)
    plan_compaction(snapshot(applied=applied, scene=weight))
    assert seen and all(v["existing_summary"] == "so far" for v in seen)


def even_session(turns: int) -> list[Message]:
    """benchmarks.precompact's shape: a system prompt, then turns of the same size."""
    out: list[Message] = [{"role": "system", "content": "You are a travel agent."}]
    for i in range(turns):
        out.append({"role": "user", "content": f"[u{i}] " + "seat refund " * 60})
        out.append({"role": "assistant", "content": f"[a{i}] " + "gate cabin " * 50})
    return out


@pytest.mark.parametrize(
    ("session", "min_recent_ratio", "window", "trigger"),
    [
        # Turns over a third of min_new_tokens: more than the share's lead.
        ("long", 0.0, 10**6, 2.5),
        # The raw tail kept by the window's ratio moves by whole turns (the local model's run).
        ("even", 0.25, 8_600, 3.3),
    ],
)
def test_planning_ahead_finds_the_summary_the_turn_before_it_is_due(
    session: str, min_recent_ratio: float, window: int, trigger: float
) -> None:
    """At the turn start before the first one that compacts, `plan_ahead` (share 0.8)
    already folds as far as that one will: the summary is ready when it is due. Planned on one
    empty user message it fell a turn short (turns larger than the share's lead; a raw tail
    that moves by whole turns, with a first summary's frame making the smaller slice's saving
    too little)."""
    messages = long_session(seed=3, n_turns=40) if session == "long" else even_session(20)
    pinned, body = split_pinned(messages)
    starts = turn_starts(body)
    turn = max(sum(count(m) for m in body[a:b]) for a, b in itertools.pairwise(starts))
    policy = dataclasses.replace(
        POLICY,
        min_new_tokens=int(turn * trigger),
        min_recent_ratio=min_recent_ratio,
        # benchmarks.precompact's (in this counter's tokens): a first summary's frame makes
        # the saving short of its minimum on a slice one turn smaller than the due one.
        **({"min_saving_tokens": 430, "max_summary_chars": 1500} if session == "even" else {}),
    )

    def snap_at(end: int) -> SessionSnapshot:
        return SessionSnapshot(
            pinned, body[: end + 1], None, policy, window, count, count_text, scene()
        )

    due = next(i for i, s in enumerate(starts) if plan_compaction(snap_at(s)).calls)
    assert due >= 2
    now = plan_compaction(snap_at(starts[due]))
    ahead = plan_ahead(snap_at(starts[due - 1]), share=0.8)
    assert ahead.calls, "the summary the next turn needs was not planned ahead"
    # As far as that turn folds: a shorter summary would leave it a call of its own to wait for.
    assert ahead.calls[-1].end == now.calls[-1].end
    # Far from the trigger nothing is planned ahead.
    assert not plan_ahead(snap_at(starts[1]), share=0.8).calls
