"""Per-request memo of message fingerprints and token counts.

Every stage needs a message's fingerprint (archive, chain hashes, the token cache)
and its token count (planners, trimming, the window fit, the logged estimate).
Computing them once per message per request keeps the proxy's added latency flat
as stages are added; the TokenCounter's own cache then makes a history seen on an
earlier request cost nothing to count again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from proxy.messages import Message, fingerprint
from proxy.tokens import REPLY_PRIMING_TOKENS, TokenCounter


class Measure:
    def __init__(self, counter: TokenCounter, model: str | None) -> None:
        self.counter = counter
        self.model = model
        # id(message) -> (message, value): the message is held so its id stays unique.
        self._fps: dict[int, tuple[Any, str]] = {}
        self._tokens: dict[int, tuple[Any, int]] = {}

    def seed(self, messages: Sequence[Message], fingerprints: Sequence[str]) -> None:
        """Fingerprints computed elsewhere (the incremental cache) for these messages."""
        for m, fp in zip(messages, fingerprints, strict=True):
            self._fps[id(m)] = (m, fp)

    def fingerprint(self, message: Message) -> str:
        hit = self._fps.get(id(message))
        if hit is not None:
            return hit[1]
        fp = fingerprint(message)
        self._fps[id(message)] = (message, fp)
        return fp

    def tokens(self, message: Message) -> int:
        hit = self._tokens.get(id(message))
        if hit is not None:
            return hit[1]
        try:
            fp: str | None = self.fingerprint(message)
        except (TypeError, ValueError, RecursionError):
            fp = None
        n = self.counter.count_message(message, self.model, fingerprint=fp)
        self._tokens[id(message)] = (message, n)
        return n

    def text(self, text: str) -> int:
        return self.counter.count_text(text, self.model)

    def total(self, messages: Iterable[Message]) -> int:
        """What a request's messages weigh, with the reply priming (as count_messages)."""
        return sum(self.tokens(m) for m in messages) + REPLY_PRIMING_TOKENS
