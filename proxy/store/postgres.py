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
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any, TypeVar, cast

import asyncpg

from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    Event,
    EventType,
    ExchangeRecord,
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
from proxy.store.pg_boundary import clean_text, json_text, redact, server_settings, translated
from proxy.store.pg_lock import AdvisoryLocks
from proxy.store.pg_migrations import migrate

log = logging.getLogger("recap.store")

T = TypeVar("T")
Conn = Any  # asyncpg.Connection (asyncpg ships no type hints)

# Transactions the server rolled back whole (40001 serialization, 40P01 deadlock): safe to retry.
_RETRIES = 3
_RETRY_OPEN_S = 1.0


def _names(record_type: type[Any], prefix: str = "") -> list[str]:
    """Column names are the record's field names, as in the SQLite store."""
    return [prefix + f.name for f in dataclasses.fields(record_type)]


_SUMMARY_FIELDS = [c for c in _names(SummaryVersion) if c != "current"]
_SUMMARY_COLUMNS = ", ".join([f"sv.{c}" for c in _SUMMARY_FIELDS] + ["c.current_version"])
_SUMMARY_FROM = (
    "FROM summary_versions sv JOIN conversations c ON c.tenant = sv.tenant AND c.key = sv.key"
    " WHERE sv.tenant = $1 AND sv.key = $2"
)
_CONVERSATION_COLUMNS = ", ".join(_names(ConversationInfo))
_LOOP_COLUMNS = ", ".join(_names(LoopSummary))
_COMPACTION_COLUMNS = ", ".join(_names(CompactionRecord))
_EVENT_COLUMNS = "id, type, payload, created_at"


def _summary(row: Sequence[Any]) -> SummaryVersion:
    values = dict(zip(_SUMMARY_FIELDS, row, strict=False))
    return SummaryVersion(**values, current=row[-1] == values["version"])


def _event(row: Sequence[Any]) -> Event:
    return Event(row[0], row[1], json.loads(row[2]), row[3])


async def _touch(conn: Conn, conv: ConversationRef, now: float) -> None:
    """Create the conversation on first write; every write counts as activity (prune, lists).

    Also takes the conversation row's lock for the rest of the transaction.
    """
    await conn.execute(
        "INSERT INTO conversations (tenant, key, created_at, updated_at) VALUES ($1, $2, $3, $3)"
        " ON CONFLICT (tenant, key) DO UPDATE SET updated_at = excluded.updated_at",
        conv.tenant,
        conv.key,
        now,
    )


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


async def _keep_session(conn: Conn) -> None:
    """Pool reset for query connections: they never change session state (no SET, LISTEN
    or session locks), so the default reset query would only cost a round trip per call."""


class PostgresStore(Store):
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

    @asynccontextmanager
    async def _conversation_lock(self, conv: ConversationRef) -> AsyncIterator[None]:
        _, pool = await self._pools()
        async with self._locks.hold(pool, self._schema, conv):
            yield

    # -- summaries ---------------------------------------------------------------------------

    async def summary_versions(self, conv: ConversationRef) -> list[SummaryVersion]:
        async with self.connection() as conn:
            rows = await conn.fetch(
                f"SELECT {_SUMMARY_COLUMNS} {_SUMMARY_FROM} ORDER BY sv.version",
                conv.tenant,
                conv.key,
            )
        return [_summary(r) for r in rows]

    async def current_summary(self, conv: ConversationRef) -> SummaryVersion | None:
        async with self.connection() as conn:
            row = await conn.fetchrow(
                f"SELECT {_SUMMARY_COLUMNS} {_SUMMARY_FROM} AND sv.version = c.current_version",
                conv.tenant,
                conv.key,
            )
        return None if row is None else _summary(row)

    async def matching_summary(
        self, conv: ConversationRef, boundary_hashes: Sequence[str]
    ) -> SummaryVersion | None:
        # Every candidate's small columns, and the whole row of the current version only:
        # the current version is the usual answer, so one round trip mostly suffices.
        full = ", ".join(
            f"CASE WHEN sv.version = c.current_version THEN sv.{c} END" for c in _SUMMARY_FIELDS
        )
        async with self.connection() as conn:
            rows = await conn.fetch(
                f"SELECT sv.version, sv.covered, sv.boundary_hash, {full}, c.current_version"
                f" {_SUMMARY_FROM} AND sv.version <= c.current_version",
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
                return _summary(list(row)[3:])
            found = await conn.fetchrow(
                f"SELECT {_SUMMARY_COLUMNS} {_SUMMARY_FROM} AND sv.version = $3",
                conv.tenant,
                conv.key,
                chosen,
            )
        return None if found is None else _summary(found)

    async def add_summary_version(self, conv: ConversationRef, new: NewSummary) -> SummaryVersion:
        now = self._clock()

        async def body(conn: Conn) -> SummaryVersion:
            await _touch(conn, conv, now)  # holds the conversation row: numbering is serial
            # MAX + 1, not current + 1: after a rollback the later numbers stay taken.
            version = await conn.fetchval(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM summary_versions"
                " WHERE tenant = $1 AND key = $2",
                conv.tenant,
                conv.key,
            )
            compact_count = await conn.fetchval(
                "UPDATE conversations SET current_version = $3, compact_count = compact_count + 1"
                " WHERE tenant = $1 AND key = $2 RETURNING compact_count",
                conv.tenant,
                conv.key,
                version,
            )
            row = {
                **{f.name: clean_text(getattr(new, f.name)) for f in dataclasses.fields(new)},
                "version": version,
                "compact_count": compact_count,
                "created_at": now,
                "updated_at": now,
            }
            await _insert(conn, "summary_versions", conv, row)
            return SummaryVersion(**row, current=True)

        return await self._write(body)

    async def set_current_version(self, conv: ConversationRef, version: int | None) -> None:
        now = self._clock()

        async def body(conn: Conn) -> None:
            if version is not None:
                found = await conn.fetchval(
                    "SELECT 1 FROM summary_versions WHERE tenant = $1 AND key = $2"
                    " AND version = $3",
                    conv.tenant,
                    conv.key,
                    version,
                )
                if found is None:
                    raise NotFound(f"no summary version {version}")
            updated = await conn.fetchval(
                "UPDATE conversations SET current_version = $3, updated_at = $4"
                " WHERE tenant = $1 AND key = $2 RETURNING 1",
                conv.tenant,
                conv.key,
                version,
                now,
            )
            if updated is None:
                raise NotFound("no such conversation")

        await self._write(body)

    # -- audit and archive -----------------------------------------------------------------

    async def record_compaction(self, conv: ConversationRef, record: CompactionRecord) -> None:
        now = self._clock()
        saved = max(0, record.tokens_before - record.tokens_after) if record.outcome == "ok" else 0

        async def body(conn: Conn) -> None:
            await _touch(conn, conv, now)
            row = {f.name: clean_text(getattr(record, f.name)) for f in dataclasses.fields(record)}
            row["created_at"] = record.created_at or now
            await _insert(conn, "compactions", conv, row)
            if saved:
                await conn.execute(
                    "UPDATE conversations SET tokens_saved = tokens_saved + $3"
                    " WHERE tenant = $1 AND key = $2",
                    conv.tenant,
                    conv.key,
                    saved,
                )

        await self._write(body)

    async def compactions(self, conv: ConversationRef) -> list[CompactionRecord]:
        async with self.connection() as conn:
            rows = await conn.fetch(
                f"SELECT {_COMPACTION_COLUMNS} FROM compactions"
                " WHERE tenant = $1 AND key = $2 ORDER BY id",
                conv.tenant,
                conv.key,
            )
        return [
            CompactionRecord(cast(Layer, r[0]), r[1], cast(Outcome, r[2]), *list(r)[3:])
            for r in rows
        ]

    async def archive_messages(
        self, conv: ConversationRef, messages: Sequence[tuple[str, str]]
    ) -> int:
        if not messages:
            return 0
        now = self._clock()

        async def body(conn: Conn) -> int:
            await _touch(conn, conv, now)
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
                await _touch(conn, conv, now)
                if item.messages:
                    await _insert_messages(conn, conv, item.messages, now)
                if item.events:
                    await _insert_events(conn, conv, item.events, now)

        await self._write(body)

    async def archived_messages(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        base = "SELECT fingerprint, body FROM messages WHERE tenant = $1 AND key = $2"
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

    async def append_event(
        self, conv: ConversationRef, type: EventType, payload: Mapping[str, Any]
    ) -> int:
        now = self._clock()
        text = json_text(json.dumps(dict(payload), ensure_ascii=False))

        async def body(conn: Conn) -> int:
            await _touch(conn, conv, now)
            event_id: int = await conn.fetchval(
                "INSERT INTO events (tenant, key, type, payload, created_at)"
                " VALUES ($1, $2, $3, $4, $5) RETURNING id",
                conv.tenant,
                conv.key,
                type,
                text,
                now,
            )
            return event_id

        return await self._write(body)

    async def events(
        self, conv: ConversationRef, after_id: int = 0, *, page_size: int = 500
    ) -> AsyncIterator[Event]:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        last = after_id
        while True:
            # A fresh query per page: no connection is held while the consumer works.
            async with self.connection() as conn:
                rows = await conn.fetch(
                    f"SELECT {_EVENT_COLUMNS} FROM events"
                    " WHERE tenant = $1 AND key = $2 AND id > $3 ORDER BY id LIMIT $4",
                    conv.tenant,
                    conv.key,
                    last,
                    page_size,
                )
            for row in rows:
                last = row[0]
                yield _event(row)
            if len(rows) < page_size:
                return

    async def last_event(self, conv: ConversationRef, type: EventType) -> Event | None:
        async with self.connection() as conn:
            row = await conn.fetchrow(
                f"SELECT {_EVENT_COLUMNS} FROM events"
                " WHERE tenant = $1 AND key = $2 AND type = $3 ORDER BY id DESC LIMIT 1",
                conv.tenant,
                conv.key,
                type,
            )
        return None if row is None else _event(row)

    async def iter_archived(
        self, conv: ConversationRef, *, page_size: int = 500
    ) -> AsyncIterator[tuple[str, str]]:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        last = 0
        while True:
            async with self.connection() as conn:
                rows = await conn.fetch(
                    "SELECT id, fingerprint, body FROM messages"
                    " WHERE tenant = $1 AND key = $2 AND id > $3 ORDER BY id LIMIT $4",
                    conv.tenant,
                    conv.key,
                    last,
                    page_size,
                )
            for row_id, fp, body in rows:
                last = row_id
                yield fp, body
            if len(rows) < page_size:
                return

    # -- loop summaries ----------------------------------------------------------------------

    async def get_loop_summary(
        self, conv: ConversationRef, turn_hash: str, max_rounds: int, now: float
    ) -> LoopSummary | None:
        async with self.connection() as conn:
            row = await conn.fetchrow(
                f"SELECT {_LOOP_COLUMNS} FROM loop_summaries"
                " WHERE tenant = $1 AND key = $2 AND turn_hash = $3 AND covered_rounds <= $4"
                " AND expires_at > $5 ORDER BY covered_rounds DESC LIMIT 1",
                conv.tenant,
                conv.key,
                turn_hash,
                max_rounds,
                now,
            )
        return None if row is None else LoopSummary(*row)

    async def find_loop_summary(
        self, conv: ConversationRef, covers: Sequence[str], now: float
    ) -> LoopSummary | None:
        hashes = [h for h in dict.fromkeys(covers) if h]
        if not hashes:
            return None
        async with self.connection() as conn:
            row = await conn.fetchrow(
                f"SELECT {_LOOP_COLUMNS} FROM loop_summaries"
                " WHERE tenant = $1 AND key = $2 AND covers_hash = ANY($3::text[])"
                " AND expires_at > $4 ORDER BY covered_rounds DESC LIMIT 1",
                conv.tenant,
                conv.key,
                hashes,
                now,
            )
        return None if row is None else LoopSummary(*row)

    async def put_loop_summary(self, conv: ConversationRef, s: LoopSummary) -> None:
        now = self._clock()

        async def body(conn: Conn) -> None:
            await _touch(conn, conv, now)
            # Expired working memory is useless; dropping it here keeps the table small.
            await conn.execute(
                "DELETE FROM loop_summaries WHERE tenant = $1 AND key = $2 AND expires_at <= $3",
                conv.tenant,
                conv.key,
                now,
            )
            row = {f.name: clean_text(getattr(s, f.name)) for f in dataclasses.fields(s)}
            replace = ", ".join(
                f"{c} = excluded.{c}"
                for c in row
                if c not in ("turn_hash", "covered_rounds", "covers_hash")
            )
            await _insert(
                conn,
                "loop_summaries",
                conv,
                row,
                " ON CONFLICT (tenant, key, turn_hash, covered_rounds, covers_hash)"
                f" DO UPDATE SET {replace}",
            )

        await self._write(body)

    # -- conversations and retention ---------------------------------------------------------

    async def list_conversations(
        self, tenant: str | None, limit: int = 50, before: float | None = None
    ) -> list[ConversationInfo]:
        where: list[str] = []
        params: list[Any] = []
        if tenant is not None:
            params.append(tenant)
            where.append(f"tenant = ${len(params)}")
        if before is not None:
            params.append(before)
            where.append(f"updated_at < ${len(params)}")
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        params.append(max(0, limit))
        async with self.connection() as conn:
            rows = await conn.fetch(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations{clause}"
                f" ORDER BY updated_at DESC, tenant, key LIMIT ${len(params)}",
                *params,
            )
        return [ConversationInfo(*r) for r in rows]

    async def get_conversation(self, conv: ConversationRef) -> ConversationInfo | None:
        async with self.connection() as conn:
            row = await conn.fetchrow(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE tenant = $1 AND key = $2",
                conv.tenant,
                conv.key,
            )
        return None if row is None else ConversationInfo(*row)

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


async def _insert(
    conn: Conn, table: str, conv: ConversationRef, values: Mapping[str, Any], suffix: str = ""
) -> None:
    columns = ["tenant", "key", *values]
    marks = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    await conn.execute(
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}){suffix}",
        conv.tenant,
        conv.key,
        *values.values(),
    )


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
        [json_text(json.dumps(dict(p), ensure_ascii=False)) for _, p in events],
        now,
    )
