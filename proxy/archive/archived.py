"""What the archive is known to hold, per conversation, for the conversations in use.

Clients re-send their whole history and most of it is on disk already: knowing which
fingerprints were written lets a request archive only its new messages. The knowledge
is held per conversation and bounded by what is in use, not by what was served: a
conversation not heard from for `idle_s` is forgotten, knowledge older than `ttl_s` is
dropped (a prune by another process, the CLI, must not leave a resumed conversation
unarchived), and beyond `max_entries` fingerprints in all the least recently used
conversations go first. Forgetting costs one rewrite of that history when it comes
back; the store ignores the rows it already has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Set

from proxy.history.recent import RecentlyUsed
from proxy.store.base import ConversationRef


class _Known:
    __slots__ = ("fingerprints", "since")

    def __init__(self, since: float) -> None:
        self.fingerprints: set[str] = set()
        self.since = since


class ArchivedIndex:
    def __init__(
        self,
        max_entries: int = 200_000,
        idle_s: float = 300.0,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        # Weighed by fingerprints held.
        self._convs: RecentlyUsed[ConversationRef, _Known] = RecentlyUsed(
            max_entries, idle_s, clock
        )

    def __len__(self) -> int:
        """Fingerprints held, over all conversations."""
        return self._convs.weight

    def known(self, conv: ConversationRef) -> Set[str]:
        """The fingerprints of `conv` known to be on disk (a live view: do not keep it)."""
        entry = self._current(conv)
        return entry.fingerprints if entry is not None else frozenset()

    def learn(self, conv: ConversationRef, fingerprints: Iterable[str]) -> None:
        entry = self._current(conv) or _Known(self._clock())
        entry.fingerprints.update(fingerprints)
        self._convs.put(conv, entry, len(entry.fingerprints))

    def clear(self) -> None:
        self._convs.clear()

    def _current(self, conv: ConversationRef) -> _Known | None:
        entry = self._convs.get(conv)
        if entry is not None and self._clock() - entry.since > self.ttl_s:
            self._convs.pop(conv)
            return None
        return entry
