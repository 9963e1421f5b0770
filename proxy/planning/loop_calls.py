"""One loop compaction planned whole: the decision, its summarizer call, its report.

Between the loop stage's reads and its writes. Pure: a `LoopSnapshot` (the view the session
stage assembled, the working summary the store found for the running turn, the policies,
the counters and what the planner needs of the summarizer's scene) goes in;
`plan_loop_compaction` returns a `LoopCompactionPlan`: `plan_loop`'s decision plus the one
summarizer call it makes, its transcript rendered, the values the scene is filled with and
the call's `max_tokens`. The stage then only does IO: it sends the call and stores the
working summary it returns, then asks `compaction_outcome` (or `failed_outcome`) what it
did and `applied_view` what goes upstream.

`may_apply` is the stage's probe before any store read: a working set below both triggers
with no working summary has never been compacted (it only grows within a turn), so there
is nothing to look up.

The call's transcript is bounded by the summarizer's context window less the scene, the
goal and the working summary it merges into (`call_limits`, planning/budget.py); `plan_loop`
folds only the due rounds that fit, and a single round too large for the call is cut to fit
(`render_within`). When the scene and the working summary alone leave under
`MIN_TRANSCRIPT_TOKENS`, the call has no transcript and fails as `NO_ROOM`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from proxy.config import LoopCompaction, SessionCompaction
from proxy.history.conversation import turn_starts
from proxy.history.messages import Message, is_pinned
from proxy.planning.budget import MIN_TRANSCRIPT_TOKENS, CallLimits, call_limits, item_weights
from proxy.planning.framing import prompt_chars, summary_message
from proxy.planning.loop import LoopPlan, LoopState, loop_view, plan_loop
from proxy.planning.outcome import CompactionOutcome, Layer
from proxy.planning.session_calls import CallResult, SceneWeight
from proxy.planning.transcript import content_text, detect_language, head_tail, render_within


@dataclass(frozen=True)
class LoopSnapshot:
    """What one request's loop compaction is planned from."""

    # The view as the session stage assembled it: the plan's indices refer to it.
    messages: Sequence[Message]
    # The running turn's working summary the store found (None: none applies).
    state: LoopState | None
    policy: LoopCompaction
    # The session policy: the loop layer shares its item and summary caps and summary role.
    session: SessionCompaction
    context_window: int | None
    count: Callable[[Message], int]
    count_text: Callable[[str], int]
    scene: SceneWeight


@dataclass(frozen=True)
class LoopCall:
    """The summarizer call: it folds `span` into the working summary. `transcript` is None
    when the scene and the working summary leave it no room worth a call (`NO_ROOM`)."""

    transcript: str | None
    # The messages of the due rounds it replaces (instructions excluded: they stay in the view).
    span: tuple[Message, ...]


@dataclass(frozen=True)
class LoopCompactionPlan:
    decision: LoopPlan
    call: LoopCall | None = None
    # The scene's values but the transcript (the working summary merged into included).
    values: Mapping[str, str | int] = field(default_factory=dict)
    max_tokens: int = 0

    @property
    def compacts(self) -> bool:
        return self.decision.compact_rounds is not None

    @property
    def goal(self) -> str:
        """The turn's user message as the scene shows it ("" when nothing compacts)."""
        return str(self.values.get("goal") or "")

    @property
    def reason(self) -> str:
        """Why it compacts, as the audit trail names it."""
        return str(self.decision.trigger)

    @property
    def covered_after(self) -> int:
        """Rounds the working summary covers once the call is folded into it."""
        assert self.decision.compact_rounds is not None
        return self.decision.compact_rounds[1]

    @property
    def summary_index(self) -> int | None:
        """Where the working summary sits in the view: right after the turn's user message."""
        start = self.decision.turn_start
        return None if start is None else start + 1

    @property
    def rounds(self) -> dict[str, int]:
        """The outcome's extra: the running turn's tool rounds."""
        return {"tool_rounds": len(self.decision.rounds)}

    def skipped(self) -> CompactionOutcome:
        return CompactionOutcome(
            Layer.LOOP,
            "skipped",
            self.decision.trigger,
            self.decision.skip_reason,
            extra=self.rounds,
        )


def may_apply(snap: LoopSnapshot) -> bool:
    """Whether a working summary may apply or be due (the snapshot's state is not read):
    the running turn has tool rounds and its working set is not below both triggers."""
    probe = plan_loop(snap.messages, None, snap.policy, snap.count, snap.context_window)
    return probe.skip_reason != "below_threshold" and bool(probe.rounds)


def plan_loop_compaction(snap: LoopSnapshot) -> LoopCompactionPlan:
    """The whole plan of this request's loop compaction (see the module docstring)."""
    session = snap.session

    @functools.cache
    def values() -> dict[str, str | int]:
        return _values(snap)

    @functools.cache
    def limits() -> CallLimits:
        # A message weighs what it takes in the transcript (instructions: nothing, they
        # are not summarised).
        filled = values()
        return call_limits(
            snap.scene.window,
            snap.scene.max_tokens,
            snap.scene.tokens(filled),
            str(filled["existing_summary"]),
            max_chars=session.max_summary_chars,
            language=str(filled["language"]),
            count_text=snap.count_text,
            item_tokens=item_weights(snap.messages, session.max_item_chars, snap.count_text),
        )

    decision = plan_loop(
        snap.messages,
        snap.state,
        snap.policy,
        snap.count,
        snap.context_window,
        lambda: limits().budget,
    )
    span = decision.compact_span
    if span is None:
        return LoopCompactionPlan(decision)
    folded = tuple(m for m in snap.messages[span[0] : span[1]] if not is_pinned(m))
    room = limits().budget.first
    # The rounds fit `room`; a single round too large for it is cut to fit.
    transcript = (
        render_within(list(folded), session.max_item_chars, room, snap.count_text)
        if room >= MIN_TRANSCRIPT_TOKENS
        else None
    )
    return LoopCompactionPlan(decision, LoopCall(transcript, folded), values(), limits().max_tokens)


# The next step's tool round, unknown while the model works on this one: one call, its result.
NEXT_ROUND: tuple[Message, ...] = (
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "recap-next", "type": "function", "function": {"name": "next", "arguments": ""}}
        ],
    },
    {"role": "tool", "tool_call_id": "recap-next", "content": ""},
)


@dataclass(frozen=True)
class LoopBasis:
    """What the loop stage saw of a tool continuation, kept for planning the next step ahead:
    its snapshot (the stored working summary in it) and the hashes its working summaries are
    stored under (`turn_hash`; `hashes[k - 1]`: the history through the k-th tool round,
    which ends at `ends[k - 1]` in the client's body)."""

    snap: LoopSnapshot
    turn_hash: str
    hashes: tuple[str, ...]
    ends: tuple[int, ...]


def plan_loop_ahead(snap: LoopSnapshot) -> tuple[LoopSnapshot, LoopCompactionPlan]:
    """The loop compaction the next step would make, planned while the model works on this
    one (background pre-compaction, stages/ahead.py): on this view and one more tool round.
    Kept only when it folds rounds this view already holds (the next step shares their
    hashes; the new round is not known yet): the planner keeps at least one round raw, so
    this holds by its rules, and is checked all the same. Returns the snapshot it was
    planned on (for the outcome) and the plan; the plan compacts nothing when no such fold
    is due."""
    ahead = dataclasses.replace(snap, messages=[*snap.messages, *NEXT_ROUND])
    plan = plan_loop_compaction(ahead)
    rounds = len(plan.decision.rounds) - 1
    compact = plan.decision.compact_rounds
    if compact is None or compact[1] > rounds:
        return ahead, LoopCompactionPlan(dataclasses.replace(plan.decision, compact_rounds=None))
    return ahead, plan


def compaction_outcome(
    plan: LoopCompactionPlan,
    snap: LoopSnapshot,
    new: LoopState,
    result: CallResult,
    duration_ms: int,
) -> CompactionOutcome:
    """What the call did, for the log, metrics and the client's progress line."""
    decision = plan.decision
    before = _tokens_before(snap)
    old = snap.state
    after = (
        before
        - sum(snap.count(m) for m in _replaced(plan, snap))
        + snap.count_text(new.summary)
        - (snap.count_text(old.summary) if old else 0)
    )
    return CompactionOutcome(
        Layer.LOOP,
        "compacted",
        decision.trigger,
        tokens_before=before,
        tokens_after=after,
        duration_ms=duration_ms,
        count=new.covered_rounds - decision.covered_rounds,
        covers=new.covered_rounds,
        summarizer_tokens_in=result.input_tokens,
        summarizer_tokens_out=result.output_tokens,
        restored_references=result.restored_references,
        calls=1,
        length_retries=int(result.retried),
        salvaged=int(result.salvaged),
        extra=plan.rounds,
    )


def failed_outcome(
    plan: LoopCompactionPlan,
    snap: LoopSnapshot,
    failure: str,
    retried: bool,
    duration_ms: int,
) -> CompactionOutcome:
    """The call failed: the working set goes as it was."""
    before = _tokens_before(snap)
    return CompactionOutcome(
        Layer.LOOP,
        "failed",
        plan.decision.trigger,
        failure=failure,
        tokens_before=before,
        tokens_after=before,
        duration_ms=duration_ms,
        length_retries=int(retried),
        extra=plan.rounds,
    )


def replaced_chars(plan: LoopCompactionPlan, snap: LoopSnapshot, new: LoopState) -> tuple[int, int]:
    """Characters of what the new working summary replaced (the old one and the rounds
    folded since) and of itself, for the audit trail."""
    old = snap.state
    before = sum(len(json.dumps(m, ensure_ascii=False)) for m in _replaced(plan, snap))
    return before + (len(old.summary) if old else 0), len(new.summary)


def with_applied(outcome: CompactionOutcome, state: LoopState) -> CompactionOutcome:
    """The layer's outcome once `state` shortens the view: applying a stored working
    summary is this layer's work too, even when nothing was compacted."""
    if outcome.action == "skipped":
        outcome = dataclasses.replace(outcome, action="applied")
    return dataclasses.replace(outcome, covers=state.covered_rounds)


def applied_view(snap: LoopSnapshot, plan: LoopCompactionPlan, state: LoopState) -> list[Message]:
    """What goes upstream with `state`: up to the turn's user message, the working summary
    framed in the language of the history through it, the newest rounds raw."""
    start = plan.decision.turn_start
    language = detect_language(snap.messages[: (start or 0) + 1])
    message = summary_message(state.summary, snap.session.summary_role, language, "loop")
    return loop_view(snap.messages, state.covered_rounds, message)


def _values(snap: LoopSnapshot) -> dict[str, str | int]:
    """The scene's values but the transcript; asked for only when rounds are due (so the
    running turn has a start)."""
    session, messages = snap.session, snap.messages
    start = turn_starts(messages)[-1]
    goal = head_tail(content_text(messages[start].get("content")), session.max_item_chars)
    return {
        "existing_summary": snap.state.summary if snap.state else "",
        "goal": goal,
        "max_summary_chars": prompt_chars(session.max_summary_chars),
        "language": detect_language(messages[: start + 1]),
    }


def _replaced(plan: LoopCompactionPlan, snap: LoopSnapshot) -> Sequence[Message]:
    """The messages between the applied working summary and the end of the rounds folded
    now (instructions among them included, as counted)."""
    decision = plan.decision
    assert decision.compact_span is not None
    return snap.messages[decision.boundary(decision.covered_rounds) : decision.compact_span[1]]


def _tokens_before(snap: LoopSnapshot) -> int:
    return sum(snap.count(m) for m in snap.messages)
