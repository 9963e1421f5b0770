"""The lossless archive on the data path: originals before any compaction, events after.

    archive stage (first)   proxy/stages/archive.py: how the client's messages are
                            identified and which the archive lacks, worked out when
                            first needed; nothing is written yet
    a compacting stage      calls `exchange.ensure_archived()` first: the originals
                            are written before any summary, placeholder or drop that
                            replaces them, and if that write fails the stage does not
                            compact (seed 002 §5.5)
    as it goes upstream     `begin`: the record of the request: the originals still
                            unwritten, the synthetic messages sent (summaries,
                            placeholders), the request's other fields (model, tools,
                            sampling, ...: `request_params`, each distinct set once), and
                            the `request` and `trim` events. With a journal
                            (proxy/archive/journal.py, the default) it is appended there, durable
                            at once, and the answer's final bytes need not wait for the
                            store; without one (or for a record too large to journal on
                            the loop) the writer commits it while the upstream answers and
                            the final bytes wait for that commit
    after the response      `finish`: the `response` event (the answer as its dialect's
                            recorder read it, and the time Recap added before
                            forwarding), journaled too

The background writer stores queued records in batches, one transaction each: journaled
ones after `RESPONSE_LINGER_S` (or with the next record that must be committed at once),
with the journal's mark in the same transaction. So a request that compacts nothing costs
no store write on its path, an answered request is durable before its client has the
whole answer, and many requests share one write. Readers of the archive in this process
(operator routes, the web pages) call `flush` first, so they see every answered request.
Event payloads reference messages by fingerprint; the messages table holds each distinct
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
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.archive.archived import ArchivedIndex
from proxy.archive.journal import Journal, orphans
from proxy.history.messages import Message
from proxy.pipeline import Exchange
from proxy.planning.outcome import Layer
from proxy.store.base import (
    ConversationRef,
    EventType,
    ExchangeRecord,
    JournalMark,
    Store,
    StoreError,
)
from proxy.wire import longjson

log = logging.getLogger("recap.archive")

# How long a journaled record (or, without a journal, a response event) may wait to be
# stored with others. Without a journal a process killed in that window loses a response
# event, never a request or a message.
RESPONSE_LINGER_S = 0.25
# A record whose messages weigh more is not journaled: encoding it would hold the loop
# (the writer makes its rows off the loop and commits it before the final bytes instead).
JOURNAL_MAX_CHARS = 256 * 1024


def message_json(message: Message, parsed_from: int | None = None) -> str:
    """`parsed_from`: the size of the body it came from, when known (`longjson.dumps`)."""
    return longjson.dumps(
        message, ensure_ascii=False, separators=(",", ":"), parsed_from=parsed_from
    )


def request_params(body: Mapping[str, Any], parsed_from: int | None = None) -> tuple[str, str]:
    """(fingerprint, JSON) of a request's fields other than its messages: model, tools,
    sampling, response_format, ... With the messages, they rebuild the request as sent:
    `{**params, "messages": [...]}`.

    One dump serves as both the stored text and what is hashed (in the client's key
    order, which a client keeps from request to request: a reordering only stores the
    same fields once more). The hash has its own prefix, so it never equals a message's
    fingerprint in the archived index.
    """
    text = message_json({k: v for k, v in body.items() if k != "messages"}, parsed_from)
    digest = hashlib.sha256(b"recap-params\n" + text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest(), text


def _weight(record: ExchangeRecord) -> int:
    return sum(len(body) for _, body in (*record.messages, *record.params))


class Archiver:
    def __init__(
        self, store: Store, known: ArchivedIndex | None = None, journal: Journal | None = None
    ) -> None:
        self.store = store
        self.journal = journal
        self._journal_failing = False
        # What is known to be on disk: most of a re-sent history is, so most requests
        # archive one or two messages, not all of them.
        self._known = known if known is not None else ArchivedIndex()
        self._tasks: set[asyncio.Task[None]] = set()
        self._queue: list[ExchangeRecord] = []
        # One per queued record: resolved when it is durable (journaled, or written), or
        # when the store failed.
        self._waiters: list[asyncio.Future[bool]] = []
        # One per queued record: where the journal holds it (None: not journaled).
        self._places: list[tuple[int, int] | None] = []
        # Records ever queued (`flush`: those taken off the queue are the rest).
        self._queued = 0
        self._flushes: list[tuple[int, asyncio.Future[None]]] = []
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
        self,
        conv: ConversationRef,
        fps: Sequence[str],
        messages: Sequence[Message],
        parsed_from: int | None = None,
    ) -> list[tuple[str, str]]:
        """(fingerprint, json) of the messages not known to be archived, each once."""
        known = self._known.known(conv)
        rows: dict[str, str] = {}
        for fp, m in zip(fps, messages, strict=True):
            if fp not in known and fp not in rows:
                rows[fp] = message_json(m, parsed_from)
        return list(rows.items())

    def unarchived(self, ex: Exchange) -> list[tuple[str, str]]:
        """The rows of the exchange's originals not known to be on disk: those the archive
        stage worked out (`ex.unarchived`), else worked out now."""
        if ex.unarchived is not None:
            return list(ex.unarchived)
        return self.missing(ex.conversation, ex.fingerprints, ex.original, ex.body_bytes or None)

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

        Queued for the writer at once, so the commit runs while the upstream answers; the
        future resolves when it is on disk (True) or when the store failed to take it
        (False: the record stays queued for retry, the request is not held up). The
        compacting route (proxy/edge/compacting.py) holds back the final bytes of the answer
        until it resolves, so an answered request is durable even if the process is killed
        right after.
        """
        ex.count_for_log()  # tokens_after; mostly seeded counts, so cheap
        conv = ex.conversation
        session, trim = ex.outcome(Layer.SESSION), ex.outcome(Layer.TRIM)
        rows = self.unarchived(ex)  # for most requests, first worked out now
        sent = [ex.measure.fingerprint(m) for m in ex.messages] if ex.changed else ex.fingerprints
        if ex.changed:
            rows += self.missing(conv, sent, ex.messages)
        # The client's own messages, where a layer before the route rewrote them (Codex's
        # compaction items): those are what the client sent; what went upstream is `sent`.
        client = ex.client_history
        if client is not None:
            have = {fp for fp, _ in rows}
            pairs = zip(client.fingerprints, client.messages, strict=True)
            own = [(fp, m) for fp, m in pairs if fp not in have]
            rows += self.missing(conv, [fp for fp, _ in own], [m for _, m in own])
        params_fp, params_json = request_params(ex.params, ex.body_bytes or None)
        params = [] if params_fp in self._known.known(conv) else [(params_fp, params_json)]
        events: list[tuple[EventType, Mapping[str, Any]]] = [
            (
                "request",
                {
                    "request_id": ex.request_id,
                    # the API it came in (the dialect's name), so what reads it back
                    # speaks to the upstream in that API (the manual compaction)
                    "dialect": ex.dialect.name,
                    "classification": ex.classification.value,
                    "model": ex.model,
                    "stream": ex.stream,
                    "messages": ex.fingerprints if client is None else client.fingerprints,
                    # the request's other fields, archived once (`request_params`)
                    "params": params_fp,
                    # null: sent exactly as the client sent it (no second copy of the list)
                    "sent": sent if ex.changed or client is not None else None,
                    # the client's messages the last resort dropped (not folded: lost to
                    # the model; the page tags them)
                    "dropped": ex.dropped,
                    # the holdout cohort (None when the tenant runs none)
                    "cohort": ex.record.cohort,
                    # the window the planners decided with (in Recap's tokens, calibrated
                    # from usage, less the tool definitions) beside the configured one
                    "window": ex.context_window,
                    "configured_window": ex.configured_window,
                    "layers": ex.layers,
                    # What each layer did (the log line's `compactions`), from the
                    # typed outcomes; the session summary now applied, if any.
                    "compactions": [o.as_log() for o in ex.outcomes],
                    # The summarizer's tokens this request's compactions cost (the holdout
                    # report's cost counts them).
                    "summarizer_input_tokens": sum(o.summarizer_tokens_in for o in ex.outcomes),
                    "summarizer_output_tokens": sum(o.summarizer_tokens_out for o in ex.outcomes),
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
        return self._record(ExchangeRecord(conv, rows, events, params), urgent=True)

    def finish(self, ex: Exchange, answer: Mapping[str, Any] | None) -> None:
        """After the response: its event (the request's was queued by `begin`)."""
        if answer is not None:
            # The time Recap added before forwarding (the holdout report's added latency).
            added = {"overhead_ms": ex.record.overhead_ms}
            event: tuple[EventType, Mapping[str, Any]] = (
                "response",
                {"request_id": ex.request_id, **added, **answer},
            )
            self._record(ExchangeRecord(ex.conversation, [], [event]), urgent=False)

    def _record(self, record: ExchangeRecord, *, urgent: bool) -> asyncio.Future[bool]:
        """Queue a record, journaled when it can be: then it is durable already, and
        nobody waits for the store."""
        if self.journal is None or _weight(record) > JOURNAL_MAX_CHARS:
            return self._enqueue(record, urgent=urgent)
        # Stored later than it happens: it carries its own time.
        record = ExchangeRecord(
            record.conversation, record.messages, record.events, record.params, time.time()
        )
        place = self._journaled(record)
        if place is None:
            return self._enqueue(record, urgent=urgent)
        # On disk for good: the next requests need not carry these messages again.
        self._remember(record.conversation, [*record.messages, *record.params])
        return self._enqueue(record, urgent=False, place=place)

    def _journaled(self, record: ExchangeRecord) -> tuple[int, int] | None:
        assert self.journal is not None
        try:
            place = self.journal.append(record)
        except (OSError, ValueError) as exc:
            if not self._journal_failing:
                log.warning("archive journal not writable, committing each record: %s", exc)
                self._journal_failing = True
            return None
        if self._journal_failing:
            log.warning("archive journal writable again")
            self._journal_failing = False
        return place

    def _enqueue(
        self,
        record: ExchangeRecord,
        *,
        urgent: bool = True,
        place: tuple[int, int] | None = None,
    ) -> asyncio.Future[bool]:
        """Queue a record; `urgent` ones (someone waits for them) wake the writer now,
        the others by `linger_s` at the latest."""
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[bool] = loop.create_future()
        if place is not None:
            committed.set_result(True)  # journaled: durable now
        elif self._failing:
            # The store is known to be down: keep the record to retry, hold no one up.
            committed.set_result(False)
        self._queue.append(record)
        self._waiters.append(committed)
        self._places.append(place)
        self._queued += 1
        if urgent:
            self._wake.set()
        elif self._linger is None:
            self._linger = loop.call_later(self.linger_s, self._wake.set)
        self._ensure_writer()
        return committed

    def _ensure_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())

    @property
    def _taken(self) -> int:
        """Records taken off the queue so far (stored or given up)."""
        return self._queued - len(self._queue)

    def _settle(self, count: int, ok: bool) -> None:
        """The first `count` queued records are written (ok) or were given up on."""
        for waiter in self._waiters[:count]:
            if not waiter.done():
                waiter.set_result(ok)
        del self._queue[:count]
        del self._waiters[:count]
        del self._places[:count]
        self._flushed()

    def _flushed(self, *, all_: bool = False) -> None:
        waiting = []
        for target, done in self._flushes:
            if all_ or self._taken >= target:
                if not done.done():
                    done.set_result(None)
            else:
                waiting.append((target, done))
        self._flushes = waiting

    def _mark(self, count: int) -> JournalMark | None:
        """The journal mark once the first `count` queued records are stored."""
        if self.journal is None:
            return None
        place = next((p for p in reversed(self._places[:count]) if p is not None), None)
        return None if place is None else self.journal.mark(*place)

    def _stored(self, mark: JournalMark | None) -> None:
        if mark is not None and self.journal is not None:
            try:
                self.journal.stored(mark)
            except OSError as exc:
                log.warning("archive journal: stored segments not removed: %s", exc)

    async def flush(self, timeout: float = 10.0) -> None:
        """Store what is queued now (bounded by `timeout`): a reader of the archive in
        this process then sees every request answered so far (and its audit rows)."""
        if self.store.audits is not None:
            await self.store.audits.flush(timeout)
        target = self._queued
        if self._taken >= target or self._failing:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flushes.append((target, done))
        self._wake.set()
        self._ensure_writer()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), timeout)

    def _release(self, ok: bool) -> None:
        """Tell every waiter the outcome so far, without dropping their records."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(ok)
        self._flushed(all_=True)

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
                mark = self._mark(len(batch))
                try:
                    await self.store.record_exchanges(batch, mark)
                except StoreError as exc:
                    if await self._store_works():
                        # Not the store: a record it cannot hold. Keep the rest of the batch.
                        await self._write_each(batch, self._places[: len(batch)])
                        self._settle(len(batch), True)
                        self._stored(mark)
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
                self._stored(mark)

    async def _store_works(self) -> bool:
        try:
            await self.store.check_writable()
        except StoreError:
            return False
        return True

    async def _write_each(
        self, batch: Sequence[ExchangeRecord], places: Sequence[tuple[int, int] | None]
    ) -> None:
        for record, place in zip(batch, places, strict=True):
            mark = self.journal.mark(*place) if self.journal and place else None
            try:
                await self.store.record_exchanges([record], mark)
            except StoreError as exc:
                log.warning("archive record dropped, the store cannot hold it: %s", exc)
                if mark is not None:  # past it: a replay must not try it again
                    with contextlib.suppress(StoreError):
                        await self.store.record_exchanges([], mark)
            else:
                self._remember(record.conversation, [*record.messages, *record.params])

    async def replay(self, directory: Path) -> int:
        """Store the journals in `directory` that processes which died left (at start-up,
        before serving); how many records. A store that fails leaves them for the next start."""
        stored = 0
        own = self.journal.owner if self.journal is not None else None
        for orphan in orphans(directory, own=own):
            try:
                after = await self.store.journal_mark(orphan.owner)
                batch: list[ExchangeRecord] = []
                marks: list[JournalMark] = []
                for mark, record in orphan.records(after):
                    batch.append(record)
                    marks.append(mark)
                    if len(batch) >= self.max_batch:
                        stored += await self._replayed(batch, marks)
                        batch, marks = [], []
                if batch:
                    stored += await self._replayed(batch, marks)
            except StoreError as exc:
                log.warning("archive journal %s not replayed, kept: %s", orphan.owner, exc)
                orphan.release()
                continue
            # Files first: a mark left behind is one stale row; a journal left behind
            # without its mark would be stored twice.
            orphan.remove()
            with contextlib.suppress(StoreError):
                await self.store.forget_journal(orphan.owner)
        if stored:
            log.warning("archive journal: %d records of a stopped process stored", stored)
        return stored

    async def _replayed(self, batch: list[ExchangeRecord], marks: list[JournalMark]) -> int:
        """One batch of a replay, with the mark of its last record; record by record
        if the store cannot hold one of them (a store that is down raises)."""
        try:
            await self.store.record_exchanges(batch, marks[-1])
        except StoreError:
            if not await self._store_works():
                raise
            for record, mark in zip(batch, marks, strict=True):
                try:
                    await self.store.record_exchanges([record], mark)
                except StoreError as exc:
                    log.warning("journal record dropped, the store cannot hold it: %s", exc)
                    await self.store.record_exchanges([], mark)
        return len(batch)

    def _bound_queue(self) -> None:
        sizes = [_weight(r) + 512 for r in self._queue]
        total, dropped = sum(sizes), 0
        while total > self.max_queued_bytes and dropped < len(sizes):
            total -= sizes[dropped]
            dropped += 1
        if dropped:
            self._settle(dropped, False)
            self._known.clear()  # some of what they carried may be on disk nowhere now
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
            kept = sum(p is not None for p in self._places)
            log.warning(
                "%d request records not archived at shutdown (%d kept in the journal for "
                "the next start)",
                len(self._queue),
                kept,
            )
            self._release(False)
        if self.journal is not None:
            self.journal.close(all_stored=not self._queue)
            if not self._queue:
                with contextlib.suppress(StoreError):
                    await self.store.forget_journal(self.journal.owner)
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
