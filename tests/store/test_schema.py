"""The two schema definitions (`migrations.py`, `pg_migrations.py`) give the same tables
with the same columns in the same order: the shared queries (`sql.py`) and `recap
migrate-store`'s column-for-column copy rely on it."""

from __future__ import annotations

from pathlib import Path

import aiosqlite
import asyncpg
import pytest

from proxy.store.migrations import LATEST
from proxy.store.migrations import migrate as sqlite_migrate
from proxy.store.pg_migrations import LATEST as PG_LATEST
from proxy.store.pg_migrations import migrate as pg_migrate
from proxy.store.transfer import TABLES
from tests.pg import fresh_schema, postgres_url

pytestmark = pytest.mark.quick

Schema = dict[str, list[tuple[str, bool]]]  # table -> (column, NOT NULL) in order


async def sqlite_schema(path: Path) -> Schema:
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await sqlite_migrate(db, 0.0)
        tables = await db.execute_fetchall(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
        out: Schema = {}
        for (name,) in tables:
            rows = await db.execute_fetchall(f"PRAGMA table_info({name})")
            # An INTEGER PRIMARY KEY is never NULL, whatever table_info says.
            out[name] = [(r[1], bool(r[3]) or bool(r[5])) for r in rows]
        return out


async def postgres_schema(url: str) -> Schema:
    conn = await asyncpg.connect(url)
    try:
        schema, _ = await pg_migrate(conn, 0.0)
        rows = await conn.fetch(
            "SELECT table_name, column_name, is_nullable FROM information_schema.columns"
            " WHERE table_schema = $1 ORDER BY table_name, ordinal_position",
            schema,
        )
    finally:
        await conn.close()
    out: Schema = {}
    for r in rows:
        out.setdefault(r["table_name"], []).append((r["column_name"], r["is_nullable"] == "NO"))
    return out


async def test_both_backends_define_the_same_tables_and_columns(tmp_path: Path) -> None:
    assert LATEST == PG_LATEST
    lite = await sqlite_schema(tmp_path / "recap.db")
    with fresh_schema(postgres_url()) as url:
        pg = await postgres_schema(url)
    assert sorted(lite) == sorted(pg)
    for table in lite:
        assert lite[table] == pg[table], table
    # migrate-store copies every table that holds data, with every column.
    for t in TABLES:
        assert list(t.columns) == [c for c, _ in lite[t.name]], t.name
    assert {t.name for t in TABLES} == set(lite) - {"heartbeat", "schema_version", "journal_marks"}
