"""Retention of the archive: delete whole conversations idle for `archive.retention_days`.

Off the data path: a background task of the server (started in the app's lifespan
when retention_days > 0, every `archive.prune_interval_s`) and `recap prune`. The
store deletes a conversation with its messages, events, summaries and audit rows in
one transaction, never half of one, and re-checks inside it that the conversation is
still idle, so a request that just touched it keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from proxy.archive.archiver import Archiver
from proxy.config import Archive
from proxy.store.base import Store, StoreError

log = logging.getLogger("recap.retention")

DAY_S = 86400.0


def cutoff(retention_days: float, now: float) -> float | None:
    """Conversations not updated since this time are pruned; None keeps everything."""
    return None if retention_days <= 0 else now - retention_days * DAY_S


async def prune(
    store: Store,
    retention_days: float,
    *,
    archiver: Archiver | None = None,
    clock: Callable[[], float] = time.time,
) -> int:
    """Prune once; returns how many conversations were deleted."""
    older_than = cutoff(retention_days, clock())
    if older_than is None:
        return 0
    pruned = await store.prune(older_than)
    if pruned and archiver is not None:
        # The archiver remembers which messages are on disk; the pruned ones are not any
        # more, and it cannot tell which conversations went, so it forgets everything
        # (the next request of each conversation re-checks against the store).
        archiver.clear()
    if pruned:
        log.info("pruned %d conversation(s) idle for over %g day(s)", pruned, retention_days)
    return pruned


class Retention:
    """The server's periodic prune: once at start-up, then every prune_interval_s."""

    def __init__(self, store: Store, archiver: Archiver, policy: Archive) -> None:
        self.store = store
        self.archiver = archiver
        self.policy = policy

    async def run(self) -> None:
        while True:
            try:
                await prune(self.store, self.policy.retention_days, archiver=self.archiver)
            except StoreError as exc:
                log.warning("prune failed, will retry: %s", exc)
            await asyncio.sleep(self.policy.prune_interval_s)
