"""The last request each conversation forwarded, kept for a cache-riding summarizer call.

Beside the session stage. A session compaction on the request path (a turn start that must
compact now) may ride on the request the conversation forwarded before this one: the
provider cached it moments ago, and this history extends it. That request is kept here
after its answer (`Rider.remember`, stages/riding.py), only for tenants whose session scene
rides, and given back only to a request whose history holds its whole body, unchanged (the
chain hash of its last message matches): anything else (an edit, a fork, another replica's request)
finds nothing and the call goes as a transcript (`RidingFallback.NOT_FORWARDED`).

Bounded, since each entry holds a whole request body: at most `max_entries` conversations
and `max_bytes` of bodies, the least recently kept dropped first. Per process: a replica
knows only the requests it forwarded itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.planning.riding import Forwarded
from proxy.store.base import ConversationRef

MAX_ENTRIES = 512
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class _Kept:
    forwarded: Forwarded
    # The client's body it was made from: its length and the chain hash of its last message.
    length: int
    boundary: str


class LastForwarded:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._kept: dict[ConversationRef, _Kept] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, conv: ConversationRef, forwarded: Forwarded, chain: Sequence[str]) -> None:
        """Keep `forwarded`, made from a client body whose chain hashes are `chain`."""
        self.drop(conv)
        if not chain or len(forwarded.body) > self.max_bytes:
            return
        self._kept[conv] = _Kept(forwarded, len(chain), chain[-1])
        self._bytes += len(forwarded.body)
        while len(self._kept) > self.max_entries or self._bytes > self.max_bytes:
            self.drop(next(iter(self._kept)))

    def drop(self, conv: ConversationRef) -> None:
        old = self._kept.pop(conv, None)
        if old is not None:
            self._bytes -= len(old.forwarded.body)

    def get(self, conv: ConversationRef, chain: Sequence[str]) -> Forwarded | None:
        """The request kept for `conv` if this body (its chain hashes `chain`) holds the one
        it was made from, unchanged, as its prefix."""
        kept = self._kept.get(conv)
        if kept is None or len(chain) < kept.length or chain[kept.length - 1] != kept.boundary:
            return None
        return kept.forwarded
