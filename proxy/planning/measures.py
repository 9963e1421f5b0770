"""The holdout's outcome measures of one conversation, from what its archive recorded.

Pure: the archived requests of one conversation in (read from the store by
`proxy/archive/holdout.py`), one value per measure out; `proxy/planning/compare.py` sets the
two cohorts side by side. No model is asked anything: every measure is counted from the
request and response events (docs/holdout.md says what each can and cannot tell).

Every measure is one number per conversation, because the conversation is what the cohort
was drawn for: a per-request figure (tokens per turn, added latency) is first averaged
within its conversation.
"""

from __future__ import annotations

import difflib
import enum
import json
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.config import Prices
from proxy.planning.cohort import Cohort

# A user message this close to one of the last few is the user asking again.
REASK_RATIO = 0.9
REASK_WINDOW = 3
REASK_MIN_WORDS = 3


class ErrorKind(enum.StrEnum):
    """Why an answer was not one (the upstream's status, or Recap's own error code)."""

    CONTEXT_OVERFLOW = "context_overflow"
    RATE_LIMITED = "rate_limited"
    REFUSED = "refused"  # another 4xx
    SERVER = "server"  # a 5xx, Recap's gateway errors, or an error inside a 200 stream


class Finish(enum.StrEnum):
    """Why an answer ended, in one vocabulary for the three APIs."""

    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"
    FILTERED = "content_filter"
    OTHER = "other"
    NONE = "none"  # no answer: an error, or none archived


_FINISH_WORDS = {
    "stop": Finish.STOP,
    "end_turn": Finish.STOP,
    "stop_sequence": Finish.STOP,
    "completed": Finish.STOP,
    "tool_calls": Finish.TOOL_CALLS,
    "function_call": Finish.TOOL_CALLS,
    "tool_use": Finish.TOOL_CALLS,
    "length": Finish.LENGTH,
    "max_tokens": Finish.LENGTH,
    "incomplete": Finish.LENGTH,
    "content_filter": Finish.FILTERED,
    "refusal": Finish.FILTERED,
}

# The context-length refusals Recap recovers from (proxy/edge/overflow.py lists whose).
_OVERFLOW = re.compile(
    r"context_length_exceeded|maximum context length|range of input length should be"
    r"|exceeds the maximum allowed length|prompt is too long|exceed context limit"
    r"|context window",
    re.I,
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    # Canonical: a JSON object's keys sorted, so one call written twice compares equal.
    arguments: str


def tool_call(name: str, arguments: Any) -> ToolCall:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCall(name, arguments)
    return ToolCall(name, json.dumps(arguments, sort_keys=True, ensure_ascii=False))


@dataclass(frozen=True)
class Answer:
    """One archived `response` event, read."""

    status: int | None
    error: ErrorKind | None
    finish: Finish
    tool_calls: tuple[ToolCall, ...] = ()
    input_tokens: int | None = None  # all of the input, as the upstream's usage said
    cached_tokens: int | None = None
    output_tokens: int | None = None
    overhead_ms: float | None = None  # the time Recap added before forwarding


@dataclass(frozen=True)
class ArchivedRequest:
    """One request of a conversation: its request event and the answers to it (an overflow
    refused and retried is one request with two answers)."""

    request_id: str
    at: float
    classification: str  # history.messages.Classification's value
    cohort: Cohort | None
    # The new user message's text, for a turn start.
    user_text: str | None = None
    answers: tuple[Answer, ...] = ()
    # What its compactions cost in summarizer calls (every try of it).
    summarizer_input_tokens: int = 0
    summarizer_output_tokens: int = 0

    @property
    def answer(self) -> Answer | None:
        """The answer the client got (the last one)."""
        return self.answers[-1] if self.answers else None


def error_kind(status: int | None, error: Any) -> ErrorKind | None:
    """What went wrong with an answer: its status and its `error` (the upstream's error
    object, an in-stream error, or Recap's own code); None for an answer."""
    failed = status is None or status >= 400 or error not in (None, {}, "")
    if not failed:
        return None
    words = error if isinstance(error, str) else json.dumps(error, default=str)
    if status in (400, 413, None) and _OVERFLOW.search(words):
        return ErrorKind.CONTEXT_OVERFLOW
    if status == 429:
        return ErrorKind.RATE_LIMITED
    if status is not None and 400 <= status < 500:
        return ErrorKind.REFUSED
    return ErrorKind.SERVER


def finish_of(word: Any, tool_calls: Sequence[ToolCall], error: ErrorKind | None) -> Finish:
    if error is not None:
        return Finish.NONE
    if tool_calls:
        return Finish.TOOL_CALLS
    if word is None:
        return Finish.NONE
    return _FINISH_WORDS.get(str(word), Finish.OTHER)


def normalized(text: str) -> str:
    """Lower case, punctuation out, runs of white space as one space."""
    table = str.maketrans(string.punctuation, " " * len(string.punctuation))
    return " ".join(text.casefold().translate(table).split())


def nearly_equal(a: str, b: str) -> bool:
    """Two user messages are nearly equal when, normalized, difflib's ratio is at least
    REASK_RATIO (and the newer has REASK_MIN_WORDS words: "yes" twice is no re-ask)."""
    na, nb = normalized(a), normalized(b)
    if len(nb.split()) < REASK_MIN_WORDS:
        return False
    return na == nb or difflib.SequenceMatcher(None, na, nb).ratio() >= REASK_RATIO


class Measure(enum.Enum):
    """The measures, in the order reports show them. Each value: (label, unit)."""

    CONTEXT_OVERFLOWS = ("context overflows", "per conversation")
    UPSTREAM_ERRORS = ("upstream errors", "per conversation")
    INPUT_TOKENS = ("input tokens", "per conversation")
    INPUT_TOKENS_PER_TURN = ("input tokens", "per turn")
    CACHED_TOKENS = ("cached input tokens", "per conversation")
    CACHED_TOKENS_PER_TURN = ("cached input tokens", "per turn")
    SUMMARIZER_TOKENS = ("summarizer tokens", "per conversation")
    COST = ("cost", "per conversation")
    ADDED_LATENCY_MS = ("added latency (ms)", "per request")
    TURNS = ("turns", "per conversation")
    TOOL_CALLS = ("tool calls", "per conversation")
    REPEATED_TOOL_CALLS = ("repeated tool calls", "per conversation")
    REASKS = ("user re-asks", "per conversation")
    ABANDONED = ("abandoned mid-loop", "share of conversations")

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def unit(self) -> str:
        return self.value[1]

    @property
    def key(self) -> str:
        """Its name in JSON and in the metrics' `measure` label."""
        return self.name.lower()


@dataclass(frozen=True)
class ConversationMeasures:
    """One conversation's value of each measure (absent: not defined for it, e.g. a cost
    without prices, tokens the upstream never reported), and its answers' finish reasons
    and error kinds."""

    cohort: Cohort | None
    requests: int
    values: Mapping[Measure, float]
    finishes: Counter[Finish] = field(default_factory=Counter)
    errors: Counter[ErrorKind] = field(default_factory=Counter)


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def abandoned(requests: Sequence[ArchivedRequest]) -> bool:
    """The agent stopped inside a tool loop: the last archived request's answer asked for
    tool calls that no later request answered, or the last request carried tool results and
    got no answer (an error, or none archived)."""
    if not requests:
        return False
    last = requests[-1]
    answer = last.answer
    if answer is not None and answer.tool_calls and answer.error is None:
        return True
    no_answer = answer is None or answer.error is not None
    return last.classification == "tool_continuation" and no_answer


def reasks(texts: Sequence[str]) -> int:
    """User messages nearly equal to one of the REASK_WINDOW user messages before them."""
    return sum(
        any(nearly_equal(earlier, text) for earlier in texts[max(0, i - REASK_WINDOW) : i])
        for i, text in enumerate(texts)
    )


def repeated_calls(calls: Sequence[ToolCall]) -> int:
    """Tool calls with the name and arguments of an earlier call of the conversation."""
    seen: set[ToolCall] = set()
    repeated = 0
    for call in calls:
        repeated += call in seen
        seen.add(call)
    return repeated


def measure(requests: Sequence[ArchivedRequest], prices: Prices | None) -> ConversationMeasures:
    """One conversation's measures; `requests` in the order they arrived."""
    answers = [a for r in requests for a in r.answers]
    turns = sum(r.classification == "turn_start" for r in requests)
    calls = [c for a in answers if a.error is None for c in a.tool_calls]
    errors = Counter(a.error for a in answers if a.error is not None)
    values: dict[Measure, float] = {
        Measure.CONTEXT_OVERFLOWS: errors[ErrorKind.CONTEXT_OVERFLOW],
        Measure.UPSTREAM_ERRORS: sum(errors.values()),
        Measure.TURNS: turns,
        Measure.TOOL_CALLS: len(calls),
        Measure.REPEATED_TOOL_CALLS: repeated_calls(calls),
        Measure.REASKS: reasks([r.user_text for r in requests if r.user_text is not None]),
        Measure.ABANDONED: float(abandoned(requests)),
    }
    summarizer_in = sum(r.summarizer_input_tokens for r in requests)
    summarizer_out = sum(r.summarizer_output_tokens for r in requests)
    values[Measure.SUMMARIZER_TOKENS] = summarizer_in + summarizer_out
    input_tokens = _sum([a.input_tokens for a in answers])
    cached = _sum([a.cached_tokens for a in answers])
    if input_tokens is not None:
        values[Measure.INPUT_TOKENS] = input_tokens
        values[Measure.CACHED_TOKENS] = cached or 0
        if turns:
            values[Measure.INPUT_TOKENS_PER_TURN] = input_tokens / turns
            values[Measure.CACHED_TOKENS_PER_TURN] = (cached or 0) / turns
        if prices is not None:
            output = _sum([a.output_tokens for a in answers]) or 0
            # The summarizer's calls at the same prices, none of their input cached.
            values[Measure.COST] = prices.cost(
                input_tokens + summarizer_in, cached or 0, output + summarizer_out
            )
    last = [r.answer for r in requests if r.answer is not None]
    overheads = [a.overhead_ms for a in last if a.overhead_ms is not None]
    if overheads:
        values[Measure.ADDED_LATENCY_MS] = sum(overheads) / len(overheads)
    cohorts = {r.cohort for r in requests if r.cohort is not None}
    return ConversationMeasures(
        cohort=cohorts.pop() if len(cohorts) == 1 else None,
        requests=len(requests),
        values=values,
        finishes=Counter(r.answer.finish if r.answer else Finish.NONE for r in requests),
        errors=errors,
    )
