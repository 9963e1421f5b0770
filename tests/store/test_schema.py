"""The schema history (`schema.py`), written once, gives both backends the same tables with
the same columns in the same order: the shared queries (`sql.py`) and `recap
migrate-store`'s column-for-column copy rely on it. What each version leaves on each
database, to the type, is in test_migrations.py."""

from __future__ import annotations

from pathlib import Path

import aiosqlite
import asyncpg
import pytest

from proxy.store.migrations import migrate_postgres, migrate_sqlite
from proxy.store.schema import (
    HISTORY,
    LATEST,
    POSTGRES,
    SQLITE,
    VERSIONS,
    Rekey,
    columns,
    identity_tables,
)
from proxy.store.transfer import TABLES
from tests.pg import fresh_schema, postgres_url

pytestmark = pytest.mark.quick

Schema = dict[str, list[tuple[str, bool]]]  # table -> (column, NOT NULL) in order


async def sqlite_schema(db: aiosqlite.Connection) -> Schema:
    tables = await db.execute_fetchall(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    )
    out: Schema = {}
    for (name,) in tables:
        rows = await db.execute_fetchall(f"PRAGMA table_info({name})")
        # An INTEGER PRIMARY KEY is never NULL, whatever table_info says.
        out[name] = [(r[1], bool(r[3]) or bool(r[5])) for r in rows]
    return out


async def postgres_schema(conn: asyncpg.Connection, schema: str) -> Schema:
    rows = await conn.fetch(
        "SELECT table_name, column_name, is_nullable FROM information_schema.columns"
        " WHERE table_schema = $1 ORDER BY table_name, ordinal_position",
        schema,
    )
    out: Schema = {}
    for r in rows:
        out.setdefault(r["table_name"], []).append((r["column_name"], r["is_nullable"] == "NO"))
    return out


def names(schema: Schema) -> dict[str, tuple[str, ...]]:
    """The tables the history made (schema_version is the runner's), with their columns."""
    return {t: tuple(c for c, _ in cols) for t, cols in schema.items() if t != "schema_version"}


async def test_both_backends_define_the_same_tables_and_columns(tmp_path: Path) -> None:
    async with aiosqlite.connect(tmp_path / "recap.db", isolation_level=None) as db:
        await migrate_sqlite(db, 0.0)
        lite = await sqlite_schema(db)
    with fresh_schema(postgres_url()) as url:
        conn = await asyncpg.connect(url)
        try:
            schema, _ = await migrate_postgres(conn, 0.0)
            pg = await postgres_schema(conn, schema)
            identities = await conn.fetch(
                "SELECT table_name FROM information_schema.columns"
                " WHERE table_schema = $1 AND is_identity = 'YES' ORDER BY table_name",
                schema,
            )
        finally:
            await conn.close()
    assert sorted(lite) == sorted(pg)
    for table in lite:
        assert lite[table] == pg[table], table
    # The history's own account of its tables is what the databases hold.
    assert names(lite) == columns()
    assert sorted(identity_tables()) == [r[0] for r in identities]
    # migrate-store copies every table that holds data, with every column.
    for t in TABLES:
        assert list(t.columns) == [c for c, _ in lite[t.name]], t.name
    assert {t.name for t in TABLES} == set(lite) - {"heartbeat", "schema_version", "journal_marks"}


async def test_the_columns_of_every_version_are_the_ones_it_leaves(tmp_path: Path) -> None:
    async with aiosqlite.connect(tmp_path / "recap.db", isolation_level=None) as db:
        for version in range(1, LATEST + 1):
            await migrate_sqlite(db, 0.0, target=version)
            assert names(await sqlite_schema(db)) == columns(version), version
            autoincrement = await db.execute_fetchall(
                "SELECT name FROM sqlite_master WHERE sql LIKE '%AUTOINCREMENT%' ORDER BY name"
            )
            assert sorted(identity_tables(version)) == [r[0] for r in autoincrement]
    assert columns(1)["loop_summaries"][-1] == "expires_at"
    assert columns(3)["loop_summaries"][-1] == "covers_hash"
    assert "request_params" not in columns(1) and "request_params" in columns(2)


def test_the_history_is_numbered_in_order_and_every_slot_is_filled() -> None:
    assert [m.version for m in HISTORY] == list(range(1, LATEST + 1))
    for dialect in (SQLITE, POSTGRES):
        for migration in HISTORY:
            for step in migration.steps:
                if not isinstance(step, Rekey):
                    assert "{" not in dialect.sql(step), (dialect.name, step)
        assert "{" not in dialect.sql(VERSIONS)
    assert SQLITE.sql("x {KEY_TEXT} {INT64} {FLOAT64}") == "x TEXT INTEGER REAL"
    assert POSTGRES.sql("x {KEY_TEXT} '{{}}'") == "x TEXT COLLATE \"C\" '{}'"
