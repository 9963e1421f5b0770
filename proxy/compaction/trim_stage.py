"""The trim stage and the last resort: model-free, on every request, after summaries.

    trim           once the view passes trim_trigger_ratio of the window, old large
                   tool results become placeholders pointing at the archived original
    fit_to_window  if the view is still over the window (less the requested output),
                   the oldest raw turns or rounds after the summary are dropped, whole,
                   rather than letting the upstream fail with a context-length error

Both are pure over the view (`trim.plan_trim`, `trim.fit_to_window`); the originals
are already archived by the archive stage, so nothing is lost.
"""

from __future__ import annotations

import logging

from proxy.compaction.trim import apply_trim, fit_to_window, plan_trim
from proxy.conversation import turn_starts
from proxy.messages import fingerprint
from proxy.pipeline import Exchange

log = logging.getLogger("recap.trim")

# The share of the window kept for the answer when the request names no output limit.
DEFAULT_OUTPUT_SHARE = 0.1


class TrimStage:
    name = "trim"

    async def __call__(self, ex: Exchange, /) -> None:
        policy = ex.tenant.compaction.trim
        if ex.control == "off" or not policy.enabled:
            return
        if ex.measure.at_most(ex.messages) < policy.trim_trigger_ratio * ex.context_window:
            return  # far below the trigger: no need to count exactly
        plan = plan_trim(
            ex.messages, policy, ex.context_window, ex.measure.tokens, len(ex.messages)
        )
        if not plan.trimmed or not await ex.ensure_archived():
            return
        ex.trimmed = [fingerprint(ex.messages[i]) for i in sorted(plan.replacements)]
        ex.messages = apply_trim(ex.messages, plan)
        ex.layers.append("trim")
        ex.log_fields.update(trimmed_results=plan.trimmed, trimmed_chars_saved=plan.saved_chars)


def output_reserve(ex: Exchange) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = ex.body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, ex.context_window // 2)
    return int(ex.context_window * DEFAULT_OUTPUT_SHARE)


class FitToWindow:
    name = "fit_to_window"

    async def __call__(self, ex: Exchange, /) -> None:
        if ex.control == "off":
            return
        budget = ex.context_window - output_reserve(ex)
        if ex.measure.at_most(ex.messages) <= budget:
            return
        starts = turn_starts(ex.messages)
        if not starts:
            return
        messages, dropped = fit_to_window(
            len(ex.identity.pinned),
            ex.messages,
            ex.summary_index,
            starts[-1],
            budget,
            ex.measure.tokens,
        )
        if not dropped or not await ex.ensure_archived():
            return
        ex.messages = messages
        ex.layers.append("fit_to_window")
        ex.response_headers["x-recap-dropped-messages"] = str(dropped)
        ex.log_fields["dropped_messages"] = dropped
        log.warning(
            "view over the window after every layer: dropped %d oldest raw messages",
            dropped,
            extra={"request_id": ex.request_id},
        )
