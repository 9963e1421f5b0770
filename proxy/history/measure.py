"""Per-request memo of message fingerprints and token counts.

Every stage needs a message's fingerprint (archive, chain hashes, the token cache)
and its token count (planners, trimming, the window fit, the logged estimate).
Computing them once per message per request keeps the proxy's added latency flat
as stages are added; the TokenCounter's own cache then makes a history seen on an
earlier request cost nothing to count again.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from proxy.history import attachments
from proxy.history.messages import Message, fingerprint
from proxy.history.tokens import MESSAGE_FIELDS, REPLY_PRIMING_TOKENS, TokenCounter


class Measure:
    def __init__(self, counter: TokenCounter, model: str | None) -> None:
        self.counter = counter
        self.model = model
        # id(message) -> (message, value): the message is held so its id stays unique.
        self._fps: dict[int, tuple[Any, str]] = {}
        self._tokens: dict[int, tuple[Any, int]] = {}
        self._bounds: dict[int, tuple[Any, int]] = {}
        # The request's history and a bound of its tokens from the body's size (`bound_by`).
        self._request: tuple[Sequence[Message], int] | None = None
        # Called once, before the first fingerprint or count is made: the archive stage's
        # hook that seeds what the fingerprint cache knows (`seed`), so nothing is
        # hashed or counted twice; left unset when nothing may be needed (`at_most`).
        self.seeder: Callable[[], object] | None = None

    def seed(
        self,
        messages: Sequence[Message],
        fingerprints: Sequence[str] = (),
        counts: Sequence[int | None] = (),
    ) -> None:
        """Fingerprints (all or none) and token counts (of the leading messages) known
        already for these messages."""
        if fingerprints:
            for m, fp in zip(messages, fingerprints, strict=True):
                self._fps[id(m)] = (m, fp)
        for m, n in zip(messages, counts, strict=False):
            if n is not None:
                self._tokens[id(m)] = (m, n)

    def counted(self, messages: Sequence[Message]) -> list[int | None]:
        """The counts made so far for these messages (None where none was)."""
        return [hit[1] if (hit := self._tokens.get(id(m))) else None for m in messages]

    def _seed_now(self) -> None:
        seeder, self.seeder = self.seeder, None
        if seeder is not None:
            # A message that cannot be hashed is counted without its fingerprint.
            with contextlib.suppress(TypeError, ValueError, RecursionError):
                seeder()

    def fingerprint(self, message: Message) -> str:
        hit = self._fps.get(id(message))
        if hit is None and self.seeder is not None:
            self._seed_now()
            hit = self._fps.get(id(message))
        if hit is not None:
            return hit[1]
        fp = fingerprint(message)
        self._fps[id(message)] = (message, fp)
        return fp

    def tokens(self, message: Message) -> int:
        hit = self._tokens.get(id(message))
        if hit is None and self.seeder is not None:
            self._seed_now()
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

    def bound_by(self, messages: Sequence[Message], body_bytes: int) -> None:
        """Bound the tokens of `messages`, the history parsed from a JSON body of
        `body_bytes`, by that size (`at_most` of this very list then looks at nothing).

        A token is at least one byte of the text it stands for, and every text a message
        is counted by is in the body: a string as written there (escaped, so no shorter),
        anything else as the JSON the counter writes, with spaces (at most twice its
        compact length). Attachments weigh what the provider bills, which their size does
        not bound: a history with one gets no such bound."""
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(attachments.is_attachment(p) for p in content):
                return
        bound = 2 * body_bytes + _FRAMING * len(messages) + REPLY_PRIMING_TOKENS
        self._request = (messages, bound)

    def at_most(self, messages: Iterable[Message]) -> int:
        """An upper bound of `total` that tokenizes nothing: for the request's own history
        its body's (`bound_by`); otherwise exact for messages counted before, and for new
        ones their UTF-8 size bound (a token is at least one byte, a character at most
        four), so a request far below a trigger costs no tokenizing."""
        if self._request is not None and messages is self._request[0]:
            return self._request[1]
        bound = REPLY_PRIMING_TOKENS
        for m in messages:
            known = self._tokens.get(id(m)) or self._bounds.get(id(m))
            if known is None:
                hit = self._fps.get(id(m))
                cached = self.counter.peek(self.model, hit[1]) if hit else None
                known = self._bounds[id(m)] = (m, cached if cached is not None else _size_bound(m))
            bound += known[1]
        return bound

    def text(self, text: str) -> int:
        return self.counter.count_text(text, self.model)

    def total(self, messages: Iterable[Message]) -> int:
        """What a request's messages weigh, with the reply priming (as count_messages)."""
        return sum(self.tokens(m) for m in messages) + REPLY_PRIMING_TOKENS


# Per-message and per-call framing tokens, generously (tokens.py counts 3 and 3).
_FRAMING = 16


def _size_bound(message: Message) -> int:
    """Tokens <= UTF-8 bytes of what `tokens.message_tokens` counts, plus framing: a token
    is at least one byte, so an ASCII text bounds by its length, any other by 4 x.

    Only the fields it reads weigh (a dialect's own keys, such as the Responses items a
    message stands for, are not counted, so they bound nothing). Attachments (images,
    audio, files) weigh what the provider bills, which their size does not bound, so a
    message with one, or any odd shape, is far over any trigger's bound: it is simply
    counted.
    """
    size = 0  # in bytes of UTF-8, at most
    for key in MESSAGE_FIELDS:
        value = message.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            size += _utf8_bound(value) + len(key)
        elif key in ("tool_calls", "function_call") and isinstance(value, list | dict):
            size += len(json.dumps(value))  # ASCII: json escapes the rest
        elif key == "content" and isinstance(value, list):
            for part in value:
                if attachments.is_attachment(part):
                    return 1 << 40
                # A text part counts its text, anything else its JSON: both within this.
                size += len(json.dumps(part))
        else:
            return 1 << 40
    return size + _FRAMING


def _utf8_bound(text: str) -> int:
    return len(text) if text.isascii() else 4 * len(text)
