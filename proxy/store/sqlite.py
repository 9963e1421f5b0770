"""SQLite implementation of the store (aiosqlite, one connection per process).

The default backend: the app opens it in its lifespan and every stage that reads
or writes stored state goes through it. One connection, so a per-instance
asyncio mutex keeps each transaction (and each read) whole: without it, one
coroutine's statements would land inside another's open transaction. Writes use
BEGIN IMMEDIATE so that two proxies on one file queue on busy_timeout instead of
failing on lock upgrade. WAL lets readers in other processes (the CLI) read
while the proxy writes.

Faults and recovery. A store that fails must cost the data path nothing but the
compaction it cannot do, and must come back by itself when the file does:

    fault                          detected by                      until it clears
    locked past busy_timeout,      the failing write (SQLITE_BUSY,  writes fail at once, reads
    disk full                      SQLITE_FULL); /readyz checks     go on; one write a second
                                   free space                       probes (a short busy wait)
    deleted, replaced, corrupted   every write checks the file      every call fails at once;
    or unreadable file, I/O        (inode, header); I/O, CORRUPT,   once a second the connection
    errors, read-only              NOTADB, READONLY errors          is reopened (never creating
                                                                    a file that disappeared)

A fault is logged once when it starts (and when its reason changes), with the
reason, and once when a write succeeds again; /readyz reports the reason meanwhile.
A store whose first open failed (garbage file, locked at start-up) is retried the
same way, so the proxy starts, forwards uncompacted, and becomes ready on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, suppress
from typing import Any, cast
from urllib.parse import quote

import aiosqlite

from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    Event,
    EventType,
    ExchangeRecord,
    KeyedLocks,
    Layer,
    LoopSummary,
    NewSummary,
    NotFound,
    Outcome,
    Store,
    StoreError,
    SummaryVersion,
    pick_matching,
)
from proxy.store.cache import SummaryCache
from proxy.store.migrations import migrate
from proxy.store.sqlite_faults import (
    Fault,
    FileFault,
    Kind,
    check_file,
    check_free_space,
    fault_kind,
    fault_reason,
    translated,
)

log = logging.getLogger("recap.store")

MEMORY = ":memory:"
# Below SQLite's smallest host-parameter limit (999), leaving room for tenant and key.
_IN_CHUNK = 900

# While another process holds the write lock, probes wait this long, not busy_timeout.
_PROBE_BUSY_MS = 50


def _names(record_type: type[Any], prefix: str = "") -> list[str]:
    """Column names are the record's field names, so the two cannot drift apart."""
    return [prefix + f.name for f in dataclasses.fields(record_type)]


def _fields(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


_SUMMARY_FIELDS = [c for c in _names(SummaryVersion) if c != "current"]
_SUMMARY_COLUMNS = ", ".join([f"sv.{c}" for c in _SUMMARY_FIELDS] + ["c.current_version"])
_SUMMARY_FROM = (
    "FROM summary_versions sv JOIN conversations c ON c.tenant = sv.tenant AND c.key = sv.key"
    " WHERE sv.tenant = ? AND sv.key = ?"
)
_CONVERSATION_COLUMNS = ", ".join(_names(ConversationInfo))
_LOOP_COLUMNS = ", ".join(_names(LoopSummary))
_COMPACTION_COLUMNS = ", ".join(_names(CompactionRecord))


def _payload_json(payload: Mapping[str, Any]) -> str:
    return json.dumps(dict(payload), ensure_ascii=False)


def _storable_json(text: str) -> str:
    """JSON text SQLite can hold: lone surrogates (valid in JSON escapes) cannot be UTF-8.

    Re-escaping changes the bytes but not the JSON value, and only for such text.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(json.loads(text))
    return text


def _summary(row: Sequence[Any]) -> SummaryVersion:
    # The last column is the conversation's current_version.
    values = dict(zip(_SUMMARY_FIELDS, row, strict=False))
    return SummaryVersion(**values, current=row[-1] == values["version"])


def _compaction(row: sqlite3.Row | tuple[Any, ...]) -> CompactionRecord:
    layer, reason, outcome, *rest = row
    return CompactionRecord(cast(Layer, layer), reason, cast(Outcome, outcome), *rest)


def _conversation(row: sqlite3.Row | tuple[Any, ...]) -> ConversationInfo:
    return ConversationInfo(*row)


async def _touch(db: aiosqlite.Connection, conv: ConversationRef, now: float) -> None:
    """Create the conversation on first write; every write counts as activity (prune, lists)."""
    await db.execute(
        "INSERT INTO conversations (tenant, key, created_at, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (tenant, key) DO UPDATE SET updated_at = excluded.updated_at",
        (conv.tenant, conv.key, now, now),
    )


async def _insert(
    db: aiosqlite.Connection,
    table: str,
    conv: ConversationRef,
    values: Mapping[str, Any],
    suffix: str = "",
) -> aiosqlite.Cursor:
    columns = ["tenant", "key", *values]
    marks = ", ".join("?" * len(columns))
    return await db.execute(
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}){suffix}",
        (conv.tenant, conv.key, *values.values()),
    )


async def _one(db: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> Any:
    rows = await _all(db, sql, params)
    return rows[0] if rows else None


async def _all(db: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    # One hop to the database thread (execute + fetch), not three.
    return list(await db.execute_fetchall(sql, params))


class SqliteStore(Store):
    def __init__(
        self,
        path: str,
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_ms: int = 5000,
        retry_s: float = 1.0,
    ) -> None:
        self._path = path
        self._clock = clock
        self._busy_timeout_ms = busy_timeout_ms
        self._retry_s = retry_s
        self._db: aiosqlite.Connection | None = None
        self._mutex = asyncio.Lock()
        self._locks: KeyedLocks[ConversationRef] = KeyedLocks()
        self._summaries = SummaryCache()
        # open() was called and close() was not: a lost connection is to be re-made.
        self._wanted = False
        # The file was opened once: if it disappears, it is waited for, never re-created
        # empty (that would hide the loss and split the archive in two).
        self._created = False
        self._identity: tuple[int, int] | None = None
        self._fault: Fault | None = None

    @property
    def path(self) -> str:
        return self._path

    async def open(self) -> None:
        async with self._mutex:
            self._wanted = True
            if self._db is not None:
                return
            with translated(), self._watch(write=False):
                await self._connect()

    async def _connect(self) -> None:
        """Open the file, set the pragmas, migrate; a failure is a fault, retried later."""
        try:
            await self._open_connection()
        except Exception as exc:
            self._failed(fault_reason(exc), fault_kind(exc) or Kind(reconnect=True))
            raise

    async def _open_connection(self) -> None:
        """Raises the driver's or the OS's error."""
        path: str = self._path
        uri = False
        if self._path != MEMORY:
            if self._created:
                # mode=rw: a file deleted under us is reported missing, not re-created.
                path, uri = f"file:{quote(os.path.abspath(self._path))}?mode=rw", True
            else:
                parent = os.path.dirname(os.path.abspath(self._path))
                os.makedirs(parent, exist_ok=True)
        db = await aiosqlite.connect(path, isolation_level=None, uri=uri)
        try:
            # busy_timeout first: the pragmas below may already wait on a lock.
            await db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            await db.execute("PRAGMA foreign_keys = ON")
            await self._enable_wal(db)
            # In WAL mode NORMAL never corrupts and survives a process crash;
            # only a power loss may drop the last commits.
            await db.execute("PRAGMA synchronous = NORMAL")
            await migrate(db, self._clock())
            if self._path != MEMORY:
                st = os.stat(self._path)
                self._identity = (st.st_dev, st.st_ino)
        except BaseException:
            await db.close()
            raise
        self._db = db
        self._created = True
        # What this process remembered may not be what the (restored) file holds.
        self._summaries.clear()

    async def _enable_wal(self, db: aiosqlite.Connection) -> None:
        # Switching a new file to WAL needs an exclusive lock, and SQLite answers
        # BUSY at once, without the busy handler, when another process is doing
        # the same: so two proxies starting together retry here.
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        while True:
            try:
                await db.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                busy = getattr(exc, "sqlite_errorname", "") == "SQLITE_BUSY"
                if not busy or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        async with self._mutex:
            self._wanted = False
            db, self._db = self._db, None
            if db is not None:
                with translated():
                    await db.close()

    def _gate(self, *, write: bool) -> None:
        """Fail at once while the store is known to be down: requests must not wait on it."""
        fault = self._fault
        if fault is None or time.monotonic() >= fault.retry_at:
            return
        if write or fault.kind.reconnect or self._db is None:
            raise StoreError(fault.reason)

    async def _ready(self, *, write: bool) -> aiosqlite.Connection:
        """The connection for one call, under the mutex: gated, reopened, checked."""
        if not self._wanted:
            raise StoreError("store is not open")
        self._gate(write=write)
        fault = self._fault
        if fault is not None and (write or fault.kind.reconnect or self._db is None):
            # This call is the probe; the others keep failing fast while it runs.
            fault.retry_at = time.monotonic() + self._retry_s
        if self._db is None or (fault is not None and fault.kind.reconnect):
            await self._reopen(check=fault is not None and fault.kind.damaged)
        if write and self._identity is not None:
            check_file(self._path, self._identity)
        return await self._settled()

    async def _reopen(self, *, check: bool) -> None:
        db, self._db = self._db, None
        if db is not None:
            # The old connection may point at a deleted file or a broken one: let it go.
            with suppress(sqlite3.Error, ValueError, OSError):
                await db.close()
        await self._connect()
        if check:
            # A damaged file can look whole to a new connection (its header intact, or
            # rewritten by the old connection's last checkpoint): trust it once checked.
            assert self._db is not None
            rows = await _all(self._db, "PRAGMA quick_check(1)", ())
            if [tuple(r) for r in rows] != [("ok",)]:
                await self._db.close()
                self._db = None
                raise FileFault("database file is corrupt", damaged=True)
        if self._fault is not None:
            # Connected (and checked); the next write tells whether the store is back.
            self._fault.kind = Kind()

    @contextmanager
    def _watch(self, *, write: bool) -> Iterator[None]:
        """Note faults as they happen, and the recovery when a write succeeds again."""
        try:
            yield
        except Exception as exc:
            kind = fault_kind(exc)
            if kind is not None:
                self._failed(fault_reason(exc), kind)
            raise
        if write and self._fault is not None:
            fault, self._fault = self._fault, None
            log.warning(
                "store available again after %.1f s (%s)",
                time.monotonic() - fault.since,
                self._path,
            )

    def _failed(self, reason: str, kind: Kind) -> None:
        now = time.monotonic()
        old = self._fault
        if old is None or old.reason != reason:
            log.error(
                "store unavailable: %s (%s); chat requests go through uncompacted, "
                "retrying every %g s",
                reason,
                self._path,
                self._retry_s,
            )
        if old is not None and old.kind.damaged:
            # Damage is forgotten only once a reopened file passed its check.
            kind = dataclasses.replace(kind, reconnect=True, damaged=True)
        self._fault = Fault(
            reason, kind, since=old.since if old else now, retry_at=now + self._retry_s
        )
        if kind.reconnect:
            self._summaries.clear()

    def _require(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    async def _settled(self) -> aiosqlite.Connection:
        db = self._require()
        if db.in_transaction:
            # Only a rollback interrupted by cancellation can leave one open; its
            # half-done writes must be neither read nor committed by the next caller.
            await db.rollback()
        return db

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[aiosqlite.Connection]:
        with translated(), self._watch(write=False):
            self._gate(write=False)
            async with self._mutex:
                yield await self._ready(write=False)

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[aiosqlite.Connection]:
        """One write transaction: all of the body's statements, or none of them."""
        with translated(), self._watch(write=True):
            self._gate(write=True)
            async with self._mutex:
                db = await self._ready(write=True)
                probing = self._fault is not None and self._fault.kind.busy
                if probing:
                    # Another process held the lock a moment ago: ask, do not queue.
                    await db.execute(f"PRAGMA busy_timeout = {_PROBE_BUSY_MS}")
                try:
                    await db.execute("BEGIN IMMEDIATE")
                finally:
                    if probing:
                        await db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
                try:
                    yield db
                except BaseException:
                    # Keep the original error; a failed rollback is discarded by SQLite anyway.
                    with suppress(sqlite3.Error, ValueError):
                        await db.rollback()
                    raise
                await db.commit()

    async def check_writable(self) -> None:
        """A real write, after the checks a write cannot make: free space, the file."""
        if self._path != MEMORY and self._wanted:
            check_free_space(self._path)
        async with self._write() as db:
            await db.execute(
                "INSERT INTO heartbeat (id, at) VALUES (1, ?)"
                " ON CONFLICT (id) DO UPDATE SET at = excluded.at",
                (self._clock(),),
            )

    def conversation_lock(self, conv: ConversationRef) -> AbstractAsyncContextManager[None]:
        # In-process only: one proxy process owns a SQLite file.
        return self._locks.hold(conv)

    async def summary_versions(self, conv: ConversationRef) -> list[SummaryVersion]:
        async with self._read() as db:
            rows = await _all(
                db,
                f"SELECT {_SUMMARY_COLUMNS} {_SUMMARY_FROM} ORDER BY sv.version",
                (conv.tenant, conv.key),
            )
        return [_summary(r) for r in rows]

    async def current_summary(self, conv: ConversationRef) -> SummaryVersion | None:
        async with self._read() as db:
            row = await _one(
                db,
                f"SELECT {_SUMMARY_COLUMNS} {_SUMMARY_FROM} AND sv.version = c.current_version",
                (conv.tenant, conv.key),
            )
        return None if row is None else _summary(row)

    async def matching_summary(
        self, conv: ConversationRef, boundary_hashes: Sequence[str]
    ) -> SummaryVersion | None:
        # Asked on every chat request: answered from memory while the cache is fresh.
        cached = self._summaries.get(conv)
        if cached is not None:
            candidates, current = cached
            chosen = pick_matching(candidates, current.version if current else 0, boundary_hashes)
            if chosen is None:
                return None
            if current is not None and chosen == current.version:
                return current
        async with self._read() as db:
            # Only the small columns of every candidate; the chosen text is read once.
            rows = await _all(
                db,
                "SELECT sv.version, sv.covered, sv.boundary_hash, c.current_version"
                f" {_SUMMARY_FROM} AND sv.version <= c.current_version",
                (conv.tenant, conv.key),
            )
            candidates = [(r[0], r[1], r[2]) for r in rows]
            current_version = rows[0][3] if rows else 0
            chosen = pick_matching(candidates, current_version, boundary_hashes)
            wanted = [v for v in (chosen, current_version) if v]
            found = (
                {
                    v.version: v
                    for v in map(
                        _summary,
                        await _all(
                            db,
                            f"SELECT {_SUMMARY_COLUMNS} {_SUMMARY_FROM}"
                            f" AND sv.version IN ({', '.join('?' * len(wanted))})",
                            (conv.tenant, conv.key, *wanted),
                        ),
                    )
                }
                if wanted
                else {}
            )
        self._summaries.put(conv, candidates, found.get(current_version))
        return found.get(chosen) if chosen else None

    async def add_summary_version(self, conv: ConversationRef, new: NewSummary) -> SummaryVersion:
        self._summaries.drop(conv)
        now = self._clock()
        async with self._write() as db:
            await _touch(db, conv, now)
            # MAX + 1, not current + 1: after a rollback the later numbers stay taken.
            (version,) = await _one(
                db,
                "SELECT COALESCE(MAX(version), 0) + 1 FROM summary_versions"
                " WHERE tenant = ? AND key = ?",
                (conv.tenant, conv.key),
            )
            (compact_count,) = await _one(
                db,
                "UPDATE conversations SET current_version = ?, compact_count = compact_count + 1"
                " WHERE tenant = ? AND key = ? RETURNING compact_count",
                (version, conv.tenant, conv.key),
            )
            row = {
                **_fields(new),
                "version": version,
                "compact_count": compact_count,
                "created_at": now,
                "updated_at": now,
            }
            await _insert(db, "summary_versions", conv, row)
        return SummaryVersion(**row, current=True)

    async def set_current_version(self, conv: ConversationRef, version: int | None) -> None:
        self._summaries.drop(conv)
        now = self._clock()
        async with self._write() as db:
            if version is not None:
                found = await _one(
                    db,
                    "SELECT 1 FROM summary_versions WHERE tenant = ? AND key = ? AND version = ?",
                    (conv.tenant, conv.key, version),
                )
                if found is None:
                    raise NotFound(f"no summary version {version}")
            cur = await db.execute(
                "UPDATE conversations SET current_version = ?, updated_at = ?"
                " WHERE tenant = ? AND key = ?",
                (version, now, conv.tenant, conv.key),
            )
            if cur.rowcount == 0:
                raise NotFound("no such conversation")

    async def record_compaction(self, conv: ConversationRef, record: CompactionRecord) -> None:
        now = self._clock()
        saved = max(0, record.tokens_before - record.tokens_after) if record.outcome == "ok" else 0
        async with self._write() as db:
            await _touch(db, conv, now)
            row = {**_fields(record), "created_at": record.created_at or now}
            await _insert(db, "compactions", conv, row)
            if saved:
                await db.execute(
                    "UPDATE conversations SET tokens_saved = tokens_saved + ?"
                    " WHERE tenant = ? AND key = ?",
                    (saved, conv.tenant, conv.key),
                )

    async def compactions(self, conv: ConversationRef) -> list[CompactionRecord]:
        async with self._read() as db:
            rows = await _all(
                db,
                f"SELECT {_COMPACTION_COLUMNS} FROM compactions"
                " WHERE tenant = ? AND key = ? ORDER BY id",
                (conv.tenant, conv.key),
            )
        return [_compaction(r) for r in rows]

    async def archive_messages(
        self, conv: ConversationRef, messages: Sequence[tuple[str, str]]
    ) -> int:
        if not messages:
            return 0
        now = self._clock()
        rows = [(conv.tenant, conv.key, fp, _storable_json(body), now) for fp, body in messages]
        async with self._write() as db:
            await _touch(db, conv, now)
            cur = await db.executemany(
                "INSERT INTO messages (tenant, key, fingerprint, body, first_seen_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, key, fingerprint) DO NOTHING",
                rows,
            )
            added = max(0, cur.rowcount)
            if added:
                await db.execute(
                    "UPDATE conversations SET message_count = message_count + ?"
                    " WHERE tenant = ? AND key = ?",
                    (added, conv.tenant, conv.key),
                )
        return added

    async def record_exchanges(self, items: Sequence[ExchangeRecord]) -> None:
        now = self._clock()
        async with self._write() as db:
            for item in items:
                conv = item.conversation
                await _touch(db, conv, now)
                rows = [
                    (conv.tenant, conv.key, fp, _storable_json(body), now)
                    for fp, body in item.messages
                ]
                if rows:
                    cur = await db.executemany(
                        "INSERT INTO messages (tenant, key, fingerprint, body, first_seen_at)"
                        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, key, fingerprint) DO NOTHING",
                        rows,
                    )
                    if cur.rowcount > 0:
                        await db.execute(
                            "UPDATE conversations SET message_count = message_count + ?"
                            " WHERE tenant = ? AND key = ?",
                            (cur.rowcount, conv.tenant, conv.key),
                        )
                if item.events:
                    await db.executemany(
                        "INSERT INTO events (tenant, key, type, payload, created_at)"
                        " VALUES (?, ?, ?, ?, ?)",
                        [
                            (conv.tenant, conv.key, t, _storable_json(_payload_json(p)), now)
                            for t, p in item.events
                        ],
                    )

    async def archived_messages(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        base = "SELECT id, fingerprint, body FROM messages WHERE tenant = ? AND key = ?"
        found: list[tuple[int, str, str]] = []
        async with self._read() as db:
            if fingerprints is None:
                found = await _all(db, base, (conv.tenant, conv.key))
            else:
                wanted = list(dict.fromkeys(fingerprints))
                for i in range(0, len(wanted), _IN_CHUNK):
                    chunk = wanted[i : i + _IN_CHUNK]
                    marks = ", ".join("?" * len(chunk))
                    found += await _all(
                        db, f"{base} AND fingerprint IN ({marks})", (conv.tenant, conv.key, *chunk)
                    )
        found.sort()
        return {fp: body for _, fp, body in found}

    async def append_event(
        self, conv: ConversationRef, type: EventType, payload: Mapping[str, Any]
    ) -> int:
        now = self._clock()
        text = _storable_json(json.dumps(dict(payload), ensure_ascii=False))
        async with self._write() as db:
            await _touch(db, conv, now)
            cur = await _insert(
                db, "events", conv, {"type": type, "payload": text, "created_at": now}
            )
            event_id = cur.lastrowid
        if event_id is None:
            raise StoreError("event id not returned")
        return event_id

    async def events(
        self, conv: ConversationRef, after_id: int = 0, *, page_size: int = 500
    ) -> AsyncIterator[Event]:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        last = after_id
        while True:
            # A fresh read per page: the mutex is never held while the consumer works.
            async with self._read() as db:
                rows = await _all(
                    db,
                    "SELECT id, type, payload, created_at FROM events"
                    " WHERE tenant = ? AND key = ? AND id > ? ORDER BY id LIMIT ?",
                    (conv.tenant, conv.key, last, page_size),
                )
            for event_id, type_, payload, created_at in rows:
                last = event_id
                yield Event(event_id, type_, json.loads(payload), created_at)
            if len(rows) < page_size:
                return

    async def last_event(self, conv: ConversationRef, type: EventType) -> Event | None:
        async with self._read() as db:
            row = await _one(
                db,
                "SELECT id, type, payload, created_at FROM events"
                " WHERE tenant = ? AND key = ? AND type = ? ORDER BY id DESC LIMIT 1",
                (conv.tenant, conv.key, type),
            )
        if row is None:
            return None
        event_id, type_, payload, created_at = row
        return Event(event_id, type_, json.loads(payload), created_at)

    async def iter_archived(
        self, conv: ConversationRef, *, page_size: int = 500
    ) -> AsyncIterator[tuple[str, str]]:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        last = 0
        while True:
            # A fresh read per page, as in `events`: the consumer may be a slow client.
            async with self._read() as db:
                rows = await _all(
                    db,
                    "SELECT id, fingerprint, body FROM messages"
                    " WHERE tenant = ? AND key = ? AND id > ? ORDER BY id LIMIT ?",
                    (conv.tenant, conv.key, last, page_size),
                )
            for row_id, fp, body in rows:
                last = row_id
                yield fp, body
            if len(rows) < page_size:
                return

    async def get_loop_summary(
        self, conv: ConversationRef, turn_hash: str, max_rounds: int, now: float
    ) -> LoopSummary | None:
        async with self._read() as db:
            row = await _one(
                db,
                f"SELECT {_LOOP_COLUMNS} FROM loop_summaries"
                " WHERE tenant = ? AND key = ? AND turn_hash = ? AND covered_rounds <= ?"
                " AND expires_at > ? ORDER BY covered_rounds DESC LIMIT 1",
                (conv.tenant, conv.key, turn_hash, max_rounds, now),
            )
        return None if row is None else LoopSummary(*row)

    async def find_loop_summary(
        self, conv: ConversationRef, covers: Sequence[str], now: float
    ) -> LoopSummary | None:
        hashes = [h for h in dict.fromkeys(covers) if h]
        if not hashes:
            return None
        marks = ", ".join("?" * len(hashes))
        async with self._read() as db:
            row = await _one(
                db,
                f"SELECT {_LOOP_COLUMNS} FROM loop_summaries"
                f" WHERE tenant = ? AND key = ? AND covers_hash IN ({marks})"
                " AND expires_at > ? ORDER BY covered_rounds DESC LIMIT 1",
                (conv.tenant, conv.key, *hashes, now),
            )
        return None if row is None else LoopSummary(*row)

    async def put_loop_summary(self, conv: ConversationRef, s: LoopSummary) -> None:
        now = self._clock()
        async with self._write() as db:
            await _touch(db, conv, now)
            # Expired working memory is useless; dropping it here keeps the table small.
            await db.execute(
                "DELETE FROM loop_summaries WHERE tenant = ? AND key = ? AND expires_at <= ?",
                (conv.tenant, conv.key, now),
            )
            row = _fields(s)
            replace = ", ".join(
                f"{c} = excluded.{c}"
                for c in row
                if c not in ("turn_hash", "covered_rounds", "covers_hash")
            )
            await _insert(
                db,
                "loop_summaries",
                conv,
                row,
                " ON CONFLICT (tenant, key, turn_hash, covered_rounds, covers_hash)"
                f" DO UPDATE SET {replace}",
            )

    async def list_conversations(
        self, tenant: str | None, limit: int = 50, before: float | None = None
    ) -> list[ConversationInfo]:
        where: list[str] = []
        params: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            params.append(tenant)
        if before is not None:
            where.append("updated_at < ?")
            params.append(before)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        async with self._read() as db:
            rows = await _all(
                db,
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations{clause}"
                " ORDER BY updated_at DESC, tenant, key LIMIT ?",
                (*params, max(0, limit)),
            )
        return [_conversation(r) for r in rows]

    async def get_conversation(self, conv: ConversationRef) -> ConversationInfo | None:
        async with self._read() as db:
            row = await _one(
                db,
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE tenant = ? AND key = ?",
                (conv.tenant, conv.key),
            )
        return None if row is None else _conversation(row)

    async def prune(self, older_than: float) -> int:
        self._summaries.clear()
        pruned = 0
        while True:
            async with self._read() as db:
                batch = await _all(
                    db,
                    "SELECT tenant, key FROM conversations WHERE updated_at < ? LIMIT 500",
                    (older_than,),
                )
            if not batch:
                return pruned
            for tenant, key in batch:
                # Re-checked inside the transaction: a request may have touched it since.
                # ON DELETE CASCADE removes the rows of every other table with it.
                async with self._write() as db:
                    cur = await db.execute(
                        "DELETE FROM conversations WHERE tenant = ? AND key = ? AND updated_at < ?",
                        (tenant, key, older_than),
                    )
                    pruned += max(0, cur.rowcount)
