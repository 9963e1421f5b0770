"""One audit row per compaction attempt (seed 003): written best-effort.

The row is for operators; failing to write it must not undo a compaction that
succeeded, so store errors are logged here and go no further.
"""

from __future__ import annotations

import logging

from proxy.store.base import CompactionRecord, ConversationRef, Store, StoreError

log = logging.getLogger("recap.audit")


async def audit(store: Store, conv: ConversationRef, record: CompactionRecord) -> None:
    try:
        await store.record_compaction(conv, record)
    except StoreError as exc:
        log.warning("audit row not written (%s %s): %s", record.layer, record.outcome, exc)
