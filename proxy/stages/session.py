"""The session stage: apply the stored summary, and fold more history into it at turn start.

Sits in the pipeline after archiving and before the loop layer. Planning is pure and one
call (`session_calls.plan_compaction`: the decision, every summarizer call with its
transcript, the scene's values and limits); this stage does the IO around it, in this
order, so that a summary never exists whose originals are missing (seed 002 §5.5):

    find the stored summary whose boundary matches this history   (store)
    plan (turn_start, forced, or a continuation over the window)   (pure)
    under the conversation's lock: re-read, and re-plan if another
    request stored a version meanwhile (its work is reused)        (store, pure)
    send the planned calls in order, store each as a new version   (summarizer, store)
      (a scene with `input: cache_riding`: one call riding on the
      request forwarded, where it is known exactly: stages/riding.py)
    report (`compaction_outcome`), queue the audit row             (pure, audit writer)
    assemble pinned + summary + raw tail (`applied_view`)          (pure)

Any failure keeps the messages as they were (with the last good summary, if any),
records why, and never fails the request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from proxy.config import SessionCompaction, Tenant
from proxy.history.identity import is_derived
from proxy.history.messages import Classification, Message
from proxy.history.tokens import TokenCounter
from proxy.pipeline import Exchange
from proxy.planning.guard import Earlier, Seen
from proxy.planning.outcome import CompactionOutcome, Layer, done_words, retry_detail
from proxy.planning.riding import (
    RidingFallback,
    RidingPlan,
    SummaryInput,
)
from proxy.planning.session import AppliedSummary, quiet_reason
from proxy.planning.session_calls import (
    NO_ROOM,
    CompactionPlan,
    SceneWeight,
    SessionSnapshot,
    SummaryRun,
    applied_view,
    compaction_outcome,
    plan_compaction,
    with_applied,
)
from proxy.stages.audit import audit, log_started
from proxy.stages.riding import Rider
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import (
    Breaker,
    Summarizer,
    SummarizerFailed,
    SummaryResult,
    scene_tokens,
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
        # Cache-riding calls, for a scene that asks (stages/riding.py).
        self.rider = Rider(scenes, summarizer)
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
            outcome = with_applied(outcome, applied)
            ex.response_headers["x-recap-summary-version"] = str(applied.version)
            ex.messages = applied_view(pinned, body, applied, policy)
            ex.summary_index = len(pinned)
            ex.session_summary = applied
        if outcome is not None:
            ex.report(outcome)

    def snapshot(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        pinned: list[Message],
        body: list[Message],
        applied: AppliedSummary | None,
    ) -> SessionSnapshot:
        """What this request's session compaction is planned from."""
        scene = self.scenes[ex.tenant.name].get(policy.scene)
        return SessionSnapshot(
            pinned,
            body,
            applied,
            policy,
            ex.context_window,
            ex.measure.tokens,
            ex.measure.text,
            SceneWeight(
                ex.tenant.summarizer.context_window,
                scene.max_tokens,
                scene_tokens(scene, ex.measure.text),
            ),
            room=ex.room,
            force=ex.control == "force",
            continuation=ex.classification == Classification.TOOL_CONTINUATION,
            shared=is_derived(ex.conversation),
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
        snap = self.snapshot(ex, policy, pinned, body, applied)
        plan = plan_compaction(snap)
        if not plan.compacts:
            return applied, plan.skipped(plan.decision.skip_reason)
        if not await ex.ensure_archived():
            return applied, plan.skipped("archive_failed")
        conv, chain = ex.conversation, ex.identity.chain
        async with self.store.conversation_lock(conv):
            # Another request of this conversation may have compacted while we waited:
            # re-read and re-plan, so its work is reused instead of repeated.
            latest = as_applied(await self.store.matching_summary(conv, chain), len(body))
            if latest != applied:
                applied = latest
                snap = dataclasses.replace(snap, applied=latest)
                plan = plan_compaction(snap)
                if not plan.compacts:
                    return applied, plan.skipped(plan.decision.skip_reason, reused=True)
            start = time.perf_counter()
            log_started(log, ex, Layer.SESSION, plan.reason)
            await ex.notify("recap compacting")
            # The request this history extends, as it was forwarded, if this replica kept it.
            riding = self.rider.plan_for(ex, policy, body, plan, self.rider.previous(ex))
            run = await self.summarize(ex, policy, chain, plan, riding=riding)
            duration_ms = int((time.perf_counter() - start) * 1000)
            if run.failure:
                breaker.failed(conv)
            else:
                breaker.succeeded(conv)
            outcome = compaction_outcome(plan, snap, run, duration_ms)
            await self.audit(ex, body, plan, run, outcome)
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

    async def summarize(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        chain: Sequence[str],
        plan: CompactionPlan,
        background: bool = False,
        riding: RidingPlan | RidingFallback | None = None,
    ) -> SummaryRun:
        """Each planned call through the summarizer, merged into the summary so far, each
        result stored as a new version at once (a later failure keeps the earlier ones).
        `background`: after the answer (stages/ahead.py), so no client waits or is told.
        `riding` (`Rider.plan_for`): the plan's one call rides on the forwarded request, or
        why it does not (None: the scene does not ask); a riding call that fails is made
        once more as a transcript call."""
        run = SummaryRun(plan.applied, ex.model or "")
        scene = self.scenes[ex.tenant.name].get(policy.scene)
        summary = plan.applied.summary if plan.applied else ""
        current = plan.current
        if isinstance(riding, RidingFallback):
            run.input, run.riding_fallback = SummaryInput.TRANSCRIPT, riding
        for call in plan.calls:
            # A riding plan is of one call (planning/riding.py).
            ride, riding = (riding if isinstance(riding, RidingPlan) else None), None
            if call.transcript is None and ride is None:
                # The scene and the summary alone fill summarizer.context_window.
                run.failure = NO_ROOM
                break
            # The stored summary merged into (Earlier): what the merge dropped from it is
            # restored. The current message is input the summary does not replace (Seen).
            replaced: list[Message | Earlier | Seen] = [
                *([Earlier(summary)] if summary else []),
                *call.span,
                *([Seen(current)] if current else []),
            ]
            try:
                result: SummaryResult | None = None
                if ride is not None:
                    try:
                        result = await self.rider.summarize(
                            ex, scene, policy, plan, ride, replaced, background
                        )
                        run.input = SummaryInput.CACHE_RIDING
                    except SummarizerFailed as exc:
                        # Made once more as a transcript: the riding call is the option.
                        run.input, run.riding_fallback = (
                            SummaryInput.TRANSCRIPT,
                            RidingFallback.FAILED,
                        )
                        run.retries += exc.retried
                        if call.transcript is None:
                            raise
                if result is None:
                    assert call.transcript is not None
                    asked = self.summarizer.summarize(
                        ex.tenant,
                        scene,
                        {"transcript": call.transcript, **plan.values, "existing_summary": summary},
                        model=ex.model,
                        credentials=ex.credentials,
                        max_chars=policy.max_summary_chars,
                        replaced=replaced,
                        max_tokens=plan.max_tokens,
                        call=ex.dialect.summary_call,
                        background=background,
                    )
                    result = await (asked if background else ex.waiting(asked))
            except SummarizerFailed as exc:
                run.failure = exc.reason
                run.retries += exc.retried
                break
            summary = result.text
            version = await self.store.add_summary_version(
                ex.conversation,
                NewSummary(
                    summary=summary,
                    covered=call.end,
                    boundary_hash=chain[call.end - 1],
                    input_tokens=result.input_tokens,
                    output_tokens=result.output_tokens,
                    model=result.model,
                    reason=plan.reason,
                ),
            )
            run.add(result, AppliedSummary(summary, call.end, version.version))
        return run

    async def audit(
        self,
        ex: Exchange,
        body: list[Message],
        plan: CompactionPlan,
        run: SummaryRun,
        outcome: CompactionOutcome,
        ahead: bool = False,
    ) -> None:
        """The compaction's audit row and event (`ahead`: made in the background)."""
        applied = run.applied
        chars_before = _chars(body[plan.applied.covered if plan.applied else 0 :])
        chars_after = _chars(body[applied.covered if applied else 0 :]) + len(
            applied.summary if applied else ""
        )
        tokens_before = plan.decision.tokens_before
        await audit(
            self.store,
            ex.conversation,
            CompactionRecord(
                layer=Layer.MANUAL if ex.control == "force" else Layer.SESSION,
                reason=plan.reason,
                outcome="failed" if run.failure else "ok",
                detail=retry_detail(run.failure, run.retries, run.salvaged),
                tokens_before=tokens_before,
                tokens_after=outcome.tokens_after or tokens_before,
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
                "batches": len(plan.calls),
                "summarizer_input_tokens": run.tokens_in,
                "summarizer_output_tokens": run.tokens_out,
                "length_retries": run.retries,
                "salvaged": run.salvaged,
                **run.input_fields,
                **({"ahead": True} if ahead else {}),
            },
        )


def _chars(messages: Sequence[Message]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
