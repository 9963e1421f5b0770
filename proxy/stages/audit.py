"""One audit row and one archive event per compaction attempt (seed 003, seed 002 §5.3).

Both are for operators; failing to write them must not undo a compaction that
succeeded, so store errors are logged here and go no further. Nor do they hold the
request: where the app gave the store an `AuditWriter` (its lifespan does), `audit`
queues them and returns, and the writer stores them in the background, in order per
conversation, while the request is forwarded; the lifespan drains it at shutdown.
Beside them, the log line a stage writes when a summarizer call starts (`log_started`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
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


# Audits queued and not yet written, across conversations, past which a new one is
# dropped (logged and counted): a store that takes no writes for a long while must not
# make the proxy hold every row of every request in memory.
MAX_PENDING = 10_000


class AuditWriter:
    """Audit rows and their events, written off the request path (one per app, owned by
    `AppState`). Each conversation's writes run in the order they were queued, one after
    another; conversations do not wait for each other. A write that fails is logged and
    counted (`failed`), never raised. When `max_pending` writes are queued a new one is
    dropped (logged, counted in `dropped`) rather than written inline: the point is that
    a slow store never holds a forward, and a store that slow has lost the row anyway."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self.dropped = 0
        self.failed = 0
        self.written = 0
        self.draining = False  # shutdown has begun (`drain`)
        # The last queued write of each conversation: the next one waits for it.
        self._last: dict[ConversationRef, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def put(self, conv: ConversationRef, write: Callable[[], Awaitable[None]], what: str) -> None:
        if len(self._tasks) >= self.max_pending:
            self.dropped += 1
            log.warning(
                "audit queue full (%d pending), %s not written (%d dropped so far)",
                len(self._tasks),
                what,
                self.dropped,
            )
            return
        task = asyncio.get_running_loop().create_task(
            self._run(self._last.get(conv), write, what), name="recap-audit"
        )
        self._last[conv] = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(conv, t))

    def _done(self, conv: ConversationRef, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._last.get(conv) is task:
            del self._last[conv]

    async def _run(
        self, after: asyncio.Task[None] | None, write: Callable[[], Awaitable[None]], what: str
    ) -> None:
        if after is not None:
            await asyncio.wait([after])  # its outcome is its own: it never raises
        try:
            await write()
            self.written += 1
        except StoreError as exc:
            self.failed += 1
            log.warning("%s not written: %s", what, exc)
        except Exception:  # a background task: nothing above it would see the error
            self.failed += 1
            log.exception("%s not written", what)

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait (bounded) for the writes queued so far (operator reads: `Archiver.flush`)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait (bounded) for every queued write: at shutdown, before the store closes."""
        self.draining = True
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        if self._tasks:
            log.warning("%d audit rows not written at shutdown", len(self._tasks))
            for task in list(self._tasks):
                task.cancel()


async def audit(
    store: Store,
    conv: ConversationRef,
    record: CompactionRecord,
    details: Mapping[str, Any] | None = None,
    with_event: bool = True,
) -> None:
    """The audit row, and its archive event unless `with_event` is False (the trim layer's
    event, with the originals it replaced, is written with the request's). Queued on the
    store's `audits` writer when it has one (then this returns at once), else written now."""
    event: dict[str, Any] | None = None
    if with_event and record.layer in EVENT_OF_LAYER:
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

    async def write() -> None:
        await store.record_compaction(conv, record)
        if event is not None:
            await store.append_event(conv, EVENT_OF_LAYER[record.layer], event)

    what = f"audit row ({record.layer} {record.outcome})"
    if store.audits is not None:
        store.audits.put(conv, write, what)
        return
    try:
        await write()
    except StoreError as exc:
        log.warning("%s not written: %s", what, exc)


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
