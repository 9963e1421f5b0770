"""The schema each migration leaves, on each backend, is the one recorded in `schema_golden.json`.

The golden file was written from the migrations as they stood before they were written
once for both databases (two copies of the DDL), so a refactoring of the history that
changes anything a database keeps about its schema fails here: tables, columns (type,
default, nullability, collation, identity), keys, indexes, constraints, sequences, the
SQL SQLite stores (white space folded) and the rows that record the version.

Two paths are checked: a new database stepped through every version (each step must
leave that version's schema), and a database at every older version upgraded to the
latest (it must end where a new one does). Rewrite the file only for a new migration:
`RECAP_TEST_POSTGRES_URL=... .venv/bin/python -m tests.store.test_migrations`.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiosqlite
import asyncpg
import pytest

from proxy.store.migrations import migrate_postgres, migrate_sqlite
from proxy.store.schema import LATEST
from tests.pg import fresh_schema, postgres_url

GOLDEN = Path(__file__).with_name("schema_golden.json")
Dump = dict[str, Any]


def _folded(sql: str | None) -> str | None:
    """SQLite keeps a CREATE statement as it was sent: compare it with white space folded."""
    if sql is None:
        return None
    text = re.sub(r"\s+", " ", sql).strip()
    text = re.sub(r"\(\s", "(", text)
    text = re.sub(r"\s\)", ")", text)
    return re.sub(r"\s*,\s*", ", ", text)


async def sqlite_dump(db: aiosqlite.Connection) -> Dump:
    """Everything SQLite keeps about the schema, and the recorded versions."""

    async def rows(sql: str) -> list[list[Any]]:
        return [list(r) for r in await db.execute_fetchall(sql)]

    master = await rows("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name")
    tables: Dump = {}
    for kind, name, _, _ in master:
        if kind != "table":
            continue
        indexes: Dump = {}
        for index in await rows(f"PRAGMA index_list({name})"):
            # (seq, name, unique, origin, partial): the seq is the order of creation
            indexes[index[1]] = {
                "unique": index[2],
                "origin": index[3],
                "partial": index[4],
                "columns": await rows(f"PRAGMA index_xinfo({index[1]})"),
            }
        tables[name] = {
            "columns": await rows(f"PRAGMA table_xinfo({name})"),
            "indexes": indexes,
            "foreign_keys": await rows(f"PRAGMA foreign_key_list({name})"),
            "list": await rows(f"PRAGMA table_list({name})"),
        }
    return {
        "master": [[k, n, t, _folded(s)] for k, n, t, s in master],
        "tables": tables,
        "versions": await rows("SELECT version, name FROM schema_version ORDER BY version"),
        "user_version": await rows("PRAGMA user_version"),
    }


async def postgres_dump(conn: Any, schema: str) -> Dump:
    """Everything PostgreSQL's catalogues say about the schema's relations, and the versions
    (the schema's random name replaced by `<schema>`)."""

    async def rows(sql: str) -> list[list[Any]]:
        found = await conn.fetch(sql, schema)
        return [[_unnamed(v, schema) for v in r.values()] for r in found]

    return {
        "relations": await rows(
            "SELECT c.relname, c.relkind::text, c.relpersistence::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1"
            " ORDER BY c.relname"
        ),
        "columns": await rows(
            "SELECT table_name, ordinal_position, column_name, data_type, udt_name,"
            " character_maximum_length, numeric_precision, datetime_precision, column_default,"
            " is_nullable, collation_name, is_identity, identity_generation, identity_start,"
            " identity_increment, identity_maximum, identity_minimum, identity_cycle,"
            " is_generated FROM information_schema.columns WHERE table_schema = $1"
            " ORDER BY table_name, ordinal_position"
        ),
        "constraints": await rows(
            "SELECT t.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid),"
            " k.condeferrable, k.condeferred FROM pg_constraint k"
            " JOIN pg_class t ON t.oid = k.conrelid"
            " JOIN pg_namespace n ON n.oid = k.connamespace WHERE n.nspname = $1"
            " ORDER BY t.relname, k.conname"
        ),
        "indexes": await rows(
            "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = $1"
            " ORDER BY tablename, indexname"
        ),
        "sequences": await rows(
            "SELECT c.relname, s.seqtypid::regtype::text, s.seqstart, s.seqincrement, s.seqmax,"
            " s.seqmin, s.seqcache, s.seqcycle FROM pg_sequence s"
            " JOIN pg_class c ON c.oid = s.seqrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1"
            " ORDER BY c.relname"
        ),
        "versions": [
            list(r.values())
            for r in await conn.fetch("SELECT version, name FROM schema_version ORDER BY version")
        ],
    }


def _unnamed(value: Any, schema: str) -> Any:
    return value.replace(schema, "<schema>") if isinstance(value, str) else value


async def sqlite_steps(path: Path) -> dict[str, Dump]:
    """The schema after each version, one new database stepped through them all."""
    out: dict[str, Dump] = {}
    async with aiosqlite.connect(path, isolation_level=None) as db:
        for version in range(1, LATEST + 1):
            assert await migrate_sqlite(db, float(version), target=version) == version
            out[str(version)] = await sqlite_dump(db)
    return out


async def postgres_steps(url: str) -> dict[str, Dump]:
    out: dict[str, Dump] = {}
    conn = await asyncpg.connect(url)
    try:
        for version in range(1, LATEST + 1):
            schema, got = await migrate_postgres(conn, float(version), target=version)
            assert got == version
            out[str(version)] = await postgres_dump(conn, schema)
    finally:
        await conn.close()
    return out


def golden(backend: str) -> dict[str, Dump]:
    recorded: dict[str, dict[str, Dump]] = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return recorded[backend]


def assert_recorded(got: Any, recorded: Any, where: str = "") -> None:
    """`got` (as JSON holds it: lists, not tuples) is `recorded`; a failure names the part
    that differs (a version, a section, a table) instead of printing both schemas whole."""
    got = json.loads(json.dumps(got))
    if isinstance(got, dict) and isinstance(recorded, dict):
        assert sorted(got) == sorted(recorded), where
        for key in recorded:
            assert_recorded(got[key], recorded[key], f"{where}/{key}")
    else:
        assert got == recorded, where


async def test_sqlite_every_version_leaves_the_recorded_schema(tmp_path: Path) -> None:
    assert_recorded(await sqlite_steps(tmp_path / "recap.db"), golden("sqlite"))


async def test_postgres_every_version_leaves_the_recorded_schema() -> None:
    with fresh_schema(postgres_url()) as url:
        assert_recorded(await postgres_steps(url), golden("postgresql"))


@pytest.mark.parametrize("start", range(LATEST))
async def test_sqlite_upgrade_from_each_version_ends_at_the_latest(
    tmp_path: Path, start: int
) -> None:
    async with aiosqlite.connect(tmp_path / "recap.db", isolation_level=None) as db:
        if start:
            assert await migrate_sqlite(db, 1.0, target=start) == start
        assert await migrate_sqlite(db, 2.0) == LATEST
        assert_recorded(await sqlite_dump(db), golden("sqlite")[str(LATEST)])
        applied = await db.execute_fetchall("SELECT applied_at FROM schema_version")
        assert [r[0] for r in applied] == [1.0] * start + [2.0] * (LATEST - start)
        assert await migrate_sqlite(db, 3.0) == LATEST  # nothing left to do


@pytest.mark.parametrize("start", range(LATEST))
async def test_postgres_upgrade_from_each_version_ends_at_the_latest(start: int) -> None:
    with fresh_schema(postgres_url()) as url:
        conn = await asyncpg.connect(url)
        try:
            if start:
                assert (await migrate_postgres(conn, 1.0, target=start))[1] == start
            schema, version = await migrate_postgres(conn, 2.0)
            assert version == LATEST
            assert_recorded(await postgres_dump(conn, schema), golden("postgresql")[str(LATEST)])
            applied = await conn.fetch("SELECT applied_at FROM schema_version ORDER BY version")
            assert [r[0] for r in applied] == [1.0] * start + [2.0] * (LATEST - start)
            assert (await migrate_postgres(conn, 3.0))[1] == LATEST
        finally:
            await conn.close()


def test_the_sqlite_store_and_its_migrations_load_no_postgresql_driver() -> None:
    # migrations.py holds both databases' runners; a SQLite deployment must not need asyncpg.
    code = "import sys, proxy.store.sqlite; print('asyncpg' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def _write(tmp: Path) -> None:
    with fresh_schema(postgres_url()) as url:
        recorded = {
            "sqlite": await sqlite_steps(tmp / "recap.db"),
            "postgresql": await postgres_steps(url),
        }
    text = json.dumps(recorded, indent=1, sort_keys=True)
    # One row a line: a list that holds no list or object is written on one line.
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", _one_line, text)
    GOLDEN.write_text(text + "\n", encoding="utf-8")


def _one_line(match: re.Match[str]) -> str:
    return "[" + re.sub(r"\s*\n\s*", " ", match[1]) + "]"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_write(Path(tmp)))
    print(f"wrote {GOLDEN}", file=sys.stderr)
