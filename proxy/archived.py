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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Set

from proxy.store.base import ConversationRef


class _Known:
    __slots__ = ("fingerprints", "since", "used")

    def __init__(self, now: float) -> None:
        self.fingerprints: set[str] = set()
        self.since = now
        self.used = now


class ArchivedIndex:
    def __init__(
        self,
        max_entries: int = 200_000,
        idle_s: float = 300.0,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.idle_s = idle_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._held = 0
        # In order of use: the quiet conversations are at the front.
        self._convs: OrderedDict[ConversationRef, _Known] = OrderedDict()

    def __len__(self) -> int:
        """Fingerprints held, over all conversations."""
        return self._held

    def known(self, conv: ConversationRef) -> Set[str]:
        """The fingerprints of `conv` known to be on disk (a live view: do not keep it)."""
        entry = self._use(conv, create=False)
        return entry.fingerprints if entry is not None else frozenset()

    def learn(self, conv: ConversationRef, fingerprints: Iterable[str]) -> None:
        entry = self._use(conv, create=True)
        assert entry is not None
        before = len(entry.fingerprints)
        entry.fingerprints.update(fingerprints)
        self._held += len(entry.fingerprints) - before
        while self._held > self.max_entries and len(self._convs) > 1:
            _, dropped = self._convs.popitem(last=False)
            self._held -= len(dropped.fingerprints)

    def clear(self) -> None:
        self._convs.clear()
        self._held = 0

    def _use(self, conv: ConversationRef, *, create: bool) -> _Known | None:
        now = self._clock()
        while self._convs:
            quiet = next(iter(self._convs.values()))
            if now - quiet.used <= self.idle_s:
                break
            self._drop(next(iter(self._convs)))
        entry = self._convs.get(conv)
        if entry is not None and now - entry.since > self.ttl_s:
            self._drop(conv)
            entry = None
        if entry is None:
            if not create:
                return None
            entry = self._convs[conv] = _Known(now)
        entry.used = now
        self._convs.move_to_end(conv)
        return entry

    def _drop(self, conv: ConversationRef) -> None:
        self._held -= len(self._convs.pop(conv).fingerprints)
