"""`recap migrate-store FROM TO`: copy everything one store holds into another, empty one.

Off the data path: an operator's tool, used once when moving from the embedded SQLite
store to PostgreSQL (or back). Both stores are opened through `open_store` first, so
each has the current schema; then the rows of every table are streamed table by table,
column for column (both schemas come from one history, `schema.py`): conversations
with their counters and current-version pointer, every summary version, the
compactions audit, the archived messages and request parameters, the events and the
loop summaries, ids included, so event ids and archive order survive and the target's id sequences
continue after the copied ones.

The source is read in one snapshot (a SQLite read transaction; a PostgreSQL
REPEATABLE READ one), and the target is written in one transaction: a copy that fails
leaves the target as it was. The target must hold no conversation yet.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiosqlite

from proxy.store.base import Store, StoreError
from proxy.store.pg_boundary import clean_text
from proxy.store.postgres import PostgresStore
from proxy.store.schema import columns as schema_columns
from proxy.store.schema import identity_tables
from proxy.store.sqlite import MEMORY, SqliteStore


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[str, ...]
    order: str  # a total order, so that ids and archive order are written as they were read


def _copied(*tables: tuple[str, str]) -> tuple[Table, ...]:
    """(name, order) of each table to copy, with its columns as the schema history leaves them."""
    columns = schema_columns()
    return tuple(Table(name, columns[name], order) for name, order in tables)


# Parents first: every row's conversation exists before it. Not copied: heartbeat (a probe's
# row), journal_marks (how far journals are in the source, not the target) and
# schema_version (the target's own).
TABLES = _copied(
    ("conversations", "tenant, key"),
    ("summary_versions", "tenant, key, version"),
    ("compactions", "id"),
    ("messages", "id"),
    ("events", "id"),
    ("request_params", "id"),
    ("loop_summaries", "tenant, key, turn_hash, covered_rounds, covers_hash"),
    ("deployment", "name"),
)

_BATCH = 1000


class Source(Protocol):
    def rows(self, table: Table) -> AsyncIterator[tuple[Any, ...]]: ...


class Sink(Protocol):
    async def is_empty(self) -> bool: ...

    async def write(self, table: Table, rows: Sequence[tuple[Any, ...]]) -> None: ...

    async def finish(self) -> None: ...


def _sqlite_file(store: SqliteStore) -> str:
    if store.path == MEMORY:
        raise StoreError("an in-memory store cannot be copied to or from")
    return store.path


def require_existing(store: Store) -> None:
    """A source must exist: opening a SQLite store would create an empty file instead."""
    if isinstance(store, SqliteStore) and not os.path.isfile(_sqlite_file(store)):
        raise StoreError(f"no SQLite database at {store.path}")


@contextlib.asynccontextmanager
async def _sqlite(store: SqliteStore, write: bool) -> AsyncIterator[aiosqlite.Connection]:
    """A second connection to the store's file, in one transaction (a snapshot for reads)."""
    db = await aiosqlite.connect(_sqlite_file(store), isolation_level=None)
    try:
        await db.execute("PRAGMA busy_timeout = 5000")
        await db.execute("PRAGMA foreign_keys = ON")
        await db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield db
        except BaseException:
            await db.rollback()
            raise
        await db.commit()
    finally:
        await db.close()


class _SqliteSource:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db

    async def rows(self, table: Table) -> AsyncIterator[tuple[Any, ...]]:
        sql = f"SELECT {', '.join(table.columns)} FROM {table.name} ORDER BY {table.order}"
        async with self.db.execute(sql) as cursor:
            while batch := await cursor.fetchmany(_BATCH):
                for row in batch:
                    yield tuple(row)


class _SqliteSink:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db

    async def is_empty(self) -> bool:
        async with self.db.execute("SELECT 1 FROM conversations LIMIT 1") as cursor:
            return await cursor.fetchone() is None

    async def write(self, table: Table, rows: Sequence[tuple[Any, ...]]) -> None:
        marks = ", ".join("?" * len(table.columns))
        await self.db.executemany(
            f"INSERT INTO {table.name} ({', '.join(table.columns)}) VALUES ({marks})", rows
        )

    async def finish(self) -> None:
        """AUTOINCREMENT already remembers the largest id written."""


class _PostgresSource:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def rows(self, table: Table) -> AsyncIterator[tuple[Any, ...]]:
        sql = f"SELECT {', '.join(table.columns)} FROM {table.name} ORDER BY {table.order}"
        async for row in self.conn.cursor(sql, prefetch=_BATCH):
            yield tuple(row)


class _PostgresSink:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def is_empty(self) -> bool:
        return await self.conn.fetchval("SELECT 1 FROM conversations LIMIT 1") is None

    async def write(self, table: Table, rows: Sequence[tuple[Any, ...]]) -> None:
        # SQLite text may hold NUL, which PostgreSQL text cannot.
        records = [tuple(clean_text(v) for v in row) for row in rows]
        await self.conn.copy_records_to_table(table.name, records=records, columns=table.columns)

    async def finish(self) -> None:
        # Copied ids were given explicitly: move each sequence past the largest.
        for name in identity_tables():
            await self.conn.execute(
                f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), MAX(id))"
                f" FROM {name} HAVING MAX(id) IS NOT NULL"
            )


@contextlib.asynccontextmanager
async def _source(store: Store) -> AsyncIterator[Source]:
    if isinstance(store, SqliteStore):
        async with _sqlite(store, write=False) as db:
            yield _SqliteSource(db)
    elif isinstance(store, PostgresStore):
        async with (
            store.connection() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            yield _PostgresSource(conn)
    else:
        raise StoreError(f"cannot copy from a {type(store).__name__}")


@contextlib.asynccontextmanager
async def _sink(store: Store) -> AsyncIterator[Sink]:
    if isinstance(store, SqliteStore):
        async with _sqlite(store, write=True) as db:
            yield _SqliteSink(db)
    elif isinstance(store, PostgresStore):
        async with store.connection() as conn, conn.transaction():
            yield _PostgresSink(conn)
    else:
        raise StoreError(f"cannot copy to a {type(store).__name__}")


async def copy_store(source: Store, target: Store) -> dict[str, int]:
    """Copy every row of `source` into the empty `target` (both opened); rows per table."""
    try:
        return await _copy(source, target)
    except sqlite3.Error as exc:
        # SQLite messages name tables and constraints, not values.
        raise StoreError(f"sqlite {type(exc).__name__}: {str(exc)[:120]}") from exc
    except OSError as exc:
        raise StoreError(f"{type(exc).__name__}: {exc.strerror or 'os error'}") from exc


async def _copy(source: Store, target: Store) -> dict[str, int]:
    counts: dict[str, int] = {}
    async with _source(source) as reader, _sink(target) as writer:
        if not await writer.is_empty():
            raise StoreError("the target store already holds conversations; use an empty one")
        for table in TABLES:
            counts[table.name] = 0
            batch: list[tuple[Any, ...]] = []
            async for row in reader.rows(table):
                batch.append(row)
                if len(batch) >= _BATCH:
                    await writer.write(table, batch)
                    counts[table.name] += len(batch)
                    batch = []
            if batch:
                await writer.write(table, batch)
                counts[table.name] += len(batch)
        await writer.finish()
    return counts
