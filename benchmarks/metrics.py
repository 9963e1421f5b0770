"""Figures of a replay: tokens, the window, prompt-cache reuse, validity, fact retention. Pure.

Outside the data path: `benchmarks.replay` records, for every step of every session, what one
strategy sent upstream (`Step`); this module turns those records into figures. Definitions:

- tokens: Recap's own estimate (`proxy.history.tokens.TokenCounter`, the request's model:
  o200k_base), summed over the messages plus the reply priming, as `count_messages` does.
- overflow: a request whose input alone is over the context window.
- cached tokens: the tokens of the longest run of leading messages equal to the previous
  request's (what a provider's automatic prefix cache would reuse; partial messages and the
  previous answer are not counted, so it is slightly pessimistic). Hit rate = cached / sent,
  token-weighted. "Between compactions" leaves out the steps where the strategy called a
  summarizer and the first request of each conversation (a cold cache).
- rewrite: a request that does not start with the whole previous request (the prefix changed).
- invalid: `proxy.history.conversation.check_history` finds a problem (orphan result,
  unanswered call) in the chat form of what was sent, or (Responses) the upstream found its
  `input` invalid as OpenAI would (`Step.problems`: `tests.fake_responses.input_problems`).
- fact retention: a gold value is at risk at its step when the message where it first appears
  in the history is not among the sent messages (compaction removed or rewrote it); it is
  retained when the value still appears somewhere in what was sent at that step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.harness import percentile
from benchmarks.sessions import Fact, Session
from proxy.history.conversation import check_history
from proxy.history.messages import Message
from proxy.history.tokens import REPLY_PRIMING_TOKENS, TokenCounter


@dataclass
class Step:
    """One model call of a session as one strategy made it."""

    index: int  # the request is the recorded history messages[:index]
    sent: Sequence[Message]  # what the upstream received
    added_ms: float | None = None  # through a server: wall time minus the fake's own time
    compute_ms: float | None = None  # in-process strategies: the function's own time
    overhead_ms: float | None = None  # Recap's x-recap-overhead-ms (arrival to forwarding)
    summarizer_calls: int = 0
    summarizer_in: int = 0
    summarizer_out: int = 0
    # Of summarizer_in, what a prefix cache would serve (fakeup: leading messages of a
    # recent chat request), and how many of the calls were cache-riding ones.
    summarizer_cached: int = 0
    riding_calls: int = 0
    dropped: int = 0  # messages Recap's last-resort fit dropped (x-recap-dropped-messages)
    problems: Sequence[str] = ()  # what the upstream found wrong in the API's own body


@dataclass
class Run:
    """One session through one strategy."""

    session: Session
    steps: list[Step]


class Weigher:
    """Token counts with Recap's counter; the session's own message objects are memoised by
    identity (the in-process strategies send them as they are), others by fingerprint."""

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter
        self._by_id: dict[int, int] = {}
        self._model: str | None = None

    def remember(self, session: Session) -> None:
        """Memoise `session`'s messages; the session keeps them alive while it is weighed."""
        self._model = session.model
        self._by_id = {
            id(m): self.counter.count_message(m, session.model) for m in session.messages
        }

    def message(self, m: Message) -> int:
        found = self._by_id.get(id(m))
        return found if found is not None else self.counter.count_message(m, self._model)

    def request(self, messages: Sequence[Message]) -> int:
        return sum(self.message(m) for m in messages) + REPLY_PRIMING_TOKENS


def common_prefix(a: Sequence[Message], b: Sequence[Message]) -> int:
    """How many leading messages `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x is not y and x != y:
            break
        n += 1
    return n


@dataclass
class Retention:
    fact: Fact
    at_risk: bool
    retained: bool


def retention(session: Session, steps: Sequence[Step]) -> list[Retention]:
    """Each fact of the session, judged at its step (see the module docstring)."""
    by_index = {s.index: s for s in steps}
    texts: list[str] | None = None
    out: list[Retention] = []
    for fact in session.facts:
        step = by_index.get(fact.step)
        if step is None:
            continue
        if texts is None:
            texts = [json.dumps(m, ensure_ascii=False) for m in session.messages]
        first = next((j for j in range(fact.step) if fact.value in texts[j]), None)
        if first is None:
            continue  # never in the history: nothing a compaction could lose
        original = session.messages[first]
        at_risk = not any(m is original or m == original for m in step.sent)
        kept = not at_risk or fact.value in json.dumps(step.sent, ensure_ascii=False)
        out.append(Retention(fact, at_risk, kept))
    return out


@dataclass
class Figures:
    """One strategy over one input set."""

    strategy: str
    sessions: int = 0
    steps: int = 0
    upstream_tokens: int = 0
    summarizer_in: int = 0
    summarizer_out: int = 0
    max_request: int = 0
    window: int = 0
    overflows: int = 0
    compaction_steps: int = 0
    summarizer_calls: int = 0
    rewrites: int = 0
    drop_steps: int = 0
    cached_tokens: int = 0
    between_tokens: int = 0
    between_cached: int = 0
    invalid: int = 0
    invalid_examples: list[str] = field(default_factory=list)
    facts_checked: int = 0
    facts_at_risk: int = 0
    facts_retained: int = 0
    facts_lost: list[str] = field(default_factory=list)
    added_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    overhead_ms: list[float] = field(default_factory=list)

    @property
    def net_tokens(self) -> int:
        return self.upstream_tokens + self.summarizer_in + self.summarizer_out

    def per100(self, n: int) -> float:
        return 100 * n / self.steps if self.steps else 0.0

    @property
    def cache_hit(self) -> float:
        return self.cached_tokens / self.upstream_tokens if self.upstream_tokens else 0.0

    @property
    def cache_hit_between(self) -> float:
        return self.between_cached / self.between_tokens if self.between_tokens else 0.0

    @property
    def retention(self) -> float | None:
        return self.facts_retained / self.facts_at_risk if self.facts_at_risk else None

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("added_ms", "compute_ms", "overhead_ms"):
            values = out.pop(key)
            out[key] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
            out[key] = {k: None if math.isnan(v) else round(v, 3) for k, v in out[key].items()}
        out.update(
            net_tokens=self.net_tokens,
            cache_hit=round(self.cache_hit, 4),
            cache_hit_between_compactions=round(self.cache_hit_between, 4),
            retention=self.retention,
        )
        return out


def add_run(fig: Figures, run: Run, window: int, weigh: Weigher) -> list[int]:
    """Fold one session's steps into `fig`; returns the tokens sent at each step."""
    weigh.remember(run.session)
    fig.sessions += 1
    fig.window = window
    tokens: list[int] = []
    previous: Sequence[Message] = []
    for n, step in enumerate(run.steps):
        sent = weigh.request(step.sent)
        tokens.append(sent)
        shared = common_prefix(previous, step.sent) if n else 0
        cached = sum(weigh.message(m) for m in step.sent[:shared])
        fig.steps += 1
        fig.upstream_tokens += sent
        fig.cached_tokens += cached
        if n and not step.summarizer_calls:
            fig.between_tokens += sent
            fig.between_cached += cached
        if n and shared < len(previous):
            fig.rewrites += 1
        fig.max_request = max(fig.max_request, sent)
        fig.overflows += sent > window
        fig.summarizer_calls += step.summarizer_calls
        fig.compaction_steps += step.summarizer_calls > 0
        fig.summarizer_in += step.summarizer_in
        fig.summarizer_out += step.summarizer_out
        fig.drop_steps += step.dropped > 0
        problems = [*step.problems, *check_history(step.sent)]
        if problems:
            fig.invalid += 1
            if len(fig.invalid_examples) < 5:
                fig.invalid_examples.append(f"{run.session.id} step {step.index}: {problems[0]}")
        for value, target in (
            (step.added_ms, fig.added_ms),
            (step.compute_ms, fig.compute_ms),
            (step.overhead_ms, fig.overhead_ms),
        ):
            if value is not None:
                target.append(value)
        previous = step.sent
    for r in retention(run.session, run.steps):
        fig.facts_checked += 1
        fig.facts_at_risk += r.at_risk
        fig.facts_retained += r.at_risk and r.retained
        if r.at_risk and not r.retained and len(fig.facts_lost) < 20:
            fig.facts_lost.append(f"{r.fact.source}: {r.fact.action} {r.fact.value}")
    return tokens
