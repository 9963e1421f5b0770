"""The trim stage and the last resort: model-free, on every request, after summaries.

    trim           once the view passes trim_trigger_ratio of the window, old large
                   tool results become placeholders pointing at the archived original,
                   and assistant messages older than the recent turns lose fidelity
                   (long text cut to head and tail, long tool arguments shortened)
    fit_to_window  if the view is still over the window (less the requested output),
                   the oldest raw turns or rounds after the summary are dropped, whole,
                   rather than letting the upstream fail with a context-length error

All pure over the view (`trim`, `fidelity`); the originals are archived before
anything replaces them (`ensure_archived`), so nothing is lost.
"""

from __future__ import annotations

import json
import logging

from proxy.history.conversation import turn_starts
from proxy.history.messages import Message, fingerprint
from proxy.pipeline import Exchange
from proxy.planning.fidelity import plan_fidelity
from proxy.planning.outcome import CompactionOutcome, Layer
from proxy.planning.trim import TrimPlan, apply_trim, fit_to_window, plan_trim
from proxy.stages.audit import audit
from proxy.store.base import CompactionRecord, Outcome, Store

log = logging.getLogger("recap.trim")
# The last resort has its own logger: an operator filters its warnings apart from trim's.
fit_log = logging.getLogger("recap.fit")


class TrimStage:
    name = "trim"

    def __init__(self, store: Store) -> None:
        self.store = store

    async def __call__(self, ex: Exchange, /) -> None:
        policy = ex.tenant.compaction.trim
        if ex.control == "off" or not policy.enabled:
            return
        trigger = policy.trim_trigger_ratio * ex.context_window
        if ex.measure.at_most(ex.messages) < trigger or ex.measure.total(ex.messages) < trigger:
            return  # the bound spares counting when far below the trigger
        messages = ex.messages
        plan = plan_trim(messages, policy, ex.context_window, ex.measure.tokens, len(messages))
        # Older than the session's recent turns, assistant messages lose fidelity too.
        starts = turn_starts(messages)
        recent = ex.tenant.compaction.session.recent_turns
        shortened = plan_fidelity(
            messages,
            policy.fidelity_max_chars,
            policy.fidelity_max_args_chars,
            starts[-recent] if recent > 0 and len(starts) >= recent else 0,
        )
        replacements = {**plan.replacements, **shortened}
        if not replacements or not await ex.ensure_archived():
            return
        ex.trimmed = [fingerprint(messages[i]) for i in sorted(replacements)]
        ex.messages = apply_trim(messages, TrimPlan(replacements))
        before = sum(_chars(messages[i]) for i in replacements)
        after = sum(_chars(m) for m in replacements.values())
        await _audit(
            self.store, ex, Layer.TRIM, "trim_trigger_ratio", "", messages, (before, after)
        )
        ex.report(
            CompactionOutcome(
                Layer.TRIM,
                "compacted",
                "trim_trigger_ratio",
                count=plan.trimmed,
                saved_chars=plan.saved_chars,
                extra={"shortened": len(shortened)},
            )
        )


class FitToWindow:
    name = "fit_to_window"

    def __init__(self, store: Store) -> None:
        self.store = store

    async def __call__(self, ex: Exchange, /) -> None:
        if ex.control == "off":
            return
        budget = ex.room
        if ex.measure.at_most(ex.messages) <= budget:
            return
        starts = turn_starts(ex.messages)
        if not starts:
            return
        messages, dropped = fit_to_window(
            len(ex.split[0]),
            ex.messages,
            ex.summary_index,
            starts[-1],
            budget,
            ex.measure.tokens,
            ex.loop_summary_index,
        )
        if not dropped or not await ex.ensure_archived():
            return
        reason = drop_reason(ex)
        kept = {id(m) for m in messages}
        gone = sum(_chars(m) for m in ex.messages if id(m) not in kept)
        await _audit(
            self.store, ex, Layer.FIT, reason, DROP_REASONS[reason], messages, (gone, 0), "dropped"
        )
        ex.dropped = [ex.measure.fingerprint(m) for m in ex.messages if id(m) not in kept]
        ex.messages = messages
        ex.report(CompactionOutcome(Layer.FIT, "dropped", count=dropped, extra={"reason": reason}))
        ex.response_headers["x-recap-dropped-messages"] = str(dropped)
        ex.response_headers["x-recap-dropped-reason"] = DROP_REASONS[reason]
        fit_log.warning(
            "view over the window after every layer: dropped %d oldest raw messages (%s)",
            dropped,
            why_dropped(ex, reason),
            extra={"request_id": ex.request_id},
        )


# Why the layers above left the view over the window, in words for the response header.
DROP_REASONS = {
    "summary_failed": "a summary failed, so the history could not be folded",
    "summaries_off": "summaries are switched off for this tenant or request",
    "cooling_down": "summaries kept failing in this conversation and are paused for the cool-down",
    "raw_too_large": "what must stay raw (recent turns, the current turn) is over the window",
}


def drop_reason(ex: Exchange) -> str:
    policy = ex.tenant.compaction
    if ex.compaction_failed:
        return "summary_failed"
    if any(o.skip_reason == "circuit_open" for o in ex.outcomes):
        return "cooling_down"
    if not (policy.session.enabled and policy.loop.enabled):
        return "summaries_off"
    return "raw_too_large"


def why_dropped(ex: Exchange, reason: str) -> str:
    """The drop's reason for the log, naming the compaction whose failure left the view over
    the window, so the warning reads with the failure logged before it."""
    failed = [o for o in ex.outcomes if o.action == "failed"]
    if reason != "summary_failed" or not failed:
        return DROP_REASONS[reason]
    named = ", ".join(f"the {o.layer} summary failed ({o.failure or 'unknown'})" for o in failed)
    return f"{named}, so the history could not be folded"


def _chars(message: Message) -> int:
    return len(json.dumps(message, ensure_ascii=False))


async def _audit(
    store: Store,
    ex: Exchange,
    layer: Layer,
    reason: str,
    detail: str,
    after: list[Message],
    chars: tuple[int, int],
    outcome: Outcome = "ok",
) -> None:
    """The layer's audit row (model-free: no summarizer tokens, no model); the last resort's
    is `dropped`: it saved nothing, it lost messages from the view."""
    await audit(
        store,
        ex.conversation,
        CompactionRecord(
            layer=layer,
            reason=reason,
            outcome=outcome,
            detail=detail,
            tokens_before=ex.measure.total(ex.messages),
            tokens_after=ex.measure.total(after),
            chars_before=chars[0],
            chars_after=chars[1],
            model="",
            duration_ms=0,
        ),
        {"request_id": ex.request_id},
        with_event=False,
    )
