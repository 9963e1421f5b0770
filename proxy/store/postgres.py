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
Every query is shared with SQLite (`sql.py`); this module is the driver under them
(`_fetch`, `_fetch_in`, `_transact` and its `Tx`) and what only PostgreSQL needs:
pools, advisory locks, bulk statements (unnest, `= ANY` arrays), retried transactions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any, TypeVar

import asyncpg

from proxy.store.base import ConversationRef, StoreError
from proxy.store.migrations import migrate_postgres
from proxy.store.pg_boundary import clean_text, redact, server_settings, translated
from proxy.store.pg_lock import AdvisoryLocks
from proxy.store.rows import Tx, numbered
from proxy.store.sql import SqlStore

log = logging.getLogger("recap.store")

T = TypeVar("T")
Conn = Any  # asyncpg.Connection (asyncpg ships no type hints)

# Transactions the server rolled back whole (40001 serialization, 40P01 deadlock): safe to retry.
_RETRIES = 3
_RETRY_OPEN_S = 1.0


class _Tx:
    """The shared writes' view of an open PostgreSQL transaction."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def execute(self, sql: str, params: Sequence[Any]) -> None:
        await self.conn.execute(numbered(sql), *params)

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        return list(await self.conn.fetch(numbered(sql), *params))

    async def insert_rows(
        self,
        table: str,
        fixed: Mapping[str, Any],
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        suffix: str = "",
    ) -> int:
        # One statement whatever the number of rows: each text column as one array,
        # unnested in order; the count of what was new comes back with it.
        n = len(fixed)
        shared = [f"${i}" for i in range(1, n + 1)]
        arrays = [f"${n + i}::text[]" for i in range(1, len(columns) + 1)]
        added: int = await self.conn.fetchval(
            f"WITH new AS (INSERT INTO {table} ({', '.join([*fixed, *columns])})"
            f" SELECT {', '.join([*shared, *(f'r.{c}' for c in columns)])}"
            f" FROM unnest({', '.join(arrays)}) WITH ORDINALITY AS r ({', '.join(columns)}, ord)"
            f" ORDER BY r.ord{suffix} RETURNING 1) SELECT count(*) FROM new",
            *fixed.values(),
            *([row[i] for row in rows] for i in range(len(columns))),
        )
        return added


async def _keep_session(conn: Conn) -> None:
    """Pool reset for query connections: they never change session state (no SET, LISTEN
    or session locks), so the default reset query would only cost a round trip per call."""


class PostgresStore(SqlStore):
    # Conversation rows another transaction holds are being touched (active): skipped.
    _prune_lock = " FOR UPDATE SKIP LOCKED"

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
                    self._schema, _ = await migrate_postgres(conn, self._clock())
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

    async def _transact(self, body: Callable[[Tx], Awaitable[T]]) -> T:
        """Run `body` in one transaction: all of its statements, or none of them."""
        for attempt in range(_RETRIES):
            try:
                async with self.connection() as conn, conn.transaction():
                    return await body(_Tx(conn))
            except StoreError as exc:
                rolled_back = isinstance(exc.__cause__, asyncpg.TransactionRollbackError)
                if not rolled_back or attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the driver seam under sql.py ------------------------------------------------------

    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        async with self.connection() as conn:
            return list(await conn.fetch(numbered(sql), *params))

    async def _fetch_in(
        self, sql: str, params: Sequence[Any], column: str, values: Sequence[Any]
    ) -> list[Sequence[Any]]:
        # One array parameter, whatever the number of values.
        return await self._fetch(f"{sql} AND {column} = ANY(?::text[])", (*params, list(values)))

    def _text(self, value: Any) -> Any:
        return clean_text(value)

    # -- the conversation lock -------------------------------------------------------------

    def conversation_lock(self, conv: ConversationRef) -> AbstractAsyncContextManager[None]:
        return self._conversation_lock(conv)

    @asynccontextmanager
    async def _conversation_lock(self, conv: ConversationRef) -> AsyncIterator[None]:
        _, pool = await self._pools()
        async with self._locks.hold(pool, self._schema, conv):
            yield
