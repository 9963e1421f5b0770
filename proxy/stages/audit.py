"""One audit row and one archive event per compaction attempt (seed 003, seed 002 §5.3).

Both are for operators; failing to write them must not undo a compaction that
succeeded, so store errors are logged here and go no further. Beside them, the log
line a stage writes when a summarizer call starts (`log_started`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from proxy.pipeline import Exchange
from proxy.planning.outcome import Layer
from proxy.store.base import CompactionRecord, ConversationRef, EventType, Store, StoreError

log = logging.getLogger("recap.audit")


EVENT_OF_LAYER: dict[Layer, EventType] = {
    Layer.SESSION: "session_compact",
    Layer.LOOP: "loop_compact",
    Layer.MANUAL: "manual_compact",
    Layer.TRIM: "trim",
}


async def audit(
    store: Store,
    conv: ConversationRef,
    record: CompactionRecord,
    details: Mapping[str, Any] | None = None,
    with_event: bool = True,
) -> None:
    """The audit row, and its archive event unless `with_event` is False (the trim layer's
    event, with the originals it replaced, is written with the request's)."""
    try:
        await store.record_compaction(conv, record)
        if not with_event or record.layer not in EVENT_OF_LAYER:
            return
        event = {
            "outcome": record.outcome,
            "reason": record.reason,
            "detail": record.detail,
            "tokens_before": record.tokens_before,
            "tokens_after": record.tokens_after,
            "model": record.model,
            "duration_ms": record.duration_ms,
            **(details or {}),
        }
        await store.append_event(conv, EVENT_OF_LAYER[record.layer], event)
    except StoreError as exc:
        log.warning("audit row not written (%s %s): %s", record.layer, record.outcome, exc)


def log_started(logger: logging.Logger, ex: Exchange, layer: Layer, trigger: str | None) -> None:
    """One line when a summarizer call starts: a long compaction is visible while it runs."""
    logger.info(
        "compaction started",
        extra={
            "fields": {
                "msg": "compaction started",
                "request_id": ex.request_id,
                "tenant": ex.tenant.name,
                "conversation": ex.conversation.key,
                "layer": layer,
                "trigger": trigger,
            }
        },
    )
