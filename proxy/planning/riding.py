"""Cache-riding summarizer input: ride on the request the conversation just forwarded.

Between the session planner and the summarizer call, beside `session_calls` (whose plan
it reads). Pure. Today's summarizer input is a transcript Recap renders, so no provider
prompt cache applies to it. A cache-riding call sends instead the conversation's last
forwarded request, its messages byte for byte as Recap forwarded them (the provider
cached them when the agent sent them), then one instruction message asking for the
summary of the first K messages shown above it. This module decides whether a planned
compaction may ride, and what the instruction names; the dialect builds the request
(`dialects/riding.py`), the summarizer sends it.

A plan rides only when every part of it can be said exactly; otherwise it falls back to
the transcript style, and says why (`RidingFallback`, a typed value the audit row and the
log line carry):
- the scene asks for it (`input: cache_riding`), the tenant's summarizer is its upstream
  (a separate summarizer is another provider's cache) and the request's API has a riding
  request (`dialects/riding.py`);
- the forwarded request is known exactly (`Forwarded`: captured as it went upstream);
- the plan is one summarizer call (several batches merge summaries the request never
  showed);
- the view shows the part to fold one message for one message: the summary it applied
  is the one the plan merges into, then the body from that summary's boundary in order
  (a trimmed tool result stands in place for its original; a message the last resort
  dropped, or a working summary inside the part, is not shown, so it cannot ride), and
  the API can number the part's end among its own entries (a Messages fold that ends
  inside one message cannot be; `dialects/riding.py`);
- the riding request fits the summarizer's window (`budget.prompt_tokens`, the same
  margin as a transcript call's).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.history.messages import Message, is_pinned
from proxy.planning.budget import prompt_tokens
from proxy.planning.transcript import content_text

# How many words of the last folded message the instruction quotes to name it.
ANCHOR_WORDS = 12
ANCHOR_CHARS = 120


class SummaryInput(enum.StrEnum):
    """What a session summarizer call is given (a scene's `input`)."""

    TRANSCRIPT = "transcript"  # the folded messages rendered as text
    CACHE_RIDING = "cache_riding"  # the last forwarded request, then one instruction


class RidingFallback(enum.StrEnum):
    """Why a compaction whose scene asks for cache riding was sent as a transcript."""

    NOT_FORWARDED = "not_forwarded"  # no forwarded request of this history is known exactly
    DIALECT = "dialect"  # this API has no riding request, or the forwarded one is another API's
    SEPARATE_UPSTREAM = "separate_upstream"  # summarizer.upstream is another provider
    SEVERAL_BATCHES = "several_batches"  # the plan needs more than one call
    SUMMARY_MOVED = "summary_moved"  # the plan merges into a summary the view did not show
    NOT_SHOWN = "not_shown"  # the view does not show the folded part message for message
    TOO_LARGE = "too_large"  # the riding request would not fit the summarizer's window
    BODY = "body"  # the forwarded body asks for an answer no summary can be (tool_choice ...)
    FAILED = "failed"  # the riding call failed; the transcript call was made instead


@dataclass(frozen=True)
class Forwarded:
    """A request as it went upstream, captured where its body was made (edge/forward.py).

    `body` is the decoded JSON forwarded (the client's very bytes when nothing changed);
    `view` the history it carries in the neutral view; `pinned` how many of the client's
    leading instructions the view starts with; `covered` and `version` the session summary
    the view shows at `view[pinned]` (0 and None: none); `loop_index` where a working
    summary sits in it; `dropped` whether the last resort dropped any message."""

    dialect: str
    body: bytes
    view: Sequence[Message]
    pinned: int
    covered: int = 0
    version: int | None = None
    loop_index: int | None = None
    dropped: bool = False
    # Tokens the upstream counts beside the history (tool definitions), estimated.
    fixed_tokens: int = 0


@dataclass(frozen=True)
class RidingPlan:
    """The one riding call of a compaction: the first `count` messages of the forwarded
    view are to be summarised (the stage then gives `count` and `role` as the API numbers
    them: `dialects.riding.RidingRequest.number`); `anchor` quotes the first words of the
    last of them, whose role is `role`; `shown` says the view shows a summary the new one
    must merge; `after` are the view's messages past the folded part (input the summary
    does not replace)."""

    forwarded: Forwarded
    count: int
    role: str
    anchor: str
    shown: bool
    after: tuple[Message, ...]


def anchor_words(message: Message) -> str:
    """The first words of a message's text, as the instruction quotes them to name it."""
    words = content_text(message.get("content")).split()
    if not words:
        calls = message.get("tool_calls")
        names = [
            str(c.get("function", {}).get("name"))
            for c in (calls if isinstance(calls, list) else [])
            if isinstance(c, dict) and isinstance(c.get("function"), dict)
        ]
        return f"[a call of {', '.join(names)}]" if names else "[no text]"
    text = " ".join(words[:ANCHOR_WORDS])
    if len(text) > ANCHOR_CHARS:
        text = text[: ANCHOR_CHARS - 1].rstrip() + "…"
    elif len(words) > ANCHOR_WORDS:
        text += " …"
    return text


def plan_riding(
    forwarded: Forwarded | None,
    *,
    calls: int,
    start: int,
    end: int,
    body: Sequence[Message],
    applied_version: int | None,
) -> RidingPlan | RidingFallback:
    """Whether the compaction folding `body[start:end]` (merged into the summary
    `applied_version`, which covers `body[:start]`) can ride on `forwarded`, whose view was
    made from this same client body (the caller checks that). `calls`: how many summarizer
    calls the plan makes."""
    if forwarded is None:
        return RidingFallback.NOT_FORWARDED
    if calls != 1:
        return RidingFallback.SEVERAL_BATCHES
    if forwarded.version != applied_version or (forwarded.version is None) != (start == 0):
        return RidingFallback.SUMMARY_MOVED
    if forwarded.covered != start or forwarded.dropped:
        return RidingFallback.NOT_SHOWN
    shown = forwarded.version is not None
    # Instructions inside the covered part stay right after the summary (session_view).
    kept = sum(1 for m in body[:start] if is_pinned(m)) if shown else 0
    offset = forwarded.pinned + (1 + kept if shown else 0)
    last = offset + (end - start)  # view[offset:last] stands for body[start:end]
    if not offset < last <= len(forwarded.view):
        return RidingFallback.NOT_SHOWN
    if forwarded.loop_index is not None and forwarded.loop_index < last:
        return RidingFallback.NOT_SHOWN
    for i in range(start, end):
        # In place, one for one: a trimmed result keeps its role and call id.
        seen, sent = forwarded.view[offset + i - start], body[i]
        if seen.get("role") != sent.get("role") or seen.get("tool_call_id") != sent.get(
            "tool_call_id"
        ):
            return RidingFallback.NOT_SHOWN
    named = forwarded.view[last - 1]
    return RidingPlan(
        forwarded,
        count=last,
        role=str(named.get("role") or "message"),
        anchor=anchor_words(named),
        shown=shown,
        after=tuple(forwarded.view[last:]),
    )


def riding_fits(
    riding: RidingPlan,
    *,
    window: int,
    max_tokens: int,
    instruction_tokens: int,
    count: Callable[[Message], int],
) -> bool:
    """Whether the riding request (the forwarded view, the tool definitions and the
    instruction) leaves the call's `max_tokens` and the margin free in `window`."""
    weight = sum(count(m) for m in riding.forwarded.view) + riding.forwarded.fixed_tokens
    return weight + instruction_tokens <= prompt_tokens(window, max_tokens)
