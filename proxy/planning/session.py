"""Session rolling summaries: when to compact, what stays raw, in which batches (seed 000 §6).

The planning step for turn_start requests, between classification and the summarizer calls.
Pure: the request's messages, the summary the store found for them and the policy go in; a
`SessionPlan` comes out, and `session_view` assembles what is sent. The caller runs the
batches through the summarizer in order, each merging into the summary so far, and stores
the result with `new_covered`.

The request is `pinned` (leading system/developer messages, sent as they came) + `body`; the
last turn of `body` is the current one. An applied summary replaces body[:covered], except
the system/developer messages in it, which stay (pinned in place, see `session_view`).

Rules, and why:
- What stays raw: the last `recent_turns` turns and at least `min_recent_ratio` of the
  window counted back from the newest message, whichever keeps more (seed 000 §6.4, seed
  003: follow-ups lean on the exact recent wording). In "replace" mode (seed 002) only the
  current turn stays. Cuts are made only before a turn-starting user message, so a tool
  call and its results are never split.
- First trigger, `min_new_tokens`: the compactable part (after the summary's boundary,
  before what stays raw) reaches min_new_tokens. Seed 000 §6.5 counts "compactable new
  messages"; counting the raw tail too would fire on every turn once the tail alone is
  that large.
- Second trigger, `context_ratio`: the estimated request (pinned + summary + uncompacted
  history + current message) reaches trigger_ratio of the window, with min_new_messages
  messages since the boundary and min_compact_messages to compact.
- Progress: when the request is over the trigger but keeping that much leaves nothing to
  compact, fewer turns are kept (as many as still leave enough to compact; at least the
  current turn).
- The window wins (`room`: the tokens the view may hold, the window less the answer's
  reserve), weighed as it is sent: the summary in its framed message, and the instructions
  inside the covered part, which stay: raw recent turns that would leave the view over it
  are folded too (as few as make it fit; at least the current turn stays), since the last
  resort would drop them whole (seed 000 §14.4, §16.3). Over the room, the anti-loop and
  saving rules give way: the fold still makes progress, and losing less than a dropped turn
  is the saving.
- Tool continuations (`continuation`) are planned for the window alone: a view over the
  room folds every turn before the running one (trigger "over_window"), so a long tool
  loop after short turns keeps what they said instead of losing them to the last resort;
  otherwise nothing is done, and the running turn is loop working memory's.
- No compaction loops: a compaction that is not forced consumes at least min_new_tokens
  tokens (first trigger) or max(min_new_messages, min_compact_messages) messages (second),
  and saves min_saving_tokens. What it consumes leaves the raw history for good, and that
  history only grows by new messages, so compactions are at most as frequent as that much
  new history arrives, however large the raw tail that must stay. Skip reason "anti_loop":
  over the trigger, but too little history arrived since the summary's boundary
  ("too_few_messages" when there is no summary yet).
- Saving: the slice's tokens minus the summary's estimated growth (the first summary's
  with its frame); the summary is assumed to grow by the slice up to max_summary_chars
  (seed 002's min_saving_tokens).
- Batches: at most max_batch_messages messages per summarizer call, max_rounds_per_request
  calls, and (with a `TranscriptBudget`) at most the transcript tokens the summarizer's
  context window leaves for one call (planning/budget.py). A batch ends before a
  turn-starting user message; a turn longer than a batch is cut at a tool-round boundary
  inside it rather than stall. With a token budget a batch is also cut inside a turn when
  ending at the turn's start would fold less than half of what fits: each call rewrites
  the whole summary, so a small batch costs nearly as much as a full one. One tool round
  (or a lone message) larger than a batch goes whole: the caller renders it shortened to
  fit (transcript.render_within), which loses the middle of its largest items rather than
  stall the conversation's compaction. The final boundary is moved back to a turn start
  when the rounds run out mid-turn, unless no batch ends at one (a single turn longer than
  all rounds together), where progress wins over the rule: the history stays valid
  because every batch ends at a valid cut point.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.config import SessionCompaction
from proxy.history.conversation import turn_cut_points, valid_cut_points
from proxy.history.messages import Message, is_pinned
from proxy.planning.budget import TranscriptBudget
from proxy.planning.framing import summary_message
from proxy.planning.transcript import detect_language

# Summaries are written to a character budget; this converts it to tokens for the saving
# estimate (English prose; Chinese is denser, which only makes the estimate cautious).
CHARS_PER_TOKEN = 3.5

SessionTrigger = Literal["min_new_tokens", "context_ratio", "over_window", "forced"]


@dataclass(frozen=True)
class AppliedSummary:
    """The stored summary whose boundary matches this request: it replaces body[:covered]."""

    summary: str
    covered: int
    version: int


@dataclass(frozen=True)
class SessionPlan:
    applied: AppliedSummary | None
    trigger: SessionTrigger | None
    # Why nothing is compacted even if a trigger fired: "disabled", "below_threshold",
    # "nothing_to_compact", "too_few_messages", "anti_loop", "saving_below_min". A trigger
    # may be set with a skip reason: it fired, and the reason says why nothing is done.
    skip_reason: str | None
    # Half-open ranges into body, contiguous from the applied boundary to new_covered.
    batches: tuple[tuple[int, int], ...]
    new_covered: int
    tokens_before: int
    tokens_after_estimate: int

    @property
    def compacts(self) -> bool:
        return bool(self.batches)


def plan_session(
    pinned: Sequence[Message],
    body: Sequence[Message],
    applied: AppliedSummary | None,
    policy: SessionCompaction,
    context_window: int,
    count: Callable[[Message], int],
    count_text: Callable[[str], int],
    force: bool = False,
    budget: Callable[[], TranscriptBudget] | None = None,
    room: int | None = None,
    continuation: bool = False,
) -> SessionPlan:
    """Decide whether and what to compact for this request (see the module docstring).

    `force` (manual compaction) bypasses the thresholds, the saving estimate, the
    retention of recent turns and `enabled`: it folds everything before the current
    turn, and skips only when nothing there is left to fold. `budget` gives the bound of
    each batch's transcript in tokens (indices into `body`), asked for only when there are
    batches to cut. `room` bounds the view (None: no bound); `continuation` plans a tool
    continuation (for the window only). Raises ValueError if
    `applied` covers more than the body holds.
    """
    covered = applied.covered if applied is not None else 0
    if not 0 <= covered <= len(body):
        raise ValueError(f"summary covers {covered} messages of a body of {len(body)}")
    counts = [count(m) for m in body]
    tokens = _Prefix(counts)
    # The instructions inside the covered part stay in the view (session_view).
    kept = _Prefix([n if is_pinned(m) else 0 for m, n in zip(body, counts, strict=True)])
    fixed = sum(count(m) for m in pinned)
    summary_tokens = count_text(applied.summary) if applied is not None else 0
    frame = _frame_tokens(body, applied, policy, count, count_text)
    shown = frame + summary_tokens if applied is not None else 0
    before = fixed + kept.span(0, covered) + shown + tokens.span(covered, len(body))

    def skip(reason: str, trigger: SessionTrigger | None = None) -> SessionPlan:
        return SessionPlan(applied, trigger, reason, (), covered, before, before)

    if not (policy.enabled or force):
        return skip("disabled")
    cuts = [c for c in turn_cut_points(body) if c >= covered]
    if not cuts:
        return skip("nothing_to_compact")
    over_room = room is not None and before > room
    if continuation and not (over_room or force):
        return skip("below_threshold")
    threshold = context_window * policy.trigger_ratio
    over = before >= threshold or over_room
    needed = 1 if force else max(policy.min_compact_messages, policy.min_new_messages, 1)

    # Forced (manual) compaction folds everything before the current turn; so does a tool
    # continuation over the room.
    if force or continuation:
        cut = cuts[-1]
    else:
        cut = _raw_from(cuts, covered, tokens, policy, context_window)
        if cut <= covered and over:
            # Keep fewer turns so the summary makes progress: as many as still leave enough.
            cut = next((c for c in cuts if c - covered >= needed), cuts[-1])
        if over_room and room is not None:
            weights = (fixed, frame, summary_tokens)
            cut = _fitting(cuts, cut, covered, (tokens, kept), weights, room, policy)
    slice_messages = cut - covered
    slice_tokens = tokens.span(covered, cut)

    trigger: SessionTrigger | None = None
    if force:
        trigger = "forced"
    elif continuation:
        trigger = "over_window"
    elif slice_tokens >= policy.min_new_tokens and slice_messages > 0:
        trigger = "min_new_tokens"
    elif before >= threshold:
        trigger = "context_ratio"
    elif over_room:
        trigger = "over_window"
    if trigger is None:
        return skip("below_threshold")
    if slice_messages <= 0:
        return skip("nothing_to_compact", trigger)
    if not (force or over_room):
        new_messages = cuts[-1] - covered
        if trigger == "context_ratio" and (
            new_messages < policy.min_new_messages or slice_messages < needed
        ):
            # Over the trigger, but too little history since the boundary to be worth a call.
            return skip("anti_loop" if applied is not None else "too_few_messages", trigger)
    growth = _summary_after(summary_tokens, slice_tokens, policy) - summary_tokens
    if applied is None:
        growth += frame  # the first summary brings its frame
    # Forced (manual) compaction means it, and over the room the window does: no saving
    # estimate stands in their way.
    if not (force or over_room) and slice_tokens - growth < policy.min_saving_tokens:
        return skip("saving_below_min", trigger)

    batches = _batches(body, covered, cut, policy, budget() if budget is not None else None)
    new_covered = batches[-1][1]
    done = tokens.span(covered, new_covered)
    grown = frame + _summary_after(summary_tokens, done, policy)
    after = fixed + kept.span(0, new_covered) + grown + tokens.span(new_covered, len(body))
    return SessionPlan(applied, trigger, None, tuple(batches), new_covered, before, after)


def session_view(
    pinned: Sequence[Message],
    body: Sequence[Message],
    covered: int,
    summary_message: Message | None,
) -> list[Message]:
    """What goes upstream: pinned, then the summary, then the body it does not cover.

    The same inputs give the same list of the same objects, so between compactions the
    outgoing prefix is byte-identical and upstream prompt caches keep hitting. Both modes
    use this view: "replace" differs in what the planner leaves raw (only the current
    turn), never in dropping messages no summary covers. System and developer messages
    inside the covered part are instructions, not history: they stay, in order, right
    after the summary (the summarizer never sees them).
    """
    if summary_message is None:
        return [*pinned, *body]
    kept = [m for m in body[:covered] if is_pinned(m)]
    return [*pinned, summary_message, *kept, *body[covered:]]


class _Prefix:
    """Token sums over index ranges in O(1)."""

    def __init__(self, counts: list[int]) -> None:
        self.sums = [0, *itertools.accumulate(counts)]

    def span(self, start: int, end: int) -> int:
        return self.sums[end] - self.sums[start] if end > start else 0


def quiet_reason(
    body: Sequence[Message],
    policy: SessionCompaction,
    context_window: int,
    bound: int,
    room: int | None = None,
) -> str | None:
    """The skip reason `plan_session` gives an unforced turn start with no applied summary
    (and the same `room`), told from `bound`, an upper bound of its messages' tokens
    (`Measure.at_most`), without counting any: None when it cannot be told so (then plan,
    and count)."""
    if not policy.enabled:
        return "disabled"
    if not turn_cut_points(body):
        return "nothing_to_compact"
    # No trigger can fire: the slice to fold and the whole are within the bound.
    if bound < min(policy.min_new_tokens, context_window * policy.trigger_ratio) and (
        room is None or bound <= room
    ):
        return "below_threshold"
    return None


def _raw_from(
    cuts: list[int],
    covered: int,
    tokens: _Prefix,
    policy: SessionCompaction,
    context_window: int,
) -> int:
    """Index where the raw part starts under the retention rule (`covered`: all raw)."""
    if policy.mode == "replace":
        return cuts[-1]
    keep = max(policy.recent_turns, 1)  # the current turn always stays
    by_turns = cuts[-keep] if keep <= len(cuts) else covered
    end = len(tokens.sums) - 1
    target = policy.min_recent_ratio * context_window
    by_ratio = covered
    for c in reversed(cuts):
        if tokens.span(c, end) >= target:
            by_ratio = c
            break
    return min(by_turns, by_ratio)


def _fitting(
    cuts: list[int],
    cut: int,
    covered: int,
    prefixes: tuple[_Prefix, _Prefix],
    weights: tuple[int, int, int],
    room: int,
    policy: SessionCompaction,
) -> int:
    """The first cut point from `cut` on whose view fits `room`; the current turn's start
    when none does. The view: the pinned messages, the instructions in the folded part
    (`prefixes`: every message's tokens, the instructions' only), the frame and the summary
    grown by the fold (`weights`: pinned, frame, the applied summary's bare text), and the
    raw rest."""
    tokens, kept = prefixes
    pinned, frame, summary = weights
    end = len(tokens.sums) - 1
    for c in cuts:
        if c < cut:
            continue
        grown = frame + _summary_after(summary, tokens.span(covered, c), policy)
        if pinned + kept.span(0, c) + grown + tokens.span(c, end) <= room:
            return c
    return cuts[-1]


def _frame_tokens(
    body: Sequence[Message],
    applied: AppliedSummary | None,
    policy: SessionCompaction,
    count: Callable[[Message], int],
    count_text: Callable[[str], int],
) -> int:
    """What a summary's message weighs over its bare text: the framing text, the tags, the
    message's own tokens. For the applied summary, exactly the message the stage sends
    (`summary_message`, in the covered part's language); with none yet, the heavier of the
    languages' frames, since the new summary's language is not known before the fold."""
    if applied is not None:
        language = detect_language(body[: applied.covered])
        sent = summary_message(applied.summary, policy.summary_role, language, "session")
        return max(count(sent) - count_text(applied.summary), 0)
    return max(
        count(summary_message("", policy.summary_role, language, "session"))
        for language in ("English", "Chinese")
    )


def _summary_after(summary_tokens: int, added: int, policy: SessionCompaction) -> int:
    """Estimated summary size after merging `added` tokens of history into it."""
    cap = max(math.ceil(policy.max_summary_chars / CHARS_PER_TOKEN), summary_tokens)
    return min(cap, summary_tokens + added)


def _batches(
    body: Sequence[Message],
    start: int,
    cut: int,
    policy: SessionCompaction,
    budget: TranscriptBudget | None = None,
) -> list[tuple[int, int]]:
    # `cut` is a turn cut point, so it ends both lists.
    turn_ends = [c for c in turn_cut_points(body) if start < c <= cut]
    any_ends = [c for c in valid_cut_points(body) if start < c <= cut]
    size = max(policy.max_batch_messages, 1)
    # weight[k]: transcript tokens of body[first:first + k], only for what may be folded.
    first = start
    weight = (
        _Prefix([budget.tokens(i) for i in range(start, cut)]).sums if budget is not None else []
    )
    batches: list[tuple[int, int]] = []
    while start < cut and len(batches) < max(policy.max_rounds_per_request, 1):
        limit = start + size
        if budget is not None:
            # The furthest end whose transcript still fits this call's budget.
            room = weight[start - first] + budget.limit(len(batches))
            limit = min(limit, first + bisect.bisect_right(weight, room) - 1)
        end = _last_at_most(turn_ends, start, limit)
        further = _last_at_most(any_ends, start, limit)
        if end is None:
            end = further
        elif budget is not None and further is not None:
            # Every call rewrites the whole summary: a turn end that leaves most of the
            # call's room unused gives way to a round boundary inside the next turn.
            at = weight[start - first]
            if 2 * (weight[end - first] - at) < weight[further - first] - at:
                end = further
        if end is None:  # one tool round larger than a batch: it goes whole
            end = any_ends[bisect.bisect_right(any_ends, start)]
        batches.append((start, end))
        start = end
    if start < cut:
        at_turn = [i for i, (_, e) in enumerate(batches) if e in turn_ends]
        if at_turn:
            del batches[at_turn[-1] + 1 :]
    return batches


def _last_at_most(ends: list[int], after: int, limit: int) -> int | None:
    """The largest end in (after, limit], or None."""
    i = bisect.bisect_right(ends, limit)
    if i and ends[i - 1] > after:
        return ends[i - 1]
    return None
