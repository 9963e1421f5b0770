"""What a compaction layer did on one request, as a typed value (issue 12.6).

Each layer that runs appends one `CompactionOutcome` to the Exchange: it compacted
(made a new summary, trimmed, dropped), applied a stored summary (no model call, but
the view is shorter: that is a layer too), skipped (with the reason), or failed (with
the failure). Everything that reports compaction reads these values: the response
headers (`x-recap-compaction`, `x-recap-summary-version`, `x-recap-compaction-skipped`),
the request's log line (`log_fields`, which keeps the line's historical field names),
metrics, the archived request event and the manual compaction route.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal


class Layer(StrEnum):
    """The compaction layers: the one vocabulary the planners, stages, store, audit, log,
    tail, metrics and page read (a StrEnum: its values are what the store and the log
    hold, and a member equals its value)."""

    SESSION = "session"  # the session's rolling summary
    LOOP = "loop"  # a tool loop's working memory
    TRIM = "trim"  # old tool results as placeholders, no model call
    FIT = "fit_to_window"  # the last resort: the oldest raw messages dropped
    MANUAL = "manual"  # a compaction an operator asked for (audited as such)
    REMOTE = "remote"  # Codex remote compaction answered by Recap


# "dropped": the last resort (fit) dropped the oldest raw messages: the view changed, and
# messages were lost to it (every surface shows it apart from a compaction, in red).
Action = Literal["compacted", "applied", "skipped", "failed", "dropped"]

# Skip reasons in words, for users (x-recap-compaction-skipped, the manual route).
SKIP_WORDS = {
    "disabled": "this layer is switched off for the tenant",
    "below_threshold": "the conversation is below the compaction thresholds",
    "nothing_to_compact": "there is nothing before the current turn that is not already summarised",
    "too_few_messages": "too few messages before the current turn to be worth a summary",
    "anti_loop": "too little new history since the last summary",
    "saving_below_min": "a summary would save less than min_saving_tokens",
    "circuit_open": "summaries kept failing in this conversation; retrying after the cool-down",
    "archive_failed": "the originals could not be archived, so nothing may replace them",
    "too_short": "the conversation has fewer than two messages after its instructions",
    "no_turn": "there is no user turn to compact before",
}


def retry_detail(failure: str | None, retries: int, salvaged: int) -> str:
    """An audit row's detail: the failure (if any), and whether a length retry was made."""
    note = ""
    if retries:
        note = "after a length retry" + (", complete sections kept" if salvaged else "")
    if failure:
        return f"{failure} ({note})" if note else failure
    return note


def in_words(reason: str | None) -> str:
    return SKIP_WORDS.get(reason or "", reason or "unknown reason")


@dataclass(frozen=True)
class CompactionOutcome:
    layer: Layer
    action: Action
    trigger: str | None = None
    skip_reason: str | None = None
    failure: str | None = None
    # The session summary version now applied (session layer).
    version: int | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    duration_ms: int | None = None
    # Messages (session, fit), rounds (loop) or results (trim) this outcome folded.
    count: int | None = None
    # How many the applied summary covers: messages (session) or rounds (loop).
    covers: int | None = None
    summarizer_tokens_in: int = 0
    summarizer_tokens_out: int = 0
    restored_references: int = 0
    calls: int = 0  # summarizer calls (session batches)
    # Summaries asked for a second time, shorter, after a cut by their token limit...
    length_retries: int = 0
    # ...and of those, the ones whose complete sections stood in when the retry was cut too.
    salvaged: int = 0
    saved_chars: int | None = None  # characters the trim placeholders saved (trim)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def changed_view(self) -> bool:
        return self.action in ("compacted", "applied", "dropped")

    def as_log(self) -> dict[str, Any]:
        """This outcome for the JSON log line's `compactions` list (absent fields left out)."""
        out: dict[str, Any] = {"layer": self.layer, "action": self.action}
        for name in (
            "trigger",
            "skip_reason",
            "failure",
            "version",
            "tokens_before",
            "tokens_after",
            "duration_ms",
            "count",
            "covers",
            "saved_chars",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name in ("length_retries", "salvaged"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out | self.extra


def done_words(outcome: CompactionOutcome) -> str:
    """What a compaction did, for the stream's `: recap compacted` comment: the layer, what it
    folded and the view's tokens before and after ("session, 38 messages into one summary,
    12,410 -> 2,377 tokens")."""
    what = {
        Layer.SESSION: "messages into one summary",
        Layer.LOOP: "tool rounds into the working summary",
    }
    parts = [str(outcome.layer)]
    if outcome.count is not None:
        parts.append(f"{outcome.count} {what.get(outcome.layer, 'messages')}")
    if outcome.tokens_before is not None and outcome.tokens_after is not None:
        parts.append(f"{outcome.tokens_before:,} -> {outcome.tokens_after:,} tokens")
    return "recap compacted: " + ", ".join(parts)


def layers(outcomes: Iterable[CompactionOutcome]) -> list[str]:
    """The layers that changed the outgoing view, in order, once each."""
    out: list[str] = []
    for o in outcomes:
        if o.changed_view and o.layer not in out:
            out.append(o.layer)
    return out


def log_fields(outcomes: Sequence[CompactionOutcome]) -> dict[str, Any]:
    """The request log line's compaction fields, by their historical names."""
    out: dict[str, Any] = {}
    if outcomes:
        out["compactions"] = [o.as_log() for o in outcomes]
    tokens_in = sum(o.summarizer_tokens_in for o in outcomes)
    tokens_out = sum(o.summarizer_tokens_out for o in outcomes)
    restored = sum(o.restored_references for o in outcomes)
    retries = sum(o.length_retries for o in outcomes)
    salvaged = sum(o.salvaged for o in outcomes)
    for o in outcomes:
        if o.layer == Layer.SESSION:
            if o.action in ("compacted", "failed"):
                out.update(
                    session_trigger=o.trigger,
                    session_batches=o.calls,
                    compacted_messages=o.count or 0,
                    compaction_ms=o.duration_ms,
                )
                if o.failure:
                    out["session_failure"] = o.failure
            if o.action == "skipped":
                out["session_skip"] = o.skip_reason
            if o.version is not None:
                out.update(summary_version=o.version, summary_covers=o.covers)
            if o.extra.get("reused"):
                out["session_reused"] = True
        elif o.layer == Layer.LOOP:
            if o.action in ("compacted", "failed"):
                out.update(loop_trigger=o.trigger, loop_compaction_ms=o.duration_ms)
                if o.action == "compacted":
                    out["loop_rounds_compacted"] = o.count
            if o.failure:
                out["loop_failure"] = o.failure
            if o.action == "skipped":
                out["loop_skip"] = o.skip_reason
            if o.covers:
                out["loop_rounds_summarised"] = o.covers
            if "tool_rounds" in o.extra:
                out["tool_rounds"] = o.extra["tool_rounds"]
        elif o.layer == Layer.TRIM and o.action == "compacted":
            out.update(trimmed_results=o.count, trimmed_chars_saved=o.saved_chars)
            if o.extra.get("shortened"):
                out["shortened_messages"] = o.extra["shortened"]
        elif o.layer == Layer.FIT and o.action == "dropped":
            out.update(dropped_messages=o.count, dropped_reason=o.extra.get("reason"))
    if tokens_in or tokens_out:
        out.update(summarizer_tokens_in=tokens_in, summarizer_tokens_out=tokens_out)
    if restored:
        out["restored_references"] = restored
    if retries:
        out["summarizer_length_retries"] = retries
    if salvaged:
        out["summaries_salvaged"] = salvaged
    return out
