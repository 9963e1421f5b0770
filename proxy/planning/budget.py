"""The summarizer's own limits: how long a summary may be in tokens, and how much
transcript one summarizer call can take (issue 15.3).

Between planning and the summarizer call. Pure: character budgets, token counts and the
summarizer's context window in, token budgets out. The session planner cuts its batches
to `TranscriptBudget` and the loop planner the rounds it folds; the summarizer sends
`summary_max_tokens` as the call's `max_tokens`.

Why these numbers:
- A summary is written to `max_summary_chars` characters (and rejected over it), so its
  `max_tokens` need not be larger than the tokens those characters can take. Tokens per
  character depend on the script: English prose runs about 4 characters a token, code a
  little less, Chinese, Japanese and Korean about one character a token or more.
  `CHARS_PER_TOKEN` is deliberately low for each (more tokens allowed than a valid summary
  needs), with `OUTPUT_HEADROOM` and `OUTPUT_OVERHEAD` (tags, headings) on top: a summary
  that fits its character cap is never cut by its token cap. The scene's own `max_tokens`
  caps it, and so does half the window (the prompt needs the rest).
- Recap counts with its own tokenizer, the summarizer model with its own, and a chat
  template adds tokens Recap does not see: `PROMPT_MARGIN` of the window is kept free. It
  also holds the scene's `length_retry` text (under 100 tokens), which a second try after
  a cut by max_tokens appends to a prompt sized for the first.
- A later batch merges into the summary the previous batch wrote, unknown when batches are
  planned; it is reserved at the most a summary can be (`summary_tokens` of the cap).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.history.messages import Message, is_pinned
from proxy.planning.transcript import render_transcript

# Characters per token, low estimates: dense scripts, and everything else.
DENSE_LANGUAGES = frozenset({"Chinese", "Japanese", "Korean"})
CHARS_PER_TOKEN_DENSE = 1.0
CHARS_PER_TOKEN = 3.0
OUTPUT_HEADROOM = 1.2
OUTPUT_OVERHEAD = 64
# Share of the window left free for tokenizer differences and the chat template.
PROMPT_MARGIN = 0.1
# The output may take at most this share of the window.
OUTPUT_WINDOW_SHARE = 0.5
# Tokens between two transcript items (the blank line), counted per message.
ITEM_SEPARATOR_TOKENS = 1


def summary_tokens(max_chars: int, language: str) -> int:
    """The most tokens a summary of at most `max_chars` characters takes (an estimate)."""
    per = CHARS_PER_TOKEN_DENSE if language in DENSE_LANGUAGES else CHARS_PER_TOKEN
    return math.ceil(max(max_chars, 0) / per)


def summary_max_tokens(
    max_chars: int, language: str, scene_max_tokens: int | None, window: int
) -> int:
    """The `max_tokens` of a summarizer call: room for `max_chars` characters with headroom,
    at most the scene's `max_tokens` and half the summarizer's window."""
    wanted = math.ceil(summary_tokens(max_chars, language) * OUTPUT_HEADROOM) + OUTPUT_OVERHEAD
    if scene_max_tokens is not None:
        wanted = min(wanted, scene_max_tokens)
    return max(1, min(wanted, int(window * OUTPUT_WINDOW_SHARE)))


def prompt_tokens(window: int, max_tokens: int) -> int:
    """Tokens the prompt of one call may take (Recap's count): the window less the output
    and the margin."""
    return max(0, window - max_tokens - math.ceil(window * PROMPT_MARGIN))


@dataclass(frozen=True)
class TranscriptBudget:
    """How much rendered transcript one summarizer call may take, in tokens.

    `first` holds for the first call (the summary it merges into is known), `later` for the
    calls after it (that summary is reserved at its most). `tokens(i)` is what message `i`
    (an index the planner uses) weighs once rendered in a transcript, separator included.
    """

    first: int
    later: int
    tokens: Callable[[int], int]

    def limit(self, call: int) -> int:
        return self.first if call == 0 else self.later


def transcript_budget(
    window: int,
    max_tokens: int,
    fixed_tokens: int,
    summary_tokens_now: int,
    summary_tokens_most: int,
    tokens: Callable[[int], int],
) -> TranscriptBudget:
    """The budget for calls whose prompt, without transcript and summary, weighs
    `fixed_tokens` (scene text, current message or goal)."""
    room = prompt_tokens(window, max_tokens) - fixed_tokens
    return TranscriptBudget(
        first=max(0, room - summary_tokens_now),
        later=max(0, room - max(summary_tokens_now, summary_tokens_most)),
        tokens=tokens,
    )


def item_weights(
    messages: Sequence[Message], max_item_chars: int, count_text: Callable[[str], int]
) -> Callable[[int], int]:
    """The tokens message `i` adds to a transcript (each counted once, when first asked):
    its rendered text and the separator; a pinned message adds nothing (it stays raw)."""
    weights: dict[int, int] = {}

    def weight(i: int) -> int:
        if i not in weights:
            m = messages[i]
            text = "" if is_pinned(m) else render_transcript([m], max_item_chars)
            weights[i] = count_text(text) + ITEM_SEPARATOR_TOKENS if text else 0
        return weights[i]

    return weight


# Below this many tokens of room a transcript says too little to be worth a call.
MIN_TRANSCRIPT_TOKENS = 256


@dataclass(frozen=True)
class CallLimits:
    """What one compaction's summarizer calls may take: `max_tokens` each, and the
    transcript budget under the summarizer's context window."""

    max_tokens: int
    budget: TranscriptBudget


def call_limits(
    window: int,
    scene_max_tokens: int | None,
    scene_tokens: int,
    summary: str,
    *,
    max_chars: int,
    language: str,
    count_text: Callable[[str], int],
    item_tokens: Callable[[int], int],
) -> CallLimits:
    """The limits of calls under a summarizer `window` whose scene, rendered without its
    transcript and summary, weighs `scene_tokens`; `summary` is the one the first call
    merges into, `item_tokens` weighs a message."""
    max_tokens = summary_max_tokens(max_chars, language, scene_max_tokens, window)
    budget = transcript_budget(
        window,
        max_tokens,
        scene_tokens,
        count_text(summary) if summary else 0,
        summary_tokens(max_chars, language),
        item_tokens,
    )
    return CallLimits(max_tokens, budget)
