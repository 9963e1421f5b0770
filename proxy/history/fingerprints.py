"""Fingerprints and chain hashes of a conversation's history, computed incrementally.

Clients re-send the whole history on every request, so the proxy sees the same
messages again and again. Hashing a message costs a canonical JSON dump and a
sha256 (about 5 µs); comparing it with the message at the same position of the
conversation's previous request costs a C-level dict comparison (about 0.1 µs).
This cache keeps each conversation's previous messages with their fingerprints,
chain hashes and token counts, and only hashes (and counts) what changed, so a
long history costs little more than a short one. Equal dicts have equal identity
fields, so reuse is exact.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.history.conversation_ref import ConversationRef
from proxy.history.messages import Message, chain_of, fingerprint, split_pinned
from proxy.history.recent import RecentlyUsed

# What a held message costs at least, whatever its JSON length (dict and str overhead).
PER_MESSAGE_BYTES = 256


@dataclass(frozen=True)
class Identity:
    fingerprints: list[str]
    # How many leading messages are pinned (system/developer; not in the chain).
    pinned: int
    # chain[i] identifies body[: i + 1], where body = messages[pinned:].
    chain: list[str]
    # Token counts of the leading messages, as counted for `model` last time (None:
    # not counted then); shorter than the messages where the history changed.
    counts: list[int | None]
    model: str | None


class FingerprintCache:
    """Each conversation's last request (its messages, as parsed) with their identity.

    Bounded by what it holds, not by what was served: a conversation not heard from for
    `idle_s` is forgotten, and beyond `max_bytes` of held requests the least recently
    used go first. Forgetting costs one re-hash of a history if that conversation comes
    back (about 5 µs a message).
    """

    def __init__(
        self,
        max_bytes: int = 256 << 20,
        idle_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # conv -> (messages, identity, bytes they weigh), weighed in bytes
        self._recent: RecentlyUsed[ConversationRef, tuple[Sequence[Message], Identity, int]] = (
            RecentlyUsed(max_bytes, idle_s, clock)
        )

    def __len__(self) -> int:
        return len(self._recent)

    @property
    def held_bytes(self) -> int:
        return self._recent.weight

    def identity(
        self,
        conv: ConversationRef,
        messages: Sequence[Message],
        model: str | None,
        size: int = 0,
        hash_message: Callable[[Message], str] = fingerprint,
    ) -> Identity:
        """The identity of `messages`, reusing the previous request's where they agree.

        `size` is the request body's length, the measure of what keeping it costs
        (at least `PER_MESSAGE_BYTES` a message, for small messages' object overhead).
        `hash_message`: the request's memo of fingerprints, which a large request fills in a
        worker thread before this runs (proxy.stages.offload).
        """
        previous = self._recent.pop(conv)
        old_messages: Sequence[Message] = previous[0] if previous else []
        old = previous[1] if previous else None
        same = _same_prefix(messages, old_messages)
        fps = (old.fingerprints[:same] if old else []) + [hash_message(m) for m in messages[same:]]
        pinned = len(split_pinned(messages)[0])
        chain: list[str] = []
        if old is not None and old.pinned == pinned and same > pinned:
            chain = old.chain[: same - pinned]
        chain += chain_of(fps[pinned + len(chain) :], after=chain[-1] if chain else "")
        counts = old.counts[:same] if old is not None and old.model == model else []
        ident = Identity(fps, pinned, chain, counts, model)
        # The request's own list is kept (not copied): nothing mutates a client's messages.
        weight = max(size, PER_MESSAGE_BYTES * len(messages))
        self._recent.put(conv, (messages, ident, weight), weight)
        return ident

    def remember_counts(
        self, conv: ConversationRef, messages: Sequence[Message], counts: list[int | None]
    ) -> None:
        """Token counts made during the request, for the next request to reuse."""
        entry = self._recent.get(conv)
        if entry is not None and entry[0] is messages:
            ident = dataclasses.replace(entry[1], counts=counts)
            self._recent.put(conv, (messages, ident, entry[2]), entry[2])


def _same_prefix(messages: Sequence[Message], old: Sequence[Message]) -> int:
    """The length of the prefix `messages` share with `old`."""
    same, limit = 0, min(len(messages), len(old))
    while same < limit and messages[same] == old[same]:
        same += 1
    return same
