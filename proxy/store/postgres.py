"""PostgreSQL implementation of the store (asyncpg), for several replicas sharing one database.

Chosen by `store: postgresql://...` (see `open_store`); the same interface and
behaviour as the SQLite store, so stages and operator routes do not know which one
they talk to. What differs is what crossing process boundaries needs:

- Every write is one transaction on a pooled connection; writes that touch a
  conversation upsert its row first, so concurrent writers of one conversation
  queue on that row lock, and a batch of several conversations takes them in key
  order (no deadlock between replicas). A deadlock or serialization failure the
  server reports anyway is retried a few times: it rolled everything back.
- `conversation_lock` is a session-level advisory lock (`pg_lock.py`) held on a
  connection of a separate lock pool for as long as the compaction runs, so lock
  holders never starve queries of connections. Another replica's request waits on
  it, then re-reads the store and reuses the result (the stages already do that).
  A replica that dies takes its locks with its database session.
- No in-process summary cache: another replica may add or roll back a version at
  any moment, so `matching_summary` always asks the database (one round trip in
  the usual case, where the current version is the one that matches).

- A first open that fails (the server is not up yet) is retried in the background
  on later calls, at most once a second, while those calls fail at once.

Errors become `StoreError` and text is made storable at one boundary (`pg_boundary.py`).
The reads and most writes are shared with SQLite (`sql.py`); this module is the driver
under them and what only PostgreSQL needs: pools, advisory locks, bulk statements.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any, TypeVar

import asyncpg

from proxy.store.base import (
    ConversationRef,
    EventType,
    ExchangeRecord,
    StoreError,
    SummaryVersion,
    pick_matching,
)
from proxy.store.pg_boundary import clean_text, json_text, redact, server_settings, translated
from proxy.store.pg_lock import AdvisoryLocks
from proxy.store.pg_migrations import migrate
from proxy.store.sql import (
    SUMMARY_COLUMNS,
    SUMMARY_FIELDS,
    SUMMARY_FROM,
    SqlStore,
    Tx,
    numbered,
    payload_json,
    summary,
    touch,
)

log = logging.getLogger("recap.store")

SUMMARY_FROM_PG = numbered(SUMMARY_FROM)

T = TypeVar("T")
Conn = Any  # asyncpg.Connection (asyncpg ships no type hints)

# Transactions the server rolled back whole (40001 serialization, 40P01 deadlock): safe to retry.
_RETRIES = 3
_RETRY_OPEN_S = 1.0


async def _insert_messages(
    conn: Conn, conv: ConversationRef, messages: Sequence[tuple[str, str]], now: float
) -> int:
    """Insert-or-ignore in the given order; count the new ones on the conversation."""
    unique = dict(reversed(list(messages)))  # the first body of a repeated fingerprint wins
    fps = list(dict.fromkeys(fp for fp, _ in messages))
    # One statement: insert, count what was new, add it to the conversation's counter.
    added: int | None = await conn.fetchval(
        "WITH new AS ("
        " INSERT INTO messages (tenant, key, fingerprint, body, first_seen_at)"
        " SELECT $1, $2, m.fp, m.body, $5"
        " FROM unnest($3::text[], $4::text[]) WITH ORDINALITY AS m (fp, body, ord) ORDER BY m.ord"
        " ON CONFLICT (tenant, key, fingerprint) DO NOTHING RETURNING 1),"
        " n AS (SELECT count(*) AS added FROM new)"
        " UPDATE conversations c SET message_count = c.message_count + n.added FROM n"
        " WHERE c.tenant = $1 AND c.key = $2 AND n.added > 0 RETURNING n.added",
        conv.tenant,
        conv.key,
        fps,
        [json_text(unique[fp]) for fp in fps],
        now,
    )
    return added or 0


class _Tx:
    """The shared writes' view of an open PostgreSQL transaction."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def execute(self, sql: str, params: Sequence[Any]) -> None:
        await self.conn.execute(numbered(sql), *params)

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        return list(await self.conn.fetch(numbered(sql), *params))


async def _keep_session(conn: Conn) -> None:
    """Pool reset for query connections: they never change session state (no SET, LISTEN
    or session locks), so the default reset query would only cost a round trip per call."""


class PostgresStore(SqlStore):
    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], float] = time.time,
        min_size: int = 1,
        max_size: int = 10,
        lock_max_size: int = 10,
        timeout_s: float = 30.0,
    ) -> None:
        self._url = url
        self._clock = clock
        self._min_size = min_size
        self._max_size = max_size
        self._lock_max_size = lock_max_size
        self._timeout_s = timeout_s
        self._pool: Any = None  # asyncpg.Pool for queries
        self._lock_pool: Any = None  # asyncpg.Pool whose connections hold advisory locks
        self._schema = ""
        self._opening = asyncio.Lock()
        # Between open() and close(): a failed start (server not up yet) is retried on use.
        self._wanted = False
        self._retry_at = 0.0
        self._failure = "store is not open"
        self._retry: asyncio.Task[None] | None = None
        self._locks = AdvisoryLocks(timeout_s)

    def __repr__(self) -> str:
        return f"PostgresStore({redact(self._url)!r})"

    @property
    def schema(self) -> str:
        """The schema the tables live in (the search_path's first existing one)."""
        return self._schema

    async def open(self) -> None:
        self._wanted = True
        async with self._opening:
            if self._pool is not None:
                return
            try:
                await self._connect()
            except StoreError as exc:
                self._failure = str(exc)
                self._retry_at = time.monotonic() + _RETRY_OPEN_S
                raise

    async def _connect(self) -> None:
        settings = server_settings(self._url)
        with translated():
            pool = await asyncpg.create_pool(
                self._url,
                min_size=min(self._min_size, self._max_size),
                max_size=self._max_size,
                timeout=self._timeout_s,
                command_timeout=self._timeout_s,
                server_settings=settings,
                reset=_keep_session,
            )
            try:
                async with pool.acquire(timeout=self._timeout_s) as conn:
                    self._schema, _ = await migrate(conn, self._clock())
                # No command timeout here: waiting for a lock may take a whole compaction.
                lock_pool = await asyncpg.create_pool(
                    self._url,
                    min_size=0,
                    max_size=self._lock_max_size,
                    timeout=self._timeout_s,
                    server_settings=settings,
                )
            except BaseException:
                await pool.close()
                raise
        self._pool, self._lock_pool = pool, lock_pool

    async def close(self) -> None:
        self._wanted = False
        retry, self._retry = self._retry, None
        if retry is not None:
            retry.cancel()
            with suppress(asyncio.CancelledError, StoreError):
                await retry
        async with self._opening:
            pools, self._pool, self._lock_pool = (self._pool, self._lock_pool), None, None
            for pool in pools:
                if pool is not None:
                    with translated():
                        await pool.close()

    async def _pools(self) -> tuple[Any, Any]:
        """The open pools. After a failed open (the server was not up yet), a call fails at
        once and starts another try in the background, at most once a second: a request
        never waits for a connection attempt."""
        if self._pool is None:
            if not self._wanted:
                raise StoreError("store is not open")
            now = time.monotonic()
            if now >= self._retry_at and (self._retry is None or self._retry.done()):
                self._retry_at = now + _RETRY_OPEN_S
                self._retry = asyncio.get_running_loop().create_task(self._reopen())
            raise StoreError(self._failure)
        return self._pool, self._lock_pool

    async def _reopen(self) -> None:
        with suppress(StoreError):
            await self.open()
            log.info("store available again")

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A pooled connection, errors translated; for reads here and bulk tools (migrate-store)."""
        pool, _ = await self._pools()
        with translated():
            async with pool.acquire(timeout=self._timeout_s) as conn:
                yield conn

    async def _write(self, body: Callable[[Conn], Awaitable[T]]) -> T:
        """Run `body` in one transaction: all of its statements, or none of them."""
        for attempt in range(_RETRIES):
            try:
                async with self.connection() as conn, conn.transaction():
                    return await body(conn)
            except StoreError as exc:
                rolled_back = isinstance(exc.__cause__, asyncpg.TransactionRollbackError)
                if not rolled_back or attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    async def check_writable(self) -> None:
        async def body(conn: Conn) -> None:
            await conn.execute(
                "INSERT INTO heartbeat (id, at) VALUES (1, $1)"
                " ON CONFLICT (id) DO UPDATE SET at = excluded.at",
                self._clock(),
            )

        await self._write(body)

    # -- the conversation lock -------------------------------------------------------------

    def conversation_lock(self, conv: ConversationRef) -> AbstractAsyncContextManager[None]:
        return self._conversation_lock(conv)

    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        async with self.connection() as conn:
            return list(await conn.fetch(numbered(sql), *params))

    async def _transact(self, body: Callable[[Tx], Awaitable[T]]) -> T:
        return await self._write(lambda conn: body(_Tx(conn)))

    def _text(self, value: Any) -> Any:
        return clean_text(value)

    @asynccontextmanager
    async def _conversation_lock(self, conv: ConversationRef) -> AsyncIterator[None]:
        _, pool = await self._pools()
        async with self._locks.hold(pool, self._schema, conv):
            yield

    # -- summaries ---------------------------------------------------------------------------

    async def matching_summary(
        self, conv: ConversationRef, boundary_hashes: Sequence[str]
    ) -> SummaryVersion | None:
        # Every candidate's small columns, and the whole row of the current version only:
        # the current version is the usual answer, so one round trip mostly suffices.
        full = ", ".join(
            f"CASE WHEN sv.version = c.current_version THEN sv.{c} END" for c in SUMMARY_FIELDS
        )
        async with self.connection() as conn:
            rows = await conn.fetch(
                f"SELECT sv.version, sv.covered, sv.boundary_hash, {full}, c.current_version"
                f" {SUMMARY_FROM_PG} AND sv.version <= c.current_version AND sv.rolled_back = 0",
                conv.tenant,
                conv.key,
            )
            if not rows:
                return None
            current_version = rows[0][-1]
            chosen = pick_matching(
                [(r[0], r[1], r[2]) for r in rows], current_version, boundary_hashes
            )
            if chosen is None:
                return None
            if chosen == current_version:
                row = next(r for r in rows if r[0] == chosen)
                return summary(list(row)[3:])
            found = await conn.fetchrow(
                f"SELECT {SUMMARY_COLUMNS} {SUMMARY_FROM_PG} AND sv.version = $3",
                conv.tenant,
                conv.key,
                chosen,
            )
        return None if found is None else summary(found)

    # -- audit and archive -----------------------------------------------------------------

    async def archive_messages(
        self, conv: ConversationRef, messages: Sequence[tuple[str, str]]
    ) -> int:
        if not messages:
            return 0
        now = self._clock()

        async def body(conn: Conn) -> int:
            await touch(_Tx(conn), conv, now)
            return await _insert_messages(conn, conv, messages, now)

        return await self._write(body)

    async def record_exchanges(self, items: Sequence[ExchangeRecord]) -> None:
        if not items:
            return
        now = self._clock()
        # Conversation rows are locked in key order, the same in every replica, so two
        # batches never wait on each other in a cycle. Stable: each one's events keep order.
        ordered = sorted(items, key=lambda i: (i.conversation.tenant, i.conversation.key))

        async def body(conn: Conn) -> None:
            for item in ordered:
                conv = item.conversation
                await touch(_Tx(conn), conv, now)
                if item.messages:
                    await _insert_messages(conn, conv, item.messages, now)
                if item.params:
                    await _insert_params(conn, conv, item.params, now)
                if item.events:
                    await _insert_events(conn, conv, item.events, now)

        await self._write(body)

    async def archived_messages(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        return await self._archived("messages", conv, fingerprints)

    async def archived_params(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        return await self._archived("request_params", conv, fingerprints)

    async def _archived(
        self, table: str, conv: ConversationRef, fingerprints: Sequence[str] | None
    ) -> dict[str, str]:
        base = f"SELECT fingerprint, body FROM {table} WHERE tenant = $1 AND key = $2"
        async with self.connection() as conn:
            if fingerprints is None:
                rows = await conn.fetch(f"{base} ORDER BY id", conv.tenant, conv.key)
            else:
                rows = await conn.fetch(
                    f"{base} AND fingerprint = ANY($3::text[]) ORDER BY id",
                    conv.tenant,
                    conv.key,
                    list(dict.fromkeys(fingerprints)),
                )
        return {fp: body for fp, body in rows}

    # -- loop summaries ----------------------------------------------------------------------

    # -- conversations and retention ---------------------------------------------------------

    async def prune(self, older_than: float) -> int:
        pruned = 0
        while True:
            # One statement per batch: each conversation goes whole (ON DELETE CASCADE takes
            # its rows in every other table with it). Rows a writer holds right now are
            # skipped (they are being touched, so active); the others are re-checked.
            async def body(conn: Conn) -> int:
                deleted: int = await conn.fetchval(
                    "WITH gone AS (DELETE FROM conversations WHERE (tenant, key) IN ("
                    " SELECT tenant, key FROM conversations WHERE updated_at < $1"
                    " LIMIT 100 FOR UPDATE SKIP LOCKED) AND updated_at < $1 RETURNING 1)"
                    " SELECT count(*) FROM gone",
                    older_than,
                )
                return deleted

            deleted = await self._write(body)
            pruned += deleted
            if deleted == 0:
                return pruned


async def _insert_events(
    conn: Conn,
    conv: ConversationRef,
    events: Sequence[tuple[EventType, Mapping[str, Any]]],
    now: float,
) -> None:
    await conn.execute(
        "INSERT INTO events (tenant, key, type, payload, created_at)"
        " SELECT $1, $2, e.type, e.payload, $5"
        " FROM unnest($3::text[], $4::text[]) WITH ORDINALITY AS e (type, payload, ord)"
        " ORDER BY e.ord",
        conv.tenant,
        conv.key,
        [t for t, _ in events],
        [payload_json(p) for _, p in events],
        now,
    )


async def _insert_params(
    conn: Conn, conv: ConversationRef, params: Sequence[tuple[str, str]], now: float
) -> None:
    """Insert-or-ignore a request's other fields, each distinct set once."""
    unique = dict(reversed(list(params)))
    fps = list(dict.fromkeys(fp for fp, _ in params))
    await conn.execute(
        "INSERT INTO request_params (tenant, key, fingerprint, body, first_seen_at)"
        " SELECT $1, $2, p.fp, p.body, $5"
        " FROM unnest($3::text[], $4::text[]) WITH ORDINALITY AS p (fp, body, ord) ORDER BY p.ord"
        " ON CONFLICT (tenant, key, fingerprint) DO NOTHING",
        conv.tenant,
        conv.key,
        fps,
        [json_text(unique[fp]) for fp in fps],
        now,
    )
