"""Tests for proxy.planning.session: replaying real and generated conversations turn by turn.

The replay plays client and store: each turn-starting prefix of a conversation is a request;
a compaction's result is "stored" and applied to later requests whose body still starts with
the covered messages. A fake summarizer stands in for the model (a bounded text).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from proxy.config import SessionCompaction
from proxy.history.conversation import tool_rounds, turn_cut_points, turn_starts, valid_cut_points
from proxy.history.messages import Classification, Message, classify, split_pinned
from proxy.history.tokens import TokenCounter
from proxy.planning import framing
from proxy.planning.session import (
    CHARS_PER_TOKEN,
    AppliedSummary,
    SessionPlan,
    plan_session,
    quiet_reason,
    session_view,
)
from tests.history.test_conversation import (
    assert_valid,
    by_task,
    chain,
    count,
    count_text,
    long_session,
    tool_loop,
)

WINDOW = 8000
# Small enough that compaction fires on tau-bench conversations in an 8K window.
SMALL = SessionCompaction(
    min_new_tokens=3000,
    min_new_messages=4,
    min_compact_messages=4,
    min_saving_tokens=300,
    recent_turns=2,
    max_summary_chars=1200,
    max_batch_messages=12,
    max_rounds_per_request=3,
)


@dataclass
class Step:
    pinned: list[Message]
    body: list[Message]
    applied: AppliedSummary | None
    plan: SessionPlan
    view: list[Message]
    summary_message: Message | None


def fake_summary(previous: str, batch: Sequence[Message], limit: int) -> str:
    """Merge a batch into the summary the way a summarizer would: bounded, newest kept."""
    notes = [str(m.get("content"))[:60] for m in batch if m.get("role") == "user"]
    return (previous + " | " + "; ".join(notes))[-limit:]


def summary_message(text: str) -> Message:
    return {"role": "system", "content": f"<summary>{text}</summary>"}


def replay(
    conversation: Sequence[Message],
    policy: SessionCompaction,
    window: int = WINDOW,
    counter: Any = count,
    text_counter: Any = count_text,
) -> Iterator[Step]:
    """One turn_start request per turn start, with a store that keeps the latest summary."""
    stored: tuple[AppliedSummary, list[Message]] | None = None
    for end in range(1, len(conversation) + 1):
        prefix = conversation[:end]
        if classify(prefix) is not Classification.TURN_START:
            continue
        pinned, body = split_pinned(prefix)
        applied = None
        if stored is not None and body[: stored[0].covered] == stored[1]:
            applied = stored[0]
        plan = plan_session(pinned, body, applied, policy, window, counter, text_counter)
        summary = applied.summary if applied else ""
        covered = applied.covered if applied else 0
        if plan.compacts:
            for start, stop in plan.batches:
                summary = fake_summary(summary, body[start:stop], policy.max_summary_chars)
            covered = plan.new_covered
            version = applied.version + 1 if applied else 1
            stored = (AppliedSummary(summary, covered, version), body[:covered])
        message = summary_message(summary) if covered else None
        view = session_view(pinned, body, covered, message)
        yield Step(pinned, body, applied, plan, view, message)


def check_step(step: Step, policy: SessionCompaction, window: int = WINDOW) -> None:
    """What must hold for every request, whatever the plan decided."""
    plan, body = step.plan, step.body
    assert_valid(step.view)
    assert step.view[: len(step.pinned)] == step.pinned
    if step.summary_message is not None:
        assert step.view[len(step.pinned)] is step.summary_message
    covered = step.applied.covered if step.applied else 0
    assert plan.applied == step.applied
    if not plan.compacts:
        assert plan.new_covered == covered
        assert plan.skip_reason is not None
        return
    assert plan.skip_reason is None and plan.trigger is not None
    assert plan.batches[0][0] == covered
    cuts = set(valid_cut_points(body))
    for (a, b), (c, _) in zip(
        plan.batches, [*plan.batches[1:], (plan.new_covered, 0)], strict=True
    ):
        assert a < b == c and b in cuts
        one_round = any(r.start == a and r.end == b for r in tool_rounds(body))
        assert b - a <= policy.max_batch_messages or one_round
    assert len(plan.batches) <= policy.max_rounds_per_request
    current = turn_starts(body)[-1]
    assert plan.new_covered <= current  # the current turn always stays raw
    assert plan.tokens_after_estimate <= plan.tokens_before


def test_replay_of_real_conversations_in_a_small_window(taubench: list[dict[str, Any]]) -> None:
    compactions = requests = 0
    for sessions in by_task(taubench).values():
        for step in replay(chain(sessions), SMALL):
            check_step(step, SMALL)
            requests += 1
            if step.plan.compacts:
                compactions += 1
                assert step.plan.new_covered in turn_cut_points(step.body)
    assert compactions > 30 and requests > 10 * compactions


def test_replay_of_a_long_chain_keeps_recent_turns_and_ratio_raw(
    taubench: list[dict[str, Any]],
) -> None:
    tasks = by_task(taubench)
    conversation = chain([s for t in range(12) for s in tasks[t]])
    assert len(conversation) > 500
    policy = dataclasses.replace(SMALL, recent_turns=3, min_recent_ratio=0.25)
    window = 20000  # the first trigger fires well before the window fills
    relaxed = ratio_wins = 0
    for step in replay(conversation, policy, window):
        check_step(step, policy, window)
        plan, body = step.plan, step.body
        if not plan.compacts:
            continue
        tail = body[plan.new_covered :]
        covered = step.applied.covered if step.applied else 0
        kept_turns = len(turn_starts(tail))
        turns_available = len([c for c in turn_cut_points(body) if c >= covered])
        if plan.tokens_before < window * policy.trigger_ratio:
            # Without pressure both rules hold: recent turns and a quarter of the window.
            assert kept_turns >= min(policy.recent_turns, turns_available)
            assert sum(map(count, tail)) >= policy.min_recent_ratio * window
            relaxed += 1
            ratio_wins += kept_turns > policy.recent_turns
    assert relaxed > 5 and ratio_wins > 0  # the ratio rule really kept more than the turn rule


def test_real_token_counter_end_to_end(taubench: list[dict[str, Any]]) -> None:
    counter = TokenCounter()

    def count_real(m: Message) -> int:
        return counter.count_message(m, "gpt-4o")

    def count_text_real(t: str) -> int:
        return counter.count_text(t, "gpt-4o")

    tasks = by_task(taubench)
    conversation = chain([s for t in range(6) for s in tasks[t]])
    steps = list(replay(conversation, SMALL, WINDOW, count_real, count_text_real))
    for step in steps:
        check_step(step, SMALL)
    compacted = [s for s in steps if s.plan.compacts]
    assert compacted
    last = steps[-1]
    assert counter.count_messages(last.view) < counter.count_messages(last.pinned + last.body)


def test_views_between_compactions_extend_the_previous_bytes(
    taubench: list[dict[str, Any]],
) -> None:
    tasks = by_task(taubench)
    steps = list(replay(chain(tasks[3] + tasks[4] + tasks[5]), SMALL))
    checked = 0
    for before, after in itertools.pairwise(steps):
        if after.plan.compacts:
            continue
        old = json.dumps(before.view, ensure_ascii=False)[:-1]  # without the closing bracket
        assert json.dumps(after.view, ensure_ascii=False).startswith(old)
        checked += 1
    assert checked > 10


def _compaction_steps(
    conversation: list[Message], policy: SessionCompaction
) -> tuple[list[int], list[Step]]:
    steps = list(replay(conversation, policy))
    for step in steps:
        check_step(step, policy)
    return [n for n, s in enumerate(steps) if s.plan.compacts], steps


def _gaps(turns: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(turns)]


@pytest.mark.parametrize(
    ("system_words", "answer_words"),
    [
        # The pinned prompt alone is over the trigger; answers long enough that folding four
        # turns saves more than the first summary's frame costs.
        (3400, 200),
        (400, 2400),  # long answers: the recent turns alone are over it
    ],
)
def test_no_compaction_loop_when_what_stays_raw_is_over_the_trigger(
    system_words: int, answer_words: int
) -> None:
    """Compaction must wait for enough new history instead of firing on every turn."""
    conversation: list[Message] = [{"role": "system", "content": "policy " * system_words}]
    for t in range(60):
        conversation.append({"role": "user", "content": f"question {t}"})
        conversation.append({"role": "assistant", "content": f"answer {t} " + "x " * answer_words})
    policy = SessionCompaction(
        min_new_tokens=10**9,
        min_new_messages=8,
        min_compact_messages=8,
        min_saving_tokens=20,
        max_summary_chars=400,
    )
    turns, steps = _compaction_steps(conversation, policy)
    assert len(turns) >= 10  # it still makes progress
    # Each fold consumes 8 messages (4 turns) of new history; the first may come late (when
    # it first saves enough), and the next then as soon as 8 more messages are there.
    assert all(steps[n].plan.new_covered - steps[n].plan.batches[0][0] >= 8 for n in turns)
    assert min(_gaps(turns)[1:]) >= 4
    if system_words > 1000:
        # Over the trigger on every request, compacting on one in four.
        assert all(s.plan.tokens_before >= WINDOW * policy.trigger_ratio for s in steps[8:])
        assert sum(s.plan.skip_reason == "anti_loop" for s in steps) > 2 * len(turns)

    # The same replay without the rule compacts on consecutive turns: the test can tell.
    loose = dataclasses.replace(
        policy, min_new_messages=1, min_compact_messages=1, min_saving_tokens=0
    )
    loose_turns, _ = _compaction_steps(conversation, loose)
    assert min(_gaps(loose_turns)) == 1


def test_compactions_are_bounded_by_new_history_in_a_long_generated_session() -> None:
    conversation = long_session(seed=7, n_turns=120)
    assert len(conversation) > 500
    policy = SessionCompaction(min_new_tokens=8000, max_batch_messages=40, max_rounds_per_request=4)
    window = 32000
    steps = list(replay(conversation, policy, window))
    consumed = 0
    for step in steps:
        check_step(step, policy, window)
        plan = step.plan
        if plan.compacts:
            covered = step.applied.covered if step.applied else 0
            consumed += plan.new_covered - covered
            taken = sum(map(count, step.body[covered : plan.new_covered]))
            assert plan.new_covered - covered >= policy.min_new_messages or taken >= 8000
    compactions = sum(s.plan.compacts for s in steps)
    assert compactions >= 3
    assert compactions <= consumed // policy.min_new_messages
    # The outgoing request stays near the window however long the session gets.
    assert max(sum(map(count, s.view)) for s in steps[len(steps) // 2 :]) < window * 1.2


def test_first_trigger_counts_only_what_can_be_compacted() -> None:
    conversation = long_session(seed=2, n_turns=60, max_lines=80)
    policy = SessionCompaction(min_new_tokens=20000, min_recent_ratio=0.0)
    window = 1_000_000  # never near the window: only the first trigger can fire
    steps = list(replay(conversation, policy, window))
    fired = [s for s in steps if s.plan.compacts]
    assert fired and all(s.plan.trigger == "min_new_tokens" for s in fired)
    for s in fired:
        covered = s.applied.covered if s.applied else 0
        assert sum(map(count, s.body[covered : s.plan.new_covered])) >= 20000
        # ... and the raw tail is never what pushed it over.
        assert len(turn_starts(s.body[s.plan.new_covered :])) >= policy.recent_turns


def _big_turns(n: int, lines: int) -> list[Message]:
    conversation: list[Message] = [*tool_loop(rounds=0)[:3]]  # system, hello, hi
    for t in range(n):
        conversation += tool_loop(rounds=6, lines=lines, seed=t)[3:]  # a user task and 6 rounds
        conversation.append({"role": "assistant", "content": f"finished task {t}"})
    conversation.append({"role": "user", "content": "and now?"})
    return conversation


def test_over_the_window_with_few_huge_turns_keeps_fewer_turns() -> None:
    conversation = _big_turns(3, lines=40)
    pinned, body = split_pinned(conversation)
    assert len(turn_starts(body)) == 5  # fewer than recent_turns: retention keeps everything
    policy = SessionCompaction()
    window = 12000
    plan = plan_session(pinned, body, None, policy, window, count, count_text)
    assert plan.tokens_before > window * policy.trigger_ratio
    assert plan.compacts and plan.trigger == "context_ratio"
    # As many turns as possible stay: the first cut that leaves ten messages to compact.
    cuts = turn_cut_points(body)
    assert plan.new_covered == next(c for c in cuts if c >= policy.min_compact_messages)
    assert plan.new_covered < cuts[-1]


def test_forced_compaction_bypasses_thresholds_but_needs_something() -> None:
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "one " * 4000},
        {"role": "assistant", "content": "1 " * 4000},
        {"role": "user", "content": "two"},
    ]
    pinned, body = split_pinned(conversation)
    policy = SessionCompaction()
    # Force means force (issue 12.5): even a tiny slice is folded, whatever the saving.
    tiny = [
        conversation[0],
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    tiny_plan = plan_session(
        tiny[:1], [*tiny[1:], conversation[3]], None, policy, 96000, count, count_text, True
    )
    assert tiny_plan.skip_reason is None and tiny_plan.batches == ((0, 2),)
    # Forced folds everything before the current turn, recent turns included.
    many = [conversation[0]]
    for i in range(8):
        many += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    many.append({"role": "user", "content": "now"})
    all_plan = plan_session(many[:1], many[1:], None, policy, 96000, count, count_text, True)
    assert all_plan.new_covered == 16
    plan = plan_session(pinned, body, None, policy, 96000, count, count_text)
    assert plan.skip_reason == "below_threshold" and not plan.compacts
    forced = plan_session(pinned, body, None, policy, 96000, count, count_text, force=True)
    assert forced.trigger == "forced" and forced.batches == ((0, 2),)
    disabled = dataclasses.replace(policy, enabled=False)
    assert plan_session(pinned, body, None, disabled, 96000, count, count_text).skip_reason == (
        "disabled"
    )
    assert plan_session(pinned, body, None, disabled, 96000, count, count_text, True).compacts
    applied = AppliedSummary("s", 2, 1)
    again = plan_session(pinned, body, applied, policy, 96000, count, count_text, force=True)
    assert again.skip_reason == "nothing_to_compact" and again.new_covered == 2


def test_saving_below_min_and_invalid_boundary() -> None:
    conversation: list[Message] = [{"role": "system", "content": "s" * 20000}]
    for t in range(12):
        conversation += [
            {"role": "user", "content": f"q{t}"},
            {"role": "assistant", "content": "a"},
        ]
    conversation.append({"role": "user", "content": "now"})
    pinned, body = split_pinned(conversation)
    plan = plan_session(pinned, body, None, SessionCompaction(), 6000, count, count_text)
    assert plan.trigger == "context_ratio" and plan.skip_reason == "saving_below_min"
    with pytest.raises(ValueError):
        plan_session(
            pinned, body, AppliedSummary("x", 99, 1), SessionCompaction(), 6000, count, count_text
        )


def test_batches_cut_inside_a_turn_longer_than_a_batch() -> None:
    conversation = tool_loop(rounds=60, lines=3)
    conversation += [
        {"role": "assistant", "content": "Build fixed."},
        {"role": "user", "content": "Thanks, now deploy."},
    ]
    pinned, body = split_pinned(conversation)
    loop_start, current = turn_starts(body)[-2:]
    policy = SessionCompaction(max_batch_messages=20, recent_turns=1, min_recent_ratio=0.0)
    plan = plan_session(pinned, body, None, policy, 96000, count, count_text, force=True)
    assert plan.new_covered == current
    ends = [b for _, b in plan.batches]
    inside = [e for e in ends if loop_start < e < current]
    assert inside and all(e in valid_cut_points(body) for e in inside)
    assert all(b - a <= 20 for a, b in plan.batches)

    # Too few rounds to reach the turn's end: the boundary goes back to a turn start...
    short = dataclasses.replace(policy, max_rounds_per_request=2)
    plan = plan_session(pinned, body, None, short, 96000, count, count_text, force=True)
    assert plan.batches == ((0, loop_start),)
    # ... unless no batch ends at one: then progress wins, at a valid cut inside the turn.
    applied = AppliedSummary("x", loop_start, 1)
    plan = plan_session(pinned, body, applied, short, 96000, count, count_text, force=True)
    assert len(plan.batches) == 2 and loop_start < plan.new_covered < current
    view = session_view(pinned, body, plan.new_covered, summary_message("x"))
    assert_valid(view)


def test_a_single_round_larger_than_a_batch_goes_whole() -> None:
    conversation = tool_loop(rounds=2, parallel=30, lines=1)
    conversation.append({"role": "user", "content": "next"})
    pinned, body = split_pinned(conversation)
    policy = SessionCompaction(max_batch_messages=10, recent_turns=1, min_recent_ratio=0.0)
    plan = plan_session(pinned, body, None, policy, 96000, count, count_text, force=True)
    rounds = tool_rounds(body)
    assert (rounds[0].start, rounds[0].end) in plan.batches
    assert plan.new_covered == turn_starts(body)[-1]


def test_replace_mode_summarises_everything_but_the_current_turn(
    taubench: list[dict[str, Any]],
) -> None:
    policy = dataclasses.replace(SMALL, mode="replace", max_rounds_per_request=30)
    tasks = by_task(taubench)
    fired = 0
    for step in replay(chain(tasks[7] + tasks[8]), policy):
        check_step(step, policy)
        if step.plan.compacts:
            fired += 1
            current = turn_starts(step.body)[-1]
            assert step.plan.new_covered == current
            assert step.view == [*step.pinned, step.summary_message, *step.body[current:]]
    assert fired


def test_session_view_without_summary_is_the_request() -> None:
    pinned = [{"role": "system", "content": "s"}]
    body = [{"role": "user", "content": "q"}]
    assert session_view(pinned, body, 0, None) == pinned + body
    summary = summary_message("x")
    assert session_view(pinned, body, 0, summary) == [*pinned, summary, *body]


def test_batches_fit_a_transcript_budget_in_tokens() -> None:
    from proxy.planning.budget import TranscriptBudget

    conversation = long_session(seed=6, n_turns=40)
    pinned, body = split_pinned(conversation)
    weights = [count(m) for m in body]
    policy = SessionCompaction(recent_turns=1, min_recent_ratio=0.0, max_rounds_per_request=100)
    asked: list[int] = []

    def budget() -> TranscriptBudget:
        asked.append(1)
        return TranscriptBudget(first=3000, later=2000, tokens=lambda i: weights[i])

    plan = plan_session(pinned, body, None, policy, 96000, count, count_text, True, budget)
    unbounded = plan_session(pinned, body, None, policy, 96000, count, count_text, force=True)
    assert asked == [1]  # asked for once, when there were batches to cut
    assert len(plan.batches) > len(unbounded.batches)
    assert plan.new_covered == unbounded.new_covered  # the same history folded
    for k, (a, b) in enumerate(plan.batches):
        assert (
            sum(weights[a:b]) <= (3000 if k == 0 else 2000)
            or b - a == 1
            or (
                # a tool round too large for a batch goes whole
                any((r.start, r.end) == (a, b) for r in tool_rounds(body))
            )
        )
    assert all(e in valid_cut_points(body) for _, e in plan.batches)
    # No budget asked for when nothing is compacted.
    asked.clear()
    quiet = plan_session(
        pinned, body[:3], None, SessionCompaction(), 96000, count, count_text, budget=budget
    )
    assert not quiet.compacts and asked == []


def test_a_token_budget_fills_a_batch_past_a_short_turn() -> None:
    """Each call rewrites the whole summary: ending a batch at a short turn's end would
    cost a call for a few tokens."""
    from proxy.planning.budget import TranscriptBudget

    conversation = tool_loop(rounds=12, lines=6)
    conversation += [
        {"role": "assistant", "content": "Build fixed."},
        {"role": "user", "content": "Thanks, now deploy."},
    ]
    pinned, body = split_pinned(conversation)
    loop_start = turn_starts(body)[-2]
    weights = [count(m) for m in body]
    limit = sum(weights[: loop_start + 8])  # the short turn and about four rounds
    policy = SessionCompaction(recent_turns=1, min_recent_ratio=0.0, max_rounds_per_request=100)

    def budget() -> TranscriptBudget:
        return TranscriptBudget(first=limit, later=limit, tokens=lambda i: weights[i])

    plan = plan_session(pinned, body, None, policy, 96000, count, count_text, True, budget)
    first_end = plan.batches[0][1]
    assert loop_start < first_end and first_end in valid_cut_points(body)
    assert all(sum(weights[a:b]) <= limit for a, b in plan.batches)


@pytest.mark.parametrize(
    "policy",
    [SMALL, SessionCompaction(), dataclasses.replace(SMALL, min_new_tokens=50_000)],
    ids=["small", "defaults", "ratio_only"],
)
def test_quiet_reason_is_the_reason_plan_session_gives(
    taubench: list[dict[str, Any]], policy: SessionCompaction
) -> None:
    """Told from an upper bound without counting, the skip reason is plan_session's own; it
    stays silent (None) whenever plan_session may compact."""
    told = 0
    prefixes = [
        m for sessions in by_task(taubench).values() for m in _turn_prefixes(chain(sessions))
    ]
    prefixes += _turn_prefixes(long_session(seed=3, n_turns=40))
    for messages in prefixes:
        pinned, body = split_pinned(messages)
        total = sum(count(m) for m in messages)
        for bound, room in itertools.product((total, total + 500, 2 * total), (None, 1500)):
            reason = quiet_reason(body, policy, WINDOW, bound, room)
            if reason is None:
                continue
            told += 1
            plan = plan_session(pinned, body, None, policy, WINDOW, count, count_text, room=room)
            assert not plan.compacts and plan.skip_reason == reason
    assert told > 50
    assert quiet_reason(body, dataclasses.replace(policy, enabled=False), WINDOW, 0) == "disabled"


def _turn_prefixes(messages: list[Message]) -> list[list[Message]]:
    return [messages[: start + 1] for start in turn_starts(messages)]


# -- the window wins: what would be dropped whole is folded ----------------------------------

# SMALL, with batches large and many enough for whole sessions.
WIDE = dataclasses.replace(SMALL, max_batch_messages=200, max_rounds_per_request=8)


def _view_tokens(pinned: list[Message], body: list[Message], plan: SessionPlan) -> int:
    """The view's estimate after the plan, its summary at the planner's own cap."""
    summary = min(
        SMALL.max_summary_chars // CHARS_PER_TOKEN, sum(count(m) for m in body[: plan.new_covered])
    )
    return int(sum(map(count, pinned)) + summary + sum(map(count, body[plan.new_covered :])))


def test_recent_turns_over_the_room_are_folded_rather_than_dropped() -> None:
    messages = _big_turns(5, lines=30)
    pinned, body = split_pinned(messages)
    whole = sum(map(count, messages))
    last_two = turn_starts(body)[-3]  # the two turns before the current one
    room = sum(map(count, body[last_two:])) - 200  # the retention rule's raw tail is over it
    assert room < whole
    kept = plan_session(pinned, body, None, WIDE, WINDOW * 4, count, count_text)
    fitted = plan_session(pinned, body, None, WIDE, WINDOW * 4, count, count_text, room=room)
    assert kept.compacts and fitted.compacts
    # Without a room, two turns stay raw; with it, fewer do, and the view fits.
    assert kept.new_covered <= last_two < fitted.new_covered
    assert _view_tokens(pinned, body, fitted) <= room
    assert fitted.new_covered in turn_cut_points(body)  # a turn is never split
    assert_valid(session_view(pinned, body, fitted.new_covered, {"role": "user", "content": "S"}))


def test_over_the_room_the_anti_loop_and_saving_rules_give_way() -> None:
    messages = _big_turns(2, lines=10)
    pinned, body = split_pinned(messages)
    strict = dataclasses.replace(SMALL, min_new_messages=50, min_saving_tokens=50_000)
    whole = sum(map(count, messages))
    under = plan_session(pinned, body, None, strict, 10 * whole, count, count_text, room=whole)
    assert not under.compacts
    over = plan_session(pinned, body, None, strict, whole, count, count_text, room=whole - 50)
    assert over.compacts and over.trigger == "context_ratio"
    # Under the trigger ratio, over the room only: the trigger says which.
    roomy = plan_session(pinned, body, None, strict, 10 * whole, count, count_text, room=whole - 50)
    assert roomy.compacts and roomy.trigger == "over_window"


def test_a_tool_continuation_over_the_room_folds_every_turn_before_the_running_one() -> None:
    messages = _big_turns(4, lines=20)[:-1]
    messages += tool_loop(rounds=6, lines=30, seed=9)[3:]  # the running turn: a long loop
    assert classify(messages) == Classification.TOOL_CONTINUATION
    pinned, body = split_pinned(messages)
    whole = sum(map(count, messages))
    running = turn_starts(body)[-1]

    def plan(room: int | None) -> SessionPlan:
        return plan_session(
            pinned, body, None, WIDE, WINDOW * 4, count, count_text, room=room, continuation=True
        )

    assert plan(None).skip_reason == "below_threshold"
    assert plan(whole).skip_reason == "below_threshold"  # it fits: the loop layer's turn
    over = plan(whole - 1)
    assert over.compacts and over.trigger == "over_window"
    assert over.batches[0][0] == 0
    assert over.new_covered == running  # the running turn stays raw, whole
    # Once folded, nothing before the running turn is left: later rounds compact nothing.
    applied = AppliedSummary("S", over.new_covered, 1)
    again = plan_session(
        pinned, body, applied, WIDE, WINDOW * 4, count, count_text, room=1, continuation=True
    )
    assert not again.compacts and again.skip_reason == "nothing_to_compact"


def test_the_stored_summary_weighs_what_its_framed_message_sends() -> None:
    """The view the planner weighs is the one sent: the stored summary in its frame (the
    framing text and tags, a few hundred tokens over the bare text) and the instructions
    inside the covered part. In the band where the bare count fits the room and the framed
    one does not, the turn is folded, not left for the last resort to drop."""
    turns = [
        [
            {"role": "user", "content": f"Step {i}: " + "tell me more about the plan. " * 12},
            {"role": "assistant", "content": f"Answer {i}: " + "here is the plan. " * 14},
        ]
        for i in range(6)
    ]
    pinned: list[Message] = [{"role": "system", "content": "You are a planner."}]
    covered_part = [*turns[0], {"role": "system", "content": "Be brief. " * 10}, *turns[1]]
    body: list[Message] = [
        *covered_part,
        *[m for t in turns[2:] for m in t],
        {"role": "user", "content": "And now?"},
    ]
    covered = len(covered_part)
    applied = AppliedSummary("The user is planning a trip; " * 20, covered, 1)
    policy = dataclasses.replace(SMALL, min_new_messages=20, recent_turns=4)
    sent = framing.summary_message(applied.summary, policy.summary_role, "English", "session")
    view = sum(map(count, session_view(pinned, body, covered, sent)))
    bare = sum(map(count, pinned)) + count_text(applied.summary) + sum(map(count, body[covered:]))
    room = (bare + view) // 2
    assert bare <= room < view  # the band: the bare summary fits, the framed one does not
    window = room + 100  # over the trigger ratio: only the anti-loop rule holds the fold back
    plan = plan_session(pinned, body, applied, policy, window, count, count_text, room=room)
    # Failed before: skip_reason "anti_loop", and fit_to_window dropped the oldest turn.
    assert plan.compacts and plan.skip_reason is None, plan.skip_reason
    assert plan.tokens_before == view
    assert plan.tokens_after_estimate <= room
    # Under the room by the framed count, the anti-loop rule holds again.
    calm = plan_session(pinned, body, applied, policy, window, count, count_text, room=view)
    assert not calm.compacts and calm.skip_reason == "anti_loop"
