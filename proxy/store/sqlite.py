"""SQLite implementation of the store (aiosqlite, one connection per process).

Every query is shared with PostgreSQL (`sql.py`); this module is the SQLite driver
under them (`_fetch`, `_fetch_in`, `_transact` and its `Tx`) and what only SQLite
needs: the mutex, the fault gate and file checks, the summary cache, chunked IN lists.

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
import logging
import os
import sqlite3
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, suppress
from typing import Any, TypeVar, cast
from urllib.parse import quote

import aiosqlite

from proxy.store.base import ConversationRef, KeyedLocks, StoreError, SummaryVersion
from proxy.store.cache import SummaryCache
from proxy.store.migrations import migrate_sqlite
from proxy.store.private import make_private
from proxy.store.rows import Tx
from proxy.store.sql import Candidates, SqlStore
from proxy.store.sqlite_faults import (
    DatabaseFile,
    Fault,
    FileFault,
    Kind,
    check_free_space,
    fault_kind,
    fault_reason,
    translated,
)
from proxy.store.sqlite_lock import FileLocks

log = logging.getLogger("recap.store")

T = TypeVar("T")

MEMORY = ":memory:"
# Below SQLite's smallest host-parameter limit (999), leaving room for tenant and key.
_IN_CHUNK = 900

# While another process holds the write lock, probes wait this long, not busy_timeout.
_PROBE_BUSY_MS = 50


class _Tx:
    """The shared writes' view of a SQLite transaction that runs whole on the database's
    thread: its methods are coroutines that never suspend, so `_run_whole` finishes a
    body in one call there. One hop to that thread per transaction, not one per
    statement: each hop wakes a thread and the event loop, which on a busy machine costs
    more than the statements."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    async def execute(self, sql: str, params: Sequence[Any]) -> None:
        self.conn.execute(sql, params)

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        return list(self.conn.execute(sql, params).fetchall())

    async def insert_rows(
        self,
        table: str,
        fixed: Mapping[str, Any],
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        suffix: str = "",
    ) -> int:
        names = [*fixed, *columns]
        marks = ", ".join("?" * len(names))
        shared = tuple(fixed.values())
        cur = self.conn.executemany(
            f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks}){suffix}",
            [(*shared, *row) for row in rows],
        )
        return max(0, cur.rowcount)


def _run_whole(
    conn: sqlite3.Connection, body: Callable[[Tx], Awaitable[T]], probe_ms: int, busy_ms: int
) -> T:
    """On the database thread: BEGIN IMMEDIATE, the body, COMMIT (ROLLBACK on any error).

    With `probe_ms`, the write lock is waited for that long only (another process held it
    a moment ago: ask, do not queue), then `busy_ms` again."""
    if probe_ms:
        conn.execute(f"PRAGMA busy_timeout = {probe_ms}")
    try:
        conn.execute("BEGIN IMMEDIATE")
    finally:
        if probe_ms:
            conn.execute(f"PRAGMA busy_timeout = {busy_ms}")
    coro = cast(Coroutine[Any, Any, T], body(_Tx(conn)))  # an `async def` body
    try:
        try:
            coro.send(None)
        except StopIteration as done:
            result: T = done.value
        else:
            coro.close()
            raise RuntimeError("a SQLite transaction body awaited something other than its Tx")
    except BaseException:
        # Keep the original error; a failed rollback is discarded by SQLite anyway.
        with suppress(sqlite3.Error):
            conn.rollback()
        raise
    conn.commit()
    return result


async def _on_thread(db: aiosqlite.Connection, call: Callable[[sqlite3.Connection], T]) -> T:
    """`call(connection)` on aiosqlite's database thread, in order with its other calls.

    aiosqlite has no public way to run several statements in one hop: this uses its
    queue (`Connection._execute`) and its sqlite3 connection (`_conn`), as its own
    methods do; the store suite fails at once if a release changes them (the pin in
    pyproject.toml names the tested range)."""
    result = await db._execute(lambda: call(db._conn))  # type: ignore[no-untyped-call]
    return cast(T, result)


async def _all(db: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    # One hop to the database thread (execute + fetch), not three.
    return list(await db.execute_fetchall(sql, params))


class SqliteStore(SqlStore):
    # One conversation per prune transaction: the request path's writes wait on each.
    _prune_batch = 1

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
        self._files = FileLocks(path) if path != MEMORY else None
        self._summaries = SummaryCache()
        # open() was called and close() was not: a lost connection is to be re-made.
        self._wanted = False
        # The file was opened once: if it disappears, it is waited for, never re-created
        # empty (that would hide the loss and split the archive in two).
        self._created = False
        self._file: DatabaseFile | None = None
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
                # Owner-only: it holds every conversation and the compaction secret.
                make_private(self._path)
        db = await aiosqlite.connect(path, isolation_level=None, uri=uri)
        try:
            # busy_timeout first: the pragmas below may already wait on a lock.
            await db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            await db.execute("PRAGMA foreign_keys = ON")
            await self._enable_wal(db)
            # In WAL mode NORMAL never corrupts and survives a process crash;
            # only a power loss may drop the last commits.
            await db.execute("PRAGMA synchronous = NORMAL")
            await migrate_sqlite(db, self._clock())
            if self._path != MEMORY:
                st = os.stat(self._path)
                self._file = DatabaseFile(self._path, (st.st_dev, st.st_ino))
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
            if self._files is not None:
                self._files.close()
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
        if write and self._file is not None:
            self._file.check()
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

    async def check_writable(self) -> None:
        """A real write, after the checks a write cannot make: free space, the file."""
        if self._path != MEMORY and self._wanted:
            check_free_space(self._path)
        await super().check_writable()

    def conversation_lock(self, conv: ConversationRef) -> AbstractAsyncContextManager[None]:
        # Across processes (the CLI beside a server): proxy/store/sqlite_lock.py.
        if self._files is None:
            return self._locks.hold(conv)
        return self._files.hold(conv)

    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        async with self._read() as db:
            return await _all(db, sql, params)

    async def _transact(self, body: Callable[[Tx], Awaitable[T]]) -> T:
        """The whole transaction in one call on the database thread (`_run_whole`)."""
        with translated(), self._watch(write=True):
            self._gate(write=True)
            async with self._mutex:
                db = await self._ready(write=True)
                probing = self._fault is not None and self._fault.kind.busy
                probe_ms = _PROBE_BUSY_MS if probing else 0
                busy_ms = int(self._busy_timeout_ms)
                return await _on_thread(db, lambda conn: _run_whole(conn, body, probe_ms, busy_ms))

    async def _fetch_in(
        self, sql: str, params: Sequence[Any], column: str, values: Sequence[Any]
    ) -> list[Sequence[Any]]:
        found: list[Sequence[Any]] = []
        async with self._read() as db:
            # Chunked under SQLite's host-parameter limit, all in one read.
            for i in range(0, len(values), _IN_CHUNK):
                chunk = values[i : i + _IN_CHUNK]
                marks = ", ".join("?" * len(chunk))
                found += await _all(db, f"{sql} AND {column} IN ({marks})", (*params, *chunk))
        return found

    def _forget(self, conv: ConversationRef) -> None:
        self._summaries.drop(conv)

    def _forget_all(self) -> None:
        self._summaries.clear()

    async def _summary_candidates(
        self, conv: ConversationRef
    ) -> tuple[Candidates, SummaryVersion | None]:
        # Asked on every chat request: answered from memory while the cache is fresh.
        cached = self._summaries.get(conv)
        if cached is not None:
            return list(cached[0]), cached[1]
        candidates, current = await super()._summary_candidates(conv)
        # No await since the read: no write came between it and this entry.
        self._summaries.put(conv, candidates, current)
        return candidates, current
