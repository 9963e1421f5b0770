"""Baseline strategies: what a client without Recap would send at each step. Pure.

Outside the data path: `benchmarks.replay` computes these in-process (no server), on the same
histories it sends through Recap. Each takes the history so far (the client's messages, the
last one being what the model answers) and returns the messages to send; none calls a model.

  none        pass-through: the whole history, however long
  window      a sliding window: the pinned system prompt and the last `keep` messages, the cut
              moved forward to a valid point so no tool result loses its call
  middle-out  head and tail: the system prompt, the first user message, and the newest part
              that fits the budget (the window less the share kept for the answer), cut at a
              valid point; the middle is dropped
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.history.conversation import is_turn_start, valid_cut_points
from proxy.history.messages import Message, split_pinned

Messages = Sequence[Message]
Count = Callable[[Message], int]

# Share of the window kept free for the answer, as Recap's last-resort fit keeps it.
OUTPUT_SHARE = 0.1


@dataclass(frozen=True)
class Baseline:
    name: str
    describe: str
    apply: Callable[[Messages, int], list[Message]]  # (history, context window) -> sent


def no_compaction(history: Messages, window: int) -> list[Message]:
    return list(history)


def sliding_window(history: Messages, window: int, *, keep: int) -> list[Message]:
    pinned, body = split_pinned(history)
    if len(body) <= keep:
        return list(history)
    cuts = [c for c in valid_cut_points(body) if c < len(body)]
    # The first valid cut inside the last `keep` messages; if the newest unit alone is longer
    # than that, the newest unit (a model answers nothing less).
    start = min(cuts[bisect.bisect_left(cuts, len(body) - keep) :] or [cuts[-1]])
    return [*pinned, *body[start:]]


def middle_out(
    history: Messages, window: int, *, count: Count, output_share: float = OUTPUT_SHARE
) -> list[Message]:
    pinned, body = split_pinned(history)
    head = body[:1] if body and is_turn_start(body[0]) else []
    rest = body[len(head) :]
    budget = int(window * (1 - output_share)) - sum(count(m) for m in [*pinned, *head])
    # suffix[i]: tokens of rest[i:]
    suffix = list(itertools.accumulate((count(m) for m in reversed(rest)), initial=0))[::-1]
    cuts = [c for c in valid_cut_points(rest) if c < len(rest)] or [0]
    start = next((c for c in cuts if suffix[c] <= budget), cuts[-1])
    return [*pinned, *head, *rest[start:]]


def baselines(count: Count, keep: int) -> list[Baseline]:
    return [
        Baseline("none", "no compaction: the whole history", no_compaction),
        Baseline(
            "window",
            f"sliding window: system prompt + last {keep} messages, cut at valid points",
            lambda h, w: sliding_window(h, w, keep=keep),
        ),
        Baseline(
            "middle-out",
            "head and tail: system prompt + first user message + newest part that fits "
            f"{1 - OUTPUT_SHARE:.0%} of the window",
            lambda h, w: middle_out(h, w, count=count),
        ),
    ]
