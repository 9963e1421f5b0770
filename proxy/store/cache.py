"""An in-process cache of which summary versions a conversation has.

`matching_summary` is asked on every chat request; for the embedded SQLite store,
whose only writer in normal operation is this process, the answer is kept in memory
and dropped on every write that changes it (a new version, a rollback, a prune).
Entries also expire after `ttl_s`, so a change made by another process on the same
file (the `recap` CLI) takes effect within that time; expired entries are dropped as
new ones come, so ended conversations do not stay until `max_entries`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from proxy.store.base import ConversationRef, SummaryVersion

Candidates = Sequence[tuple[int, int, str]]


class SummaryCache:
    def __init__(
        self,
        ttl_s: float = 2.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # conv -> (expires at, (version, covered, boundary_hash) candidates, current version)
        self._entries: OrderedDict[
            ConversationRef, tuple[float, Candidates, SummaryVersion | None]
        ] = OrderedDict()

    def get(self, conv: ConversationRef) -> tuple[Candidates, SummaryVersion | None] | None:
        entry = self._entries.get(conv)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[conv]
            return None
        return entry[1], entry[2]

    def put(
        self, conv: ConversationRef, candidates: Candidates, current: SummaryVersion | None
    ) -> None:
        now = self._clock()
        # Entries are in the order they were put, so in the order they expire.
        while self._entries and next(iter(self._entries.values()))[0] <= now:
            self._entries.popitem(last=False)
        self._entries.pop(conv, None)
        self._entries[conv] = (now + self.ttl_s, tuple(candidates), current)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def drop(self, conv: ConversationRef) -> None:
        self._entries.pop(conv, None)

    def clear(self) -> None:
        self._entries.clear()
