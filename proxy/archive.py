"""The lossless archive on the data path: originals before any compaction, events after.

    archive stage (first)   fingerprints every message the client sent and notes the
                            ones the archive lacks; nothing is written yet
    a compacting stage      calls `exchange.ensure_archived()` first: the originals
                            are written before any summary, placeholder or drop that
                            replaces them, and if that write fails the stage does not
                            compact (seed 002 §5.5)
    as it goes upstream     `begin`: queued for the background writer: the originals still
                            unwritten, the synthetic messages sent (summaries,
                            placeholders), the request's other fields (model, tools,
                            sampling, ...: `request_params`, each distinct set once), and
                            the `request` and `trim` events; the writer puts everything
                            queued into one transaction, while the upstream answers; the
                            answer's final bytes wait for it
    after the response      `finish`: the `response` event, queued without waking the
                            writer: it goes with the next request's record (one
                            transaction for both), or after `RESPONSE_LINGER_S` when no
                            request comes

So a request that compacts nothing costs no write before it goes upstream, an
answered request is on disk before its client has the whole answer, and under
load many requests share one write. Event
payloads reference messages by fingerprint; the messages table holds each distinct
message of a conversation once. Background writes never fail a request: they are
logged, and `drain` waits for them at shutdown. While the store is unavailable the
queued records are kept and retried (up to `max_queued_bytes`, oldest dropped first),
so the requests served during a store fault are archived once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from proxy import longjson
from proxy.archived import ArchivedIndex
from proxy.fingerprints import FingerprintCache
from proxy.messages import Message
from proxy.offload import off_loop
from proxy.pipeline import Exchange, History
from proxy.stages.estimate import count_for_log
from proxy.store.base import ConversationRef, EventType, ExchangeRecord, Store, StoreError

log = logging.getLogger("recap.archive")

# How long a response event may wait for the next request's record to share its write.
# A process killed in that window loses the event, never a request or a message: the
# answer's text comes back as a message of the client's next request.
RESPONSE_LINGER_S = 0.25


def message_json(message: Message) -> str:
    return longjson.dumps(message, ensure_ascii=False, separators=(",", ":"))


def request_params(body: Mapping[str, Any]) -> tuple[str, str]:
    """(fingerprint, JSON) of a request's fields other than its messages: model, tools,
    sampling, response_format, ... With the messages, they rebuild the request as sent:
    `{**params, "messages": [...]}`.

    One dump serves as both the stored text and what is hashed (in the client's key
    order, which a client keeps from request to request: a reordering only stores the
    same fields once more). The hash has its own prefix, so it never equals a message's
    fingerprint in the archived index.
    """
    text = message_json({k: v for k, v in body.items() if k != "messages"})
    digest = hashlib.sha256(b"recap-params\n" + text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest(), text


class Archiver:
    def __init__(self, store: Store, known: ArchivedIndex | None = None) -> None:
        self.store = store
        # What is known to be on disk: most of a re-sent history is, so most requests
        # archive one or two messages, not all of them.
        self._known = known if known is not None else ArchivedIndex()
        self._tasks: set[asyncio.Task[None]] = set()
        self._queue: list[ExchangeRecord] = []
        # One per queued record: resolved when it is written (or the store failed).
        self._waiters: list[asyncio.Future[bool]] = []
        self._wake = asyncio.Event()
        self._linger: asyncio.TimerHandle | None = None
        self.linger_s = RESPONSE_LINGER_S
        self._writer: asyncio.Task[None] | None = None
        self.max_batch = 256
        # Kept while the store is down; each record weighs its messages' JSON.
        self.max_queued_bytes = 64 * 1024 * 1024
        self.retry_s = 1.0
        self._failing = False

    def missing(
        self, conv: ConversationRef, fps: Sequence[str], messages: Sequence[Message]
    ) -> list[tuple[str, str]]:
        """(fingerprint, json) of the messages not known to be archived, each once."""
        known = self._known.known(conv)
        rows: dict[str, str] = {}
        for fp, m in zip(fps, messages, strict=True):
            if fp not in known and fp not in rows:
                rows[fp] = message_json(m)
        return list(rows.items())

    def _remember(self, conv: ConversationRef, rows: Sequence[tuple[str, str]]) -> None:
        self._known.learn(conv, (fp for fp, _ in rows))

    async def write(self, conv: ConversationRef, rows: Sequence[tuple[str, str]]) -> None:
        if rows:
            await self.store.archive_messages(conv, rows)
            self._remember(conv, rows)

    def clear(self) -> None:
        """Forget what is known to be on disk (after a prune deleted conversations)."""
        self._known.clear()

    def event(self, conv: ConversationRef, type: EventType, payload: Mapping[str, Any]) -> None:
        self.background(self.store.append_event(conv, type, payload), f"{type} event")

    def begin(self, ex: Exchange) -> asyncio.Future[bool]:
        """As the request goes upstream: the originals, what was sent, and the request event.

        Queued for the writer at once, so the commit runs while the upstream answers;
        the future resolves when it is on disk (True) or when the store failed to take
        it (False: the record stays queued for retry, the request is not held up).
        chat.py holds back the final bytes of the answer until it resolves, so an
        answered request is durable even if the process is killed right after.
        """
        count_for_log(ex)  # tokens_after; mostly seeded counts, so cheap
        conv = ex.conversation
        session, trim = ex.outcome("session"), ex.outcome("trim")
        rows = list(ex.unarchived)
        sent = [ex.measure.fingerprint(m) for m in ex.messages] if ex.changed else ex.fingerprints
        if ex.changed:
            rows += self.missing(conv, sent, ex.messages)
        params_fp, params_json = request_params(ex.params)
        params = [] if params_fp in self._known.known(conv) else [(params_fp, params_json)]
        events: list[tuple[EventType, Mapping[str, Any]]] = [
            (
                "request",
                {
                    "request_id": ex.request_id,
                    "classification": ex.classification.value,
                    "model": ex.model,
                    "stream": ex.stream,
                    "messages": ex.fingerprints,
                    # the request's other fields, archived once (`request_params`)
                    "params": params_fp,
                    # null: sent exactly as the client sent it (no second copy of the list)
                    "sent": sent if ex.changed else None,
                    "layers": ex.layers,
                    # What each layer did (the log line's `compactions`), from the
                    # typed outcomes; the session summary now applied, if any.
                    "compactions": [o.as_log() for o in ex.outcomes],
                    "summary_version": session.version if session else None,
                    # Counts are memoised per message: the estimate stage made them.
                    "tokens_before": ex.measure.total(ex.original) if ex.changed else None,
                    "tokens_after": ex.measure.total(ex.messages),
                },
            )
        ]
        if ex.trimmed:
            events.append(
                (
                    "trim",
                    {
                        "request_id": ex.request_id,
                        "trimmed": len(ex.trimmed),
                        "saved_chars": trim.saved_chars if trim else None,
                        "originals": ex.trimmed,
                    },
                )
            )
        return self._enqueue(ExchangeRecord(conv, rows, events, params))

    def finish(self, ex: Exchange, answer: Mapping[str, Any] | None) -> None:
        """After the response: its event (the request's was queued by `begin`)."""
        if answer is not None:
            event: tuple[EventType, Mapping[str, Any]] = (
                "response",
                {"request_id": ex.request_id, **answer},
            )
            self._enqueue(ExchangeRecord(ex.conversation, [], [event]), urgent=False)

    def _enqueue(self, record: ExchangeRecord, *, urgent: bool = True) -> asyncio.Future[bool]:
        """Queue a record; `urgent` ones (someone waits for them) wake the writer now,
        the others by `linger_s` at the latest."""
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[bool] = loop.create_future()
        if self._failing:
            # The store is known to be down: keep the record to retry, hold no one up.
            committed.set_result(False)
        self._queue.append(record)
        self._waiters.append(committed)
        if urgent:
            self._wake.set()
        elif self._linger is None:
            self._linger = loop.call_later(self.linger_s, self._wake.set)
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write_queued())
        return committed

    def _settle(self, count: int, ok: bool) -> None:
        """The first `count` queued records are written (ok) or were given up on."""
        for waiter in self._waiters[:count]:
            if not waiter.done():
                waiter.set_result(ok)
        del self._queue[:count]
        del self._waiters[:count]

    def _release(self, ok: bool) -> None:
        """Tell every waiter the outcome so far, without dropping their records."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(ok)

    async def _write_queued(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            while self._queue:
                # Taken off the queue only once written, so `drain` sees work in flight.
                batch = self._queue[: self.max_batch]
                try:
                    await self.store.record_exchanges(batch)
                except StoreError as exc:
                    if await self._store_works():
                        # Not the store: a record it cannot hold. Keep the rest of the batch.
                        await self._write_each(batch)
                        self._settle(len(batch), True)
                        continue
                    # The store is down: nobody waits for it (the records stay queued).
                    self._release(False)
                    if not self._failing:
                        log.warning("archive writes failing, kept to retry: %s", exc)
                        # The store may come back as another file (a restored backup):
                        # what was known to be on disk must be written again to be sure.
                        self._known.clear()
                    self._failing = True
                    self._bound_queue()
                    await asyncio.sleep(self.retry_s)
                    continue
                if self._failing:
                    log.warning("archive writes resumed")
                    self._failing = False
                for record in batch:
                    self._remember(record.conversation, [*record.messages, *record.params])
                self._settle(len(batch), True)

    async def _store_works(self) -> bool:
        try:
            await self.store.check_writable()
        except StoreError:
            return False
        return True

    async def _write_each(self, batch: Sequence[ExchangeRecord]) -> None:
        for record in batch:
            try:
                await self.store.record_exchanges([record])
            except StoreError as exc:
                log.warning("archive record dropped, the store cannot hold it: %s", exc)
            else:
                self._remember(record.conversation, [*record.messages, *record.params])

    def _bound_queue(self) -> None:
        sizes = [sum(len(body) for _, body in (*r.messages, *r.params)) + 512 for r in self._queue]
        total, dropped = sum(sizes), 0
        while total > self.max_queued_bytes and dropped < len(sizes):
            total -= sizes[dropped]
            dropped += 1
        if dropped:
            self._settle(dropped, False)
            log.warning("archive queue full while the store is down: %d records dropped", dropped)

    def background(self, work: Coroutine[Any, Any, Any], what: str) -> None:
        async def run() -> None:
            try:
                await work
            except StoreError as exc:
                log.warning("archive write failed (%s): %s", what, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait (bounded) for queued and background writes, then stop the writer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._wake.set()  # what lingers goes now
        # A store that is down at shutdown will not come back in time: do not wait for it.
        while ((self._queue and not self._failing) or self._tasks) and loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0.01)
        if self._queue:
            log.warning("%d request records not archived at shutdown", len(self._queue))
            self._release(False)
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer


class ArchiveOriginals:
    """First stage: fingerprint the client's messages; note what the archive lacks."""

    name = "archive"

    def __init__(self, archiver: Archiver, fingerprints: FingerprintCache) -> None:
        self.archiver = archiver
        self.cache = fingerprints

    async def __call__(self, ex: Exchange, /) -> None:
        ident = self.cache.identity(
            ex.conversation, ex.original, ex.model, ex.body_bytes, ex.measure.fingerprint
        )
        fps = ex.fingerprints = ident.fingerprints
        ex.measure.seed(ex.original, fps, ident.counts)
        p = ident.pinned
        ex.identity = History(ex.original[:p], ex.original[p:], ident.chain)
        # The rows' JSON of a large body is made off the loop (proxy.offload).
        ex.unarchived = await off_loop(
            ex.body_bytes, lambda: self.archiver.missing(ex.conversation, fps, ex.original)
        )
        archiver = self.archiver

        async def write_now() -> None:
            await archiver.write(ex.conversation, ex.unarchived)

        ex.archive_now = write_now
