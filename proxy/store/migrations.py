"""Applying the schema history (`schema.py`) when a store opens, on either database.

Runs once in `SqliteStore.open` and `PostgresStore.open`, before any request touches
the store. The history, the version check, the data step (`rekey.py`'s re-keying) and the
`schema_version` rows are written once (`_apply`, `?` marks) over a small seam, `_Conn`;
what is each database's own is how the steps are made one transaction that concurrent
starts take in turn:

    SQLite       `schema_version` made first (autocommit), then BEGIN IMMEDIATE: the
                 write lock is taken before the version is read, so a second process
                 starting at the same moment waits (busy_timeout) and then sees ours
    PostgreSQL   one transaction holding a transaction-scoped advisory lock keyed by
                 the schema's name (DDL is transactional there), `schema_version` made
                 inside it; replicas queue on the lock

Either way a migration and its `schema_version` row commit together: a crash mid-way
leaves the previous schema intact, and the later starts find nothing left to do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import aiosqlite

from proxy.store.rekey import EVENT_TYPES, rekey
from proxy.store.rows import numbered
from proxy.store.schema import HISTORY, LATEST, POSTGRES, SQLITE, VERSIONS, Dialect, Rekey


class SchemaTooNew(Exception):
    """The database was migrated by a newer proxy; refusing to guess at its schema."""


class NoSchema(Exception):
    """The connection's search_path names no schema that exists."""


class _Conn(Protocol):
    """One database connection inside the migration's transaction (`?` marks)."""

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None: ...

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Sequence[Any]]: ...

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...


async def _apply(conn: _Conn, dialect: Dialect, now: float, target: int | None) -> int:
    """Every migration newer than the database's version, up to `target`; the final version."""
    rows = await conn.fetch("SELECT COALESCE(MAX(version), 0) FROM schema_version")
    current = int(rows[0][0])
    if current > LATEST:
        raise SchemaTooNew(f"database schema v{current} is newer than this proxy (v{LATEST})")
    for migration in HISTORY:
        if migration.version <= current or (target is not None and migration.version > target):
            continue
        for step in migration.steps:
            if isinstance(step, Rekey):
                await _rekey(conn)
            else:
                await conn.execute(dialect.sql(step))
        await conn.execute(
            "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
            (migration.version, migration.name, now),
        )
        current = migration.version
    return current


async def _rekey(conn: _Conn) -> None:
    """Whole-message fingerprints for an archive written before them (see `rekey.py`)."""
    where = "WHERE tenant = ? AND key = ?"
    kinds = ", ".join(f"'{t}'" for t in EVENT_TYPES)
    for tenant, key in await conn.fetch("SELECT tenant, key FROM conversations"):
        conv = (tenant, key)
        messages = f"SELECT id, fingerprint, body FROM messages {where} ORDER BY id"
        events = f"SELECT id, type, payload FROM events {where} AND type IN ({kinds}) ORDER BY id"
        summaries = f"SELECT version, covered, boundary_hash FROM summary_versions {where}"
        changes = rekey(
            _triples(await conn.fetch(messages, conv)),
            _triples(await conn.fetch(events, conv)),
            _triples(await conn.fetch(summaries, conv)),
        )
        if changes.messages:
            await conn.executemany(
                "UPDATE messages SET fingerprint = ? WHERE id = ?",
                [(fp, row_id) for row_id, fp in changes.messages],
            )
        if changes.events:
            await conn.executemany(
                "UPDATE events SET payload = ? WHERE id = ?",
                [(payload, event_id) for event_id, payload in changes.events],
            )
        if changes.summaries:
            await conn.executemany(
                f"UPDATE summary_versions SET boundary_hash = ? {where} AND version = ?",
                [(h, tenant, key, version) for version, h in changes.summaries],
            )


def _triples(rows: list[Sequence[Any]]) -> list[tuple[Any, Any, Any]]:
    return [(r[0], r[1], r[2]) for r in rows]


# -- SQLite ----------------------------------------------------------------------------------


class _Sqlite:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self.db.execute(sql, params)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        return list(await self.db.execute_fetchall(sql, params))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self.db.executemany(sql, rows)


async def migrate_sqlite(db: aiosqlite.Connection, now: float, target: int | None = None) -> int:
    """Apply every migration newer than the database's version (up to `target`, tests
    only: an old schema to upgrade from); return the final version.

    `db` must be in autocommit mode (isolation_level=None): transactions here are explicit.
    """
    await db.execute(SQLITE.sql(VERSIONS))
    await db.execute("BEGIN IMMEDIATE")
    try:
        current = await _apply(_Sqlite(db), SQLITE, now, target)
    except BaseException:
        await db.rollback()
        raise
    await db.commit()
    return current


# -- PostgreSQL ------------------------------------------------------------------------------


class _Postgres:
    def __init__(self, conn: Any) -> None:
        self.conn = conn  # asyncpg.Connection

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self.conn.execute(numbered(sql), *params)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Sequence[Any]]:
        return list(await self.conn.fetch(numbered(sql), *params))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self.conn.executemany(numbered(sql), rows)


def advisory_key(*parts: str) -> int:
    """A signed 64-bit advisory lock key for these names (stable across processes)."""
    digest = hashlib.blake2b("\x00".join(("recap", *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def migrate_postgres(conn: Any, now: float, target: int | None = None) -> tuple[str, int]:
    """Apply every migration newer than the database's (up to `target`, tests only);
    return (schema, final version).

    `conn` is an asyncpg connection outside any transaction.
    """
    async with conn.transaction():
        schema = await conn.fetchval("SELECT current_schema()")
        if schema is None:
            raise NoSchema("the search_path names no existing schema: create it first")
        # Held until this transaction ends: concurrent starts queue here.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", advisory_key("migrate", schema))
        await conn.execute(POSTGRES.sql(VERSIONS))
        current = await _apply(_Postgres(conn), POSTGRES, now, target)
    return str(schema), current
