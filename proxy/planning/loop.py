"""Loop working memory: older tool rounds of the running turn -> a working summary (seed 000 §7).

The planning step for tool_continuation requests, after the session view is assembled (the
messages here are whatever list goes upstream; indices refer to it). Pure: the messages, the
turn's stored working summary and the policy go in, a `LoopPlan` comes out; `loop_view`
assembles what is sent.

The working set is everything after the user message that started the running turn (a
confirmation resume, a user message without content, does not start one). Its tool rounds
are numbered from 0; the first `covered_rounds` of them are already in the working summary,
which rolls: each compaction merges the next rounds into it.

Trigger and hysteresis: compact when the raw rounds reach loop_recent_tool_rounds +
loop_trigger_tool_rounds, then keep the newest loop_recent_tool_rounds raw. After that the
next compaction needs loop_trigger_tool_rounds new rounds, so with the defaults (5/5) a long
loop pays one summarizer call per 5 steps, never one per step. The token trigger
(loop_trigger_tokens, counted over the raw working set as sent) fires with fewer rounds:
it keeps newest rounds only while they stay under half that budget (at least one), so it
too needs half a budget of new output before it fires again. The token trigger scales
with the model's window: it is at most WINDOW_SHARE of it, so on a small window rounds
are summarised long before the last-resort fit would have to drop any.

System and developer messages inside the summarised rounds' span stay in the view, in
order, right after the working summary: instructions are pinned, never summarised.

The newest round always stays raw: it holds the results the model is about to read.

The rounds folded in one call are bounded by the summarizer's context window too (a
`TranscriptBudget`, planning/budget.py): the newest of the due rounds wait for the next
step when the older ones fill a call (at least one round is folded; one too large for a
call is rendered shortened by the caller, transcript.render_within).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.config import LoopCompaction
from proxy.history.conversation import ToolRound, tool_rounds, turn_starts
from proxy.history.messages import Message, is_pinned
from proxy.planning.budget import TranscriptBudget

LoopTrigger = Literal["tool_rounds", "tokens"]

# The token trigger's cap, as a share of the model's context window.
WINDOW_SHARE = 0.5


def trigger_tokens(policy: LoopCompaction, context_window: int | None) -> int:
    """loop_trigger_tokens, capped at WINDOW_SHARE of the window when it is known."""
    if context_window is None or context_window <= 0:
        return policy.loop_trigger_tokens
    return max(1, min(policy.loop_trigger_tokens, int(context_window * WINDOW_SHARE)))


@dataclass(frozen=True)
class LoopState:
    """The running turn's working summary, found by the chain hash at the turn's start."""

    summary: str
    covered_rounds: int


@dataclass(frozen=True)
class LoopPlan:
    # Index of the user message that started the turn; None if there is none.
    turn_start: int | None
    rounds: tuple[ToolRound, ...]
    # Rounds already in the applied working summary (0: no summary applies; a stored state
    # that covers more rounds than the turn has is ignored).
    covered_rounds: int
    # Round index range [a, b) to merge into the working summary now; None: no compaction.
    compact_rounds: tuple[int, int] | None
    trigger: LoopTrigger | None
    # "disabled", "no_turn", "below_threshold", "nothing_to_compact".
    skip_reason: str | None

    def boundary(self, covered_rounds: int) -> int:
        """Message index where the raw part starts when `covered_rounds` are summarised."""
        if self.turn_start is None or covered_rounds <= 0:
            return 0 if self.turn_start is None else self.turn_start + 1
        return self.rounds[covered_rounds - 1].end

    @property
    def compact_span(self) -> tuple[int, int] | None:
        """Message range [start, end) to summarise now (merged with the applied summary)."""
        if self.compact_rounds is None:
            return None
        a, b = self.compact_rounds
        return self.boundary(a), self.boundary(b)


def plan_loop(
    messages: Sequence[Message],
    state: LoopState | None,
    policy: LoopCompaction,
    count: Callable[[Message], int],
    context_window: int | None = None,
    transcript: Callable[[], TranscriptBudget] | None = None,
) -> LoopPlan:
    """Plan this step; `transcript` gives the bound of one call's transcript, asked for
    only when rounds are due."""
    starts = turn_starts(messages)
    if not starts:
        return LoopPlan(None, (), 0, None, None, "no_turn")
    turn_start = starts[-1]
    rounds = tuple(r for r in tool_rounds(messages) if r.start > turn_start)
    covered = state.covered_rounds if state is not None else 0
    if not 0 <= covered <= len(rounds):
        covered = 0

    def plan(
        compact: tuple[int, int] | None, trigger: LoopTrigger | None, skip: str | None
    ) -> LoopPlan:
        return LoopPlan(turn_start, rounds, covered, compact, trigger, skip)

    if not policy.enabled:
        return plan(None, None, "disabled")
    raw = len(rounds) - covered
    recent = max(policy.loop_recent_tool_rounds, 1)
    first_raw = plan(None, None, None).boundary(covered)
    # tail[i]: tokens of messages[first_raw + i:], what is sent from there on.
    tail = [0]
    for m in reversed(messages[first_raw:]):
        tail.append(tail[-1] + count(m))
    tail.reverse()
    budget = trigger_tokens(policy, context_window)
    trigger: LoopTrigger
    if raw >= recent + max(policy.loop_trigger_tool_rounds, 1):
        trigger, keep = "tool_rounds", recent
    elif tail[0] >= budget:
        # Keep the newest rounds that fit in half the budget (at least one), so the next
        # compaction waits for half a budget of new output.
        trigger, keep = "tokens", 1
        for k in range(2, min(recent, raw - 1) + 1):
            if tail[rounds[-k].start - first_raw] > budget / 2:
                break
            keep = k
    else:
        return plan(None, None, "below_threshold")
    end = len(rounds) - keep
    if end <= covered:
        return plan(None, trigger, "nothing_to_compact")
    if transcript is not None:
        end = _fitting(rounds, covered, end, first_raw, transcript())
    return plan((covered, end), trigger, None)


def _fitting(
    rounds: Sequence[ToolRound], covered: int, end: int, first: int, budget: TranscriptBudget
) -> int:
    """The largest end <= `end` whose rounds after `covered` fit one call (at least one)."""
    total = sum(budget.tokens(i) for i in range(first, rounds[end - 1].end))
    while end - 1 > covered and total > budget.first:
        total -= sum(budget.tokens(i) for i in range(rounds[end - 2].end, rounds[end - 1].end))
        end -= 1
    return end


def loop_view(
    messages: Sequence[Message], covered_rounds: int, summary_message: Message | None
) -> list[Message]:
    """Up to the turn's user message, the working summary, then everything after the
    summarised rounds (raw rounds, each complete, and any trailing non-round messages).

    Unchanged when nothing is summarised or `covered_rounds` does not fit the turn.
    """
    starts = turn_starts(messages)
    if summary_message is None or covered_rounds <= 0 or not starts:
        return list(messages)
    rounds = [r for r in tool_rounds(messages) if r.start > starts[-1]]
    if covered_rounds > len(rounds):
        return list(messages)
    end = rounds[covered_rounds - 1].end
    return [
        *messages[: starts[-1] + 1],
        summary_message,
        *[m for m in messages[starts[-1] + 1 : end] if is_pinned(m)],
        *messages[end:],
    ]
