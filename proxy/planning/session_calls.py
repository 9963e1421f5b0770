"""One session compaction planned whole: the decision, its summarizer calls, its report.

Between the session stage's reads and its writes. Pure: a `SessionSnapshot` (the request's
history, the summary the store found for it, the policy, the counters and what the planner
needs of the summarizer's scene) goes in; `plan_compaction` returns a `CompactionPlan`:
`plan_session`'s decision plus every summarizer call it makes, each with its transcript
rendered, and the values the scene is filled with. The stage then only does IO: it sends
the calls in order (each merging into the summary the last one wrote) and stores each
result, then asks `compaction_outcome` what it did and `applied_view` what goes upstream.

Why the calls are planned up front: the transcripts, the limits and the values depend on
the history and the summary the compaction starts from, never on what a call answers (a
later call's room is reserved for the largest summary the cap allows, planning/budget.py),
so one snapshot fixes them all; the stage has nothing left to decide between calls but
whether to go on after a failure (it never does: a failed call ends the compaction, and
the versions stored before it stay).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from proxy.config import SessionCompaction
from proxy.history.conversation import turn_starts
from proxy.history.messages import Message, is_pinned
from proxy.planning.budget import MIN_TRANSCRIPT_TOKENS, CallLimits, call_limits, item_weights
from proxy.planning.framing import prompt_chars, summary_message
from proxy.planning.outcome import CompactionOutcome, Layer
from proxy.planning.riding import RidingFallback, SummaryInput
from proxy.planning.session import AppliedSummary, SessionPlan, plan_session, session_view
from proxy.planning.transcript import content_text, detect_language, head_tail, render_within

# The failure of a call whose transcript would have no room worth a call.
NO_ROOM = "summarizer context_window too small"


@dataclass(frozen=True)
class SceneWeight:
    """What the planner needs of the summarizer and its scene: the summarizer's window, the
    scene's own `max_tokens`, and what the scene weighs rendered with given values (its
    transcript and summary blank: `stages.summarize.scene_tokens`)."""

    window: int
    max_tokens: int | None
    tokens: Callable[[Mapping[str, str | int]], int]


@dataclass(frozen=True)
class SessionSnapshot:
    """What one request's session compaction is planned from."""

    pinned: Sequence[Message]
    body: Sequence[Message]
    applied: AppliedSummary | None
    policy: SessionCompaction
    context_window: int
    count: Callable[[Message], int]
    count_text: Callable[[str], int]
    scene: SceneWeight
    room: int | None = None
    force: bool = False
    continuation: bool = False
    # A derived conversation key: other users share its summary, so the current message
    # (only this user's) is no summarizer input.
    shared: bool = False


@dataclass(frozen=True)
class SummaryCall:
    """One summarizer call: it folds body[start:end] into the summary so far. `transcript`
    is None when the scene and the summary leave it no room worth a call (`NO_ROOM`)."""

    start: int
    end: int
    transcript: str | None
    # The messages it replaces (instructions excluded: they stay in the view).
    span: tuple[Message, ...]


@dataclass(frozen=True)
class CompactionPlan:
    decision: SessionPlan
    calls: tuple[SummaryCall, ...] = ()
    # The scene's values but the transcript and the existing summary.
    values: Mapping[str, str | int] = field(default_factory=dict)
    max_tokens: int = 0

    @property
    def compacts(self) -> bool:
        return self.decision.compacts

    @property
    def applied(self) -> AppliedSummary | None:
        return self.decision.applied

    @property
    def current(self) -> str:
        """The message being answered as the scene shows it ("" when it is not shown)."""
        return str(self.values.get("current_message") or "")

    @property
    def reason(self) -> str:
        """Why it compacts, as the store and the audit trail name it: a forced compaction
        is a manual one, whether from the API, the CLI or the header."""
        trigger = self.decision.trigger
        return "manual" if trigger == "forced" else str(trigger)

    def skipped(self, reason: str | None, reused: bool = False) -> CompactionOutcome:
        return CompactionOutcome(
            Layer.SESSION,
            "skipped",
            trigger=self.decision.trigger,
            skip_reason=reason,
            extra={"reused": True} if reused else {},
        )


def plan_compaction(snap: SessionSnapshot) -> CompactionPlan:
    """The whole plan of this request's session compaction (see the module docstring)."""
    policy, body = snap.policy, snap.body
    summary = snap.applied.summary if snap.applied else ""
    values = _values(snap)

    @functools.cache
    def limits() -> CallLimits:
        # A message weighs what it takes in the transcript (instructions: nothing).
        return call_limits(
            snap.scene.window,
            snap.scene.max_tokens,
            snap.scene.tokens({**values, "existing_summary": summary}),
            summary,
            max_chars=policy.max_summary_chars,
            language=str(values["language"]),
            count_text=snap.count_text,
            item_tokens=item_weights(body, policy.max_item_chars, snap.count_text),
        )

    decision = plan_session(
        snap.pinned,
        body,
        snap.applied,
        policy,
        snap.context_window,
        snap.count,
        snap.count_text,
        force=snap.force,
        budget=lambda: limits().budget,
        room=snap.room,
        continuation=snap.continuation,
    )
    if not decision.compacts:
        return CompactionPlan(decision)
    calls = []
    for k, (a, b) in enumerate(decision.batches):
        span = tuple(m for m in body[a:b] if not is_pinned(m))
        room = limits().budget.limit(k)
        # Batches fit `room`; one round too large for any batch is cut to fit.
        transcript = (
            render_within(list(span), policy.max_item_chars, room, snap.count_text)
            if room >= MIN_TRANSCRIPT_TOKENS
            else None
        )
        calls.append(SummaryCall(a, b, transcript, span))
    return CompactionPlan(decision, tuple(calls), values, limits().max_tokens)


# The next turn's user message, unknown when its compaction is planned ahead.
NEXT_TURN: Message = {"role": "user", "content": ""}


def last_turn_tokens(body: Sequence[Message], count: Callable[[Message], int]) -> int:
    """The tokens of the last complete turn of `body` (from the turn start before its last
    one up to that one: a user message, its answer and tool rounds): what the next turn is
    expected to add when it comes back with this turn's answer and a new user message."""
    starts = turn_starts(body)
    if len(starts) < 2:
        return 0
    return sum(count(m) for m in body[starts[-2] : starts[-1]])


def next_turn(body: Sequence[Message]) -> list[Message]:
    """Stand-ins for what the next turn start adds to `body` (a history ending with its
    current user message): this turn's answer and a new user message, not known yet, weighed
    like the last complete turn (copies of its answer messages, then of this user message).
    Planning on them cuts where the next turn will: under the recent-turns ratio the raw tail
    moves by whole turns, so the part to fold grows in steps a fixed share cannot foresee.
    Planning only: no call ever folds past this history's last turn start."""
    starts = turn_starts(body)
    if len(starts) < 2:
        return [NEXT_TURN]
    answer = [dict(m) for m in body[starts[-2] + 1 : starts[-1]]]
    return [*answer, dict(body[starts[-1]])]


def plan_ahead(snap: SessionSnapshot, share: float) -> CompactionPlan:
    """The compaction the next turn start would make, planned after this request's answer
    (background pre-compaction, stages/ahead.py): on this history and stand-ins for this
    turn's answer and the next user message (`next_turn`: weighed like the last turn's), at the
    triggers scaled by `share` (so it runs a little before the next turn would need it),
    never forced. Only the calls that end at or before this history's last turn start are
    kept: the next request shares those cut points, while what follows them (the answer as
    the client will send it back) is not known byte for byte yet."""
    starts = turn_starts(snap.body)
    policy = dataclasses.replace(
        snap.policy,
        min_new_tokens=max(1, int(snap.policy.min_new_tokens * share)),
        trigger_ratio=snap.policy.trigger_ratio * share,
    )
    ahead = dataclasses.replace(
        snap,
        body=[*snap.body, *next_turn(snap.body)],
        policy=policy,
        force=False,
        continuation=False,
    )
    plan = plan_compaction(ahead)
    limit = starts[-1] if starts else 0
    calls = tuple(itertools.takewhile(lambda c: c.end <= limit, plan.calls))
    if not calls:
        return CompactionPlan(dataclasses.replace(plan.decision, batches=()))
    decision = dataclasses.replace(
        plan.decision,
        batches=tuple((c.start, c.end) for c in calls),
        new_covered=calls[-1].end,
    )
    return CompactionPlan(decision, calls, plan.values, plan.max_tokens)


class CallResult(Protocol):
    """What the plan's report reads of one summarizer answer."""

    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def restored_references(self) -> int: ...
    @property
    def retried(self) -> int: ...
    @property
    def salvaged(self) -> int: ...
    @property
    def model(self) -> str: ...


@dataclass
class SummaryRun:
    """What a compaction's calls produced so far: the summary now applied and the totals."""

    applied: AppliedSummary | None
    model: str
    failure: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    restored: int = 0
    retries: int = 0
    salvaged: int = 0
    # What the calls were given, when the scene asks to ride (None: a transcript scene),
    # and why a riding scene's call went as a transcript.
    input: SummaryInput | None = None
    riding_fallback: RidingFallback | None = None

    @property
    def input_fields(self) -> dict[str, str]:
        """The log line's and the audit event's word on the input ({} for a transcript
        scene: nothing to say)."""
        if self.input is None:
            return {}
        fields = {"summarizer_input": str(self.input)}
        if self.riding_fallback is not None:
            fields["riding_fallback"] = str(self.riding_fallback)
        return fields

    def add(self, result: CallResult, applied: AppliedSummary) -> None:
        self.applied = applied
        self.tokens_in += result.input_tokens
        self.tokens_out += result.output_tokens
        self.restored += result.restored_references
        self.retries += result.retried
        self.salvaged += result.salvaged
        self.model = result.model


def compaction_outcome(
    plan: CompactionPlan,
    snap: SessionSnapshot,
    run: SummaryRun,
    duration_ms: int,
) -> CompactionOutcome:
    """What the compaction did, for the log, metrics and the client's progress line."""
    decision = plan.decision
    progressed = run.applied is not decision.applied
    after = decision.tokens_before
    if run.applied is not None and progressed:
        after = decision.tokens_before - _saved(snap, decision.applied, run.applied)
    return CompactionOutcome(
        Layer.SESSION,
        "failed" if run.failure else "compacted" if progressed else "skipped",
        trigger=decision.trigger,
        failure=run.failure or None,
        tokens_before=decision.tokens_before,
        tokens_after=after,
        duration_ms=duration_ms,
        count=(run.applied.covered if run.applied else 0)
        - (decision.applied.covered if decision.applied else 0),
        summarizer_tokens_in=run.tokens_in,
        summarizer_tokens_out=run.tokens_out,
        restored_references=run.restored,
        calls=len(decision.batches),
        length_retries=run.retries,
        salvaged=run.salvaged,
        extra=dict(run.input_fields),
    )


def with_applied(outcome: CompactionOutcome | None, applied: AppliedSummary) -> CompactionOutcome:
    """The layer's outcome once `applied` shortens the view: applying a stored summary is
    this layer's work too, even when nothing was compacted."""
    if outcome is None or outcome.action == "skipped":
        outcome = CompactionOutcome(
            Layer.SESSION,
            "applied",
            trigger=outcome.trigger if outcome else None,
            skip_reason=outcome.skip_reason if outcome else None,
            extra=outcome.extra if outcome else {},
        )
    return dataclasses.replace(outcome, version=applied.version, covers=applied.covered)


def applied_view(
    pinned: Sequence[Message],
    body: Sequence[Message],
    applied: AppliedSummary,
    policy: SessionCompaction,
) -> list[Message]:
    """What goes upstream with `applied`: the summary framed in the covered part's language."""
    language = detect_language(body[: applied.covered])
    message = summary_message(applied.summary, policy.summary_role, language, "session")
    return session_view(pinned, body, applied.covered, message)


def _values(snap: SessionSnapshot) -> dict[str, str | int]:
    """The scene's values but the transcript and the existing summary."""
    policy, body = snap.policy, snap.body
    # The message being answered; in a tool loop, the one that started the turn.
    starts = turn_starts(body)
    asked = body[starts[-1] if starts else -1]
    current = (
        "" if snap.shared else head_tail(content_text(asked.get("content")), policy.max_item_chars)
    )
    return {
        "current_message": current,
        "max_summary_chars": prompt_chars(policy.max_summary_chars),
        "language": detect_language(body),
    }


def _saved(snap: SessionSnapshot, before: AppliedSummary | None, now: AppliedSummary) -> int:
    """Tokens the new summary saves over the one the compaction started from."""
    old_cov = before.covered if before else 0
    old_sum = snap.count_text(before.summary) if before else 0
    removed = sum(snap.count(m) for m in snap.body[old_cov : now.covered])
    return removed + old_sum - snap.count_text(now.summary)
