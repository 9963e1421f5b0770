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

import json
import logging
import time
from collections.abc import Mapping, Sequence

from proxy.compaction.audit import audit
from proxy.compaction.framing import prompt_chars, summary_message
from proxy.compaction.session import AppliedSummary, SessionPlan, plan_session, session_view
from proxy.compaction.summarize import Breaker, Summarizer, SummarizerFailed
from proxy.compaction.transcript import content_text, detect_language, head_tail, render_transcript
from proxy.config import SessionCompaction, Tenant
from proxy.messages import Classification, Message
from proxy.pipeline import Exchange
from proxy.scenes import SceneSet
from proxy.store.base import CompactionRecord, NewSummary, Store, SummaryVersion
from proxy.tokens import TokenCounter

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
    ) -> None:
        self.store = store
        self.summarizer = summarizer
        self.scenes = scenes
        self.counter = counter
        self.breakers = {
            name: Breaker(t.compaction.session.failure_threshold, t.compaction.session.cooldown_s)
            for name, t in tenants.items()
        }

    async def __call__(self, ex: Exchange) -> None:
        policy = ex.tenant.compaction.session
        if ex.control == "off" or not (policy.enabled or ex.control == "force"):
            return
        pinned, body, chain = ex.identity.pinned, ex.identity.body, ex.identity.chain
        if len(body) < 2:
            return
        applied = as_applied(await self.store.matching_summary(ex.conversation, chain), len(body))
        # Ordering rule: only once the originals are on disk may a summary of them exist.
        wants = ex.classification == Classification.TURN_START or ex.control == "force"
        breaker = self.breakers.setdefault(
            ex.tenant.name, Breaker(policy.failure_threshold, policy.cooldown_s)
        )
        if wants and breaker.open(ex.conversation):
            ex.log_fields["session_skip"] = "circuit_open"
            wants = False
        if wants:
            applied = await self._maybe_compact(ex, policy, pinned, body, chain, applied, breaker)
        if applied is None:
            return
        ex.response_headers["x-recap-summary-version"] = str(applied.version)
        language = detect_language(body[: applied.covered])
        message = summary_message(applied.summary, policy.summary_role, language, "session")
        ex.messages = session_view(pinned, body, applied.covered, message)
        ex.summary_index = len(pinned)
        ex.log_fields["summary_version"] = applied.version
        ex.log_fields["summary_covers"] = applied.covered

    def _plan(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        pinned: list[Message],
        body: list[Message],
        applied: AppliedSummary | None,
    ) -> SessionPlan:
        return plan_session(
            pinned,
            body,
            applied,
            policy,
            ex.context_window,
            ex.measure.tokens,
            ex.measure.text,
            force=ex.control == "force",
        )

    async def _maybe_compact(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        pinned: list[Message],
        body: list[Message],
        chain: list[str],
        applied: AppliedSummary | None,
        breaker: Breaker,
    ) -> AppliedSummary | None:
        plan = self._plan(ex, policy, pinned, body, applied)
        if not plan.compacts:
            ex.log_fields["session_skip"] = plan.skip_reason
            return applied
        if not await ex.ensure_archived():
            ex.log_fields["session_skip"] = "archive_failed"
            return applied
        conv = ex.conversation
        async with self.store.conversation_lock(conv):
            # Another request of this conversation may have compacted while we waited:
            # re-read and re-plan, so its work is reused instead of repeated.
            latest = as_applied(await self.store.matching_summary(conv, chain), len(body))
            if latest != applied:
                applied = latest
                plan = self._plan(ex, policy, pinned, body, applied)
                if not plan.compacts:
                    ex.log_fields["session_reused"] = True
                    return applied
            return await self._compact(ex, policy, body, chain, plan, breaker)

    async def _compact(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        body: list[Message],
        chain: list[str],
        plan: SessionPlan,
        breaker: Breaker,
    ) -> AppliedSummary | None:
        conv = ex.conversation
        applied = plan.applied
        start = time.perf_counter()
        await ex.notify("recap compacting")
        scene = self.scenes[ex.tenant.name].get(policy.scene)
        summary = applied.summary if applied else ""
        current = head_tail(content_text(body[-1].get("content")), policy.max_item_chars)
        language = detect_language(body)
        tokens_in = tokens_out = restored = 0
        model = ex.model or ""
        failure = ""
        for a, b in plan.batches:
            try:
                result = await self.summarizer.summarize(
                    ex.tenant,
                    scene,
                    {
                        "transcript": render_transcript(body[a:b], policy.max_item_chars),
                        "existing_summary": summary,
                        "current_message": current,
                        "max_summary_chars": prompt_chars(policy.max_summary_chars),
                        "language": language,
                    },
                    model=ex.model,
                    authorization=ex.headers.get("authorization"),
                    max_chars=policy.max_summary_chars,
                    # The previous summary too: what the merge dropped from it is restored.
                    replaced=[{"role": "assistant", "content": summary}, *body[a:b]]
                    if summary
                    else body[a:b],
                )
            except SummarizerFailed as exc:
                failure = exc.reason
                break
            summary = result.text
            tokens_in += result.input_tokens
            tokens_out += result.output_tokens
            restored += result.restored_references
            model = result.model
            version = await self.store.add_summary_version(
                conv,
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
            applied = AppliedSummary(summary, b, version.version)
        duration_ms = int((time.perf_counter() - start) * 1000)
        progressed = applied is not plan.applied
        if failure:
            breaker.failed(conv)
        else:
            breaker.succeeded(conv)
        after = plan.tokens_before
        if applied is not None and progressed:
            after = plan.tokens_before - self._saved(ex, body, plan, applied)
        if failure:
            ex.compaction_failed = True
        if progressed:
            ex.layers.append("session")
        ex.log_fields.update(
            session_trigger=plan.trigger,
            session_batches=len(plan.batches),
            session_failure=failure or None,
            compacted_messages=(applied.covered if applied else 0)
            - (plan.applied.covered if plan.applied else 0),
            summarizer_tokens_in=ex.log_fields.get("summarizer_tokens_in", 0) + tokens_in,
            summarizer_tokens_out=ex.log_fields.get("summarizer_tokens_out", 0) + tokens_out,
            restored_references=ex.log_fields.get("restored_references", 0) + restored,
            compaction_ms=duration_ms,
        )
        chars_before = _chars(body[plan.applied.covered if plan.applied else 0 :])
        chars_after = _chars(body[applied.covered if applied else 0 :]) + len(
            applied.summary if applied else ""
        )
        await audit(
            self.store,
            conv,
            CompactionRecord(
                layer="manual" if ex.control == "force" else "session",
                reason=_reason(ex, plan),
                outcome="failed" if failure else "ok",
                detail=failure,
                tokens_before=plan.tokens_before,
                tokens_after=after,
                chars_before=chars_before,
                chars_after=chars_after,
                model=model,
                duration_ms=duration_ms,
            ),
            {
                "request_id": ex.request_id,
                "version": applied.version if applied else None,
                "covered": applied.covered if applied else 0,
                "previous_version": plan.applied.version if plan.applied else None,
                "batches": len(plan.batches),
                "summarizer_input_tokens": tokens_in,
                "summarizer_output_tokens": tokens_out,
            },
        )
        await ex.notify("recap compacted" if not failure else f"recap compaction failed: {failure}")
        if failure:
            log.warning(
                "session compaction failed, sending history as it was: %s",
                failure,
                extra={"request_id": ex.request_id},
            )
        return applied

    def _saved(
        self, ex: Exchange, body: list[Message], plan: SessionPlan, applied: AppliedSummary
    ) -> int:
        old_cov = plan.applied.covered if plan.applied else 0
        measure = ex.measure
        old_sum = measure.text(plan.applied.summary) if plan.applied else 0
        removed = sum(measure.tokens(m) for m in body[old_cov : applied.covered])
        return removed + old_sum - measure.text(applied.summary)


def _reason(ex: Exchange, plan: SessionPlan) -> str:
    # A forced compaction is a manual one, whether from the API, the CLI or the header.
    return "manual" if plan.trigger == "forced" else str(plan.trigger)


def _chars(messages: Sequence[Message]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
