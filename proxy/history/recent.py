"""A map of recently used entries, bounded by idle time and by total weight.

The proxy's per-conversation memory (fingerprints of the last request, what the archive
holds) must be bounded by what is in use, not by what was served: an entry not used for
`idle_s` is forgotten, and beyond `max_weight` in all (bytes, fingerprints: the owner
says what an entry weighs) the least recently used go first, though never the last one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentlyUsed(Generic[K, V]):
    def __init__(
        self, max_weight: int, idle_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_weight = max_weight
        self.idle_s = idle_s
        self._clock = clock
        self._weight = 0
        # key -> (value, weight, last used), least recently used first
        self._entries: OrderedDict[K, tuple[V, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def weight(self) -> int:
        return self._weight

    def get(self, key: K) -> V | None:
        """The value, now most recently used; None if absent or forgotten."""
        now = self._forget_idle()
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries[key] = (entry[0], entry[1], now)
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, weight: int) -> None:
        """Set (or replace) an entry, most recently used, and keep within `max_weight`."""
        now = self._forget_idle()
        self.pop(key)
        self._entries[key] = (value, weight, now)
        self._weight += weight
        while self._weight > self.max_weight and len(self._entries) > 1:
            _, (_, dropped, _) = self._entries.popitem(last=False)
            self._weight -= dropped

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._weight -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self._weight = 0

    def _forget_idle(self) -> float:
        now = self._clock()
        while self._entries:
            key, (_, weight, used) = next(iter(self._entries.items()))
            if now - used <= self.idle_s:
                break
            del self._entries[key]
            self._weight -= weight
        return now
