"""The session stage: apply the stored summary, and fold more history into it at turn start.

Sits in the pipeline after archiving and before the loop layer. Planning is pure
(`session.plan_session`); this stage does the IO around it, in this order, so that a
summary never exists whose originals are missing (seed 002 §5.5):

    find the stored summary whose boundary matches this history   (store)
    plan (turn_start or forced only)                               (pure)
    under the conversation's lock: re-check (reuse another request's work),
    summarise batch by batch, store each as a new version          (store, summarizer)
    assemble pinned + summary + raw tail                           (pure)

Any failure keeps the messages as they were (with the last good summary, if any),
records why, and never fails the request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proxy.config import SessionCompaction, Tenant
from proxy.history.conversation import turn_starts
from proxy.history.identity import is_derived
from proxy.history.messages import Classification, Message, is_pinned
from proxy.history.tokens import TokenCounter
from proxy.pipeline import Exchange
from proxy.planning.budget import TranscriptBudget, item_weights
from proxy.planning.framing import prompt_chars, summary_message
from proxy.planning.guard import Earlier, Seen
from proxy.planning.outcome import CompactionOutcome, Layer, done_words, retry_detail
from proxy.planning.session import (
    AppliedSummary,
    SessionPlan,
    plan_session,
    quiet_reason,
    session_view,
)
from proxy.planning.transcript import (
    content_text,
    detect_language,
    head_tail,
    render_within,
)
from proxy.stages.audit import audit, log_started
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import (
    MIN_TRANSCRIPT_TOKENS,
    Breaker,
    CallLimits,
    Summarizer,
    SummarizerFailed,
    SummaryResult,
    call_limits,
)
from proxy.store.base import CompactionRecord, NewSummary, Store, SummaryVersion

log = logging.getLogger("recap.session")


def as_applied(version: SummaryVersion | None, body_len: int) -> AppliedSummary | None:
    # A summary must leave at least the current message raw.
    if version is None or not 0 < version.covered < body_len:
        return None
    return AppliedSummary(version.summary, version.covered, version.version)


class SessionStage:
    name = "session"

    def __init__(
        self,
        store: Store,
        summarizer: Summarizer,
        scenes: Mapping[str, SceneSet],
        counter: TokenCounter,
        tenants: Mapping[str, Tenant],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.summarizer = summarizer
        self.scenes = scenes
        self.counter = counter
        # The circuit breakers' cool-downs are measured on `clock` (a fake one in tests).
        self.clock = clock
        self.breakers = {
            name: Breaker(
                t.compaction.session.failure_threshold, t.compaction.session.cooldown_s, clock=clock
            )
            for name, t in tenants.items()
        }

    async def __call__(self, ex: Exchange) -> None:
        policy = ex.tenant.compaction.session
        forced = ex.control == "force"
        if ex.control == "off" or not (policy.enabled or forced):
            return
        pinned, body = ex.split
        if len(body) < 2:
            if forced:
                ex.report(CompactionOutcome(Layer.SESSION, "skipped", "forced", "too_short"))
            return
        applied = as_applied(
            await self.store.matching_summary(ex.conversation, ex.chain), len(body)
        )
        outcome: CompactionOutcome | None = None
        breaker = self.breakers.setdefault(
            ex.tenant.name, Breaker(policy.failure_threshold, policy.cooldown_s, clock=self.clock)
        )
        if ex.classification == Classification.TURN_START or forced:
            quiet = None
            if not forced and applied is None:
                bound = ex.measure.at_most(ex.original)
                quiet = quiet_reason(body, policy, ex.context_window, bound, ex.room)
            if breaker.open(ex.conversation):
                outcome = CompactionOutcome(Layer.SESSION, "skipped", skip_reason="circuit_open")
            elif quiet is not None:
                # Far below the triggers: nothing counted or hashed before it is forwarded.
                outcome = CompactionOutcome(Layer.SESSION, "skipped", skip_reason=quiet)
            else:
                applied, outcome = await self._maybe_compact(
                    ex, policy, pinned, body, applied, breaker
                )
        elif ex.measure.at_most(ex.original) > ex.room and not breaker.open(ex.conversation):
            # A tool continuation that may be over the window: the turns before the running
            # one are folded rather than dropped by the last resort (planning/session.py).
            applied, over = await self._maybe_compact(ex, policy, pinned, body, applied, breaker)
            outcome = None if over.skip_reason == "below_threshold" else over
        if applied is not None:
            # Applying a stored summary shortens the view: that is this layer's work too.
            if outcome is None or outcome.action == "skipped":
                outcome = CompactionOutcome(
                    Layer.SESSION,
                    "applied",
                    trigger=outcome.trigger if outcome else None,
                    skip_reason=outcome.skip_reason if outcome else None,
                    extra=outcome.extra if outcome else {},
                )
            outcome = dataclasses.replace(outcome, version=applied.version, covers=applied.covered)
            ex.response_headers["x-recap-summary-version"] = str(applied.version)
            language = detect_language(body[: applied.covered])
            message = summary_message(applied.summary, policy.summary_role, language, "session")
            ex.messages = session_view(pinned, body, applied.covered, message)
            ex.summary_index = len(pinned)
        if outcome is not None:
            ex.report(outcome)

    def _plan(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        pinned: list[Message],
        body: list[Message],
        applied: AppliedSummary | None,
    ) -> SessionPlan:
        def budget() -> TranscriptBudget:
            return self._limits(ex, policy, body, applied.summary if applied else "").budget

        return plan_session(
            pinned,
            body,
            applied,
            policy,
            ex.context_window,
            ex.measure.tokens,
            ex.measure.text,
            force=ex.control == "force",
            budget=budget,
            room=ex.room,
            continuation=ex.classification == Classification.TOOL_CONTINUATION,
        )

    def _values(
        self, ex: Exchange, policy: SessionCompaction, body: list[Message], summary: str
    ) -> dict[str, str | int]:
        """The scene's values but the transcript."""
        # On a derived key other users share this summary: the current message is only
        # this user's, so it is no summarizer input there (it stays raw, as always).
        # The message being answered; in a tool loop, the one that started the turn.
        starts = turn_starts(body)
        asked = body[starts[-1] if starts else -1]
        current = (
            ""
            if is_derived(ex.conversation)
            else head_tail(content_text(asked.get("content")), policy.max_item_chars)
        )
        return {
            "existing_summary": summary,
            "current_message": current,
            "max_summary_chars": prompt_chars(policy.max_summary_chars),
            "language": detect_language(body),
        }

    def _limits(
        self, ex: Exchange, policy: SessionCompaction, body: list[Message], summary: str
    ) -> CallLimits:
        """The summarizer's limits for this compaction; a message weighs what it takes in
        the transcript (instructions: nothing, they are not summarised)."""
        item_tokens = item_weights(body, policy.max_item_chars, ex.measure.text)

        return call_limits(
            ex.tenant,
            self.scenes[ex.tenant.name].get(policy.scene),
            self._values(ex, policy, body, summary),
            max_chars=policy.max_summary_chars,
            count_text=ex.measure.text,
            item_tokens=item_tokens,
        )

    async def _maybe_compact(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        pinned: list[Message],
        body: list[Message],
        applied: AppliedSummary | None,
        breaker: Breaker,
    ) -> tuple[AppliedSummary | None, CompactionOutcome]:
        """Plan; when it compacts, under the lock: re-plan, summarise, store, report."""
        plan = self._plan(ex, policy, pinned, body, applied)
        if not plan.compacts:
            return applied, _skipped(plan, plan.skip_reason)
        if not await ex.ensure_archived():
            return applied, _skipped(plan, "archive_failed")
        conv, chain = ex.conversation, ex.identity.chain
        async with self.store.conversation_lock(conv):
            # Another request of this conversation may have compacted while we waited:
            # re-read and re-plan, so its work is reused instead of repeated.
            latest = as_applied(await self.store.matching_summary(conv, chain), len(body))
            if latest != applied:
                applied = latest
                plan = self._plan(ex, policy, pinned, body, applied)
                if not plan.compacts:
                    return applied, _skipped(plan, plan.skip_reason, reused=True)
            start = time.perf_counter()
            log_started(log, ex, Layer.SESSION, _reason(ex, plan))
            await ex.notify("recap compacting")
            run = await self._summarize(ex, policy, body, chain, plan)
            duration_ms = int((time.perf_counter() - start) * 1000)
            if run.failure:
                breaker.failed(conv)
            else:
                breaker.succeeded(conv)
            outcome = self._outcome(ex, body, plan, run, duration_ms)
            await self._audit(ex, body, plan, run, outcome)
            if run.failure:
                await ex.notify(f"recap compaction failed: {run.failure}")
                log.warning(
                    "session compaction failed, sending history as it was: %s",
                    run.failure,
                    extra={"request_id": ex.request_id},
                )
            else:
                await ex.notify(done_words(outcome))
            return run.applied, outcome

    async def _summarize(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        body: list[Message],
        chain: list[str],
        plan: SessionPlan,
    ) -> _Run:
        """Each batch through the summarizer, merged into the summary so far, each result
        stored as a new version at once (a later failure keeps the earlier batches)."""
        run = _Run(plan.applied, ex.model or "")
        scene = self.scenes[ex.tenant.name].get(policy.scene)
        summary = plan.applied.summary if plan.applied else ""
        limits = self._limits(ex, policy, body, summary)
        for k, (a, b) in enumerate(plan.batches):
            # Instructions stay in the view (session_view): they are not summarised.
            span = [m for m in body[a:b] if not is_pinned(m)]
            room = limits.budget.limit(k)
            if room < MIN_TRANSCRIPT_TOKENS:
                # The scene and the summary alone fill summarizer.context_window.
                run.failure = "summarizer context_window too small"
                break
            # Batches fit `room`; one round too large for any batch is cut to fit.
            transcript = render_within(span, policy.max_item_chars, room, ex.measure.text)
            values = self._values(ex, policy, body, summary)
            current = str(values["current_message"])
            try:
                result = await ex.waiting(
                    self.summarizer.summarize(
                        ex.tenant,
                        scene,
                        {"transcript": transcript, **values},
                        model=ex.model,
                        credentials=ex.credentials,
                        max_chars=policy.max_summary_chars,
                        # The stored summary merged into (Earlier): what the merge dropped
                        # from it is restored. The current message is input the summary does
                        # not replace (Seen).
                        replaced=[
                            *([Earlier(summary)] if summary else []),
                            *span,
                            *([Seen(current)] if current else []),
                        ],
                        max_tokens=limits.max_tokens,
                        call=ex.dialect.summary_call,
                    )
                )
            except SummarizerFailed as exc:
                run.failure = exc.reason
                run.retries += exc.retried
                break
            summary = result.text
            run.add(result)
            version = await self.store.add_summary_version(
                ex.conversation,
                NewSummary(
                    summary=summary,
                    covered=b,
                    boundary_hash=chain[b - 1],
                    input_tokens=result.input_tokens,
                    output_tokens=result.output_tokens,
                    model=result.model,
                    reason=_reason(ex, plan),
                ),
            )
            run.applied = AppliedSummary(summary, b, version.version)
        return run

    def _outcome(
        self, ex: Exchange, body: list[Message], plan: SessionPlan, run: _Run, duration_ms: int
    ) -> CompactionOutcome:
        progressed = run.applied is not plan.applied
        after = plan.tokens_before
        if run.applied is not None and progressed:
            after = plan.tokens_before - self._saved(ex, body, plan, run.applied)
        return CompactionOutcome(
            Layer.SESSION,
            "failed" if run.failure else "compacted" if progressed else "skipped",
            trigger=plan.trigger,
            failure=run.failure or None,
            tokens_before=plan.tokens_before,
            tokens_after=after,
            duration_ms=duration_ms,
            count=(run.applied.covered if run.applied else 0)
            - (plan.applied.covered if plan.applied else 0),
            summarizer_tokens_in=run.tokens_in,
            summarizer_tokens_out=run.tokens_out,
            restored_references=run.restored,
            calls=len(plan.batches),
            length_retries=run.retries,
            salvaged=run.salvaged,
        )

    async def _audit(
        self,
        ex: Exchange,
        body: list[Message],
        plan: SessionPlan,
        run: _Run,
        outcome: CompactionOutcome,
    ) -> None:
        applied = run.applied
        chars_before = _chars(body[plan.applied.covered if plan.applied else 0 :])
        chars_after = _chars(body[applied.covered if applied else 0 :]) + len(
            applied.summary if applied else ""
        )
        await audit(
            self.store,
            ex.conversation,
            CompactionRecord(
                layer=Layer.MANUAL if ex.control == "force" else Layer.SESSION,
                reason=_reason(ex, plan),
                outcome="failed" if run.failure else "ok",
                detail=retry_detail(run.failure, run.retries, run.salvaged),
                tokens_before=plan.tokens_before,
                tokens_after=outcome.tokens_after or plan.tokens_before,
                chars_before=chars_before,
                chars_after=chars_after,
                model=run.model,
                duration_ms=outcome.duration_ms or 0,
            ),
            {
                "request_id": ex.request_id,
                "version": applied.version if applied else None,
                "covered": applied.covered if applied else 0,
                "previous_version": plan.applied.version if plan.applied else None,
                "batches": len(plan.batches),
                "summarizer_input_tokens": run.tokens_in,
                "summarizer_output_tokens": run.tokens_out,
                "length_retries": run.retries,
                "salvaged": run.salvaged,
            },
        )

    def _saved(
        self, ex: Exchange, body: list[Message], plan: SessionPlan, applied: AppliedSummary
    ) -> int:
        old_cov = plan.applied.covered if plan.applied else 0
        measure = ex.measure
        old_sum = measure.text(plan.applied.summary) if plan.applied else 0
        removed = sum(measure.tokens(m) for m in body[old_cov : applied.covered])
        return removed + old_sum - measure.text(applied.summary)


@dataclass
class _Run:
    """What the summarizer calls of one compaction produced so far."""

    applied: AppliedSummary | None
    model: str
    failure: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    restored: int = 0
    retries: int = 0
    salvaged: int = 0

    def add(self, result: SummaryResult) -> None:
        self.tokens_in += result.input_tokens
        self.tokens_out += result.output_tokens
        self.restored += result.restored_references
        self.retries += result.retried
        self.salvaged += result.salvaged
        self.model = result.model


def _skipped(plan: SessionPlan, reason: str | None, reused: bool = False) -> CompactionOutcome:
    return CompactionOutcome(
        Layer.SESSION,
        "skipped",
        trigger=plan.trigger,
        skip_reason=reason,
        extra={"reused": True} if reused else {},
    )


def _reason(ex: Exchange, plan: SessionPlan) -> str:
    # A forced compaction is a manual one, whether from the API, the CLI or the header.
    return "manual" if plan.trigger == "forced" else str(plan.trigger)


def _chars(messages: Sequence[Message]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
