"""Versioned schema migrations for the SQLite store.

Runs once when the store opens, before any request touches it. Each migration is
a list of single statements (never `executescript`, which commits on its own) and
is applied inside one write transaction together with its `schema_version` row,
so a crash mid-migration leaves the previous schema intact and two proxies
starting at once take turns: the second finds nothing left to do.

The SQL sticks to what PostgreSQL also accepts where that costs nothing (ON
CONFLICT, composite keys, ON DELETE CASCADE); the PostgreSQL backend keeps its
own list because id columns and types differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiosqlite

from proxy.store.rekey import EVENT_TYPES, rekey


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]
    # After the statements, re-key the archive to whole-message fingerprints (`rekey.py`).
    rekey: bool = False


_CONV_FK = "FOREIGN KEY (tenant, key) REFERENCES conversations (tenant, key) ON DELETE CASCADE"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "initial schema",
        (
            """CREATE TABLE conversations (
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                current_version INTEGER,
                message_count INTEGER NOT NULL DEFAULT 0,
                tokens_saved INTEGER NOT NULL DEFAULT 0,
                compact_count INTEGER NOT NULL DEFAULT 0,
                PRIMARY KEY (tenant, key)
            )""",
            "CREATE INDEX conversations_updated ON conversations (updated_at)",
            "CREATE INDEX conversations_tenant_updated ON conversations (tenant, updated_at)",
            f"""CREATE TABLE summary_versions (
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                version INTEGER NOT NULL,
                summary TEXT NOT NULL,
                covered INTEGER NOT NULL,
                boundary_hash TEXT NOT NULL,
                compact_count INTEGER NOT NULL,
                input_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                model TEXT NOT NULL,
                reason TEXT NOT NULL,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                PRIMARY KEY (tenant, key, version),
                {_CONV_FK}
            )""",
            f"""CREATE TABLE compactions (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                layer TEXT NOT NULL,
                reason TEXT NOT NULL,
                outcome TEXT NOT NULL,
                detail TEXT NOT NULL,
                tokens_before INTEGER NOT NULL,
                tokens_after INTEGER NOT NULL,
                chars_before INTEGER NOT NULL,
                chars_after INTEGER NOT NULL,
                model TEXT NOT NULL,
                duration_ms INTEGER NOT NULL,
                created_at REAL NOT NULL,
                {_CONV_FK}
            )""",
            "CREATE INDEX compactions_conv ON compactions (tenant, key, id)",
            # id keeps archive order; the unique key is what makes archiving idempotent.
            f"""CREATE TABLE messages (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                fingerprint TEXT NOT NULL,
                body TEXT NOT NULL,
                first_seen_at REAL NOT NULL,
                UNIQUE (tenant, key, fingerprint),
                {_CONV_FK}
            )""",
            # AUTOINCREMENT: ids are never reused after a prune, so `tail --after ID` stays valid.
            f"""CREATE TABLE events (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                type TEXT NOT NULL,
                payload TEXT NOT NULL,
                created_at REAL NOT NULL,
                {_CONV_FK}
            )""",
            "CREATE INDEX events_conv ON events (tenant, key, id)",
            f"""CREATE TABLE loop_summaries (
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                turn_hash TEXT NOT NULL,
                covered_rounds INTEGER NOT NULL,
                summary TEXT NOT NULL,
                input_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                model TEXT NOT NULL,
                created_at REAL NOT NULL,
                expires_at REAL NOT NULL,
                PRIMARY KEY (tenant, key, turn_hash, covered_rounds),
                {_CONV_FK}
            )""",
            "CREATE TABLE heartbeat (id INTEGER PRIMARY KEY, at REAL NOT NULL)",
        ),
    ),
    Migration(
        2,
        "whole-message fingerprints, archived request parameters, rollbacks that stick",
        (
            # 1: discarded by a rollback past it, never matched again (base.set_current_version).
            "ALTER TABLE summary_versions ADD COLUMN rolled_back INTEGER NOT NULL DEFAULT 0",
            # A request's fields other than its messages (model, tools, sampling, ...),
            # each distinct set once per conversation; `request` events name them.
            f"""CREATE TABLE request_params (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                fingerprint TEXT NOT NULL,
                body TEXT NOT NULL,
                first_seen_at REAL NOT NULL,
                UNIQUE (tenant, key, fingerprint),
                {_CONV_FK}
            )""",
            # Working memory keyed by the old chain hashes: short-lived, made again on need.
            "DELETE FROM loop_summaries",
        ),
        rekey=True,
    ),
    # A working summary applies only to the history it was made from: covers_hash is the
    # chain hash of the client's messages through the last round it covers. Rows written
    # before it cannot be checked against a history, so they are dropped (working memory
    # is short-lived; the worst case is one more summarizer call).
    Migration(
        3,
        "loop summaries keyed by the chain hash of the rounds they cover",
        (
            "DROP TABLE loop_summaries",
            f"""CREATE TABLE loop_summaries (
                tenant TEXT NOT NULL,
                key TEXT NOT NULL,
                turn_hash TEXT NOT NULL,
                covered_rounds INTEGER NOT NULL,
                summary TEXT NOT NULL,
                input_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                model TEXT NOT NULL,
                created_at REAL NOT NULL,
                expires_at REAL NOT NULL,
                covers_hash TEXT NOT NULL DEFAULT '',
                PRIMARY KEY (tenant, key, turn_hash, covered_rounds, covers_hash),
                {_CONV_FK}
            )""",
        ),
    ),
    # Values set once per deployment and shared by every replica on this store: the key
    # that authenticates the compaction references Recap hands to clients (docs/codex.md).
    Migration(
        4,
        "per-deployment values",
        ("CREATE TABLE deployment (name TEXT NOT NULL PRIMARY KEY, value TEXT NOT NULL)",),
    ),
    # How far each process's archive journal is in the store (proxy/archive/journal.py), written
    # in the transaction of the records it counts: a journal replayed after a crash
    # stores each record exactly once.
    Migration(
        5,
        "archive journal marks",
        (
            "CREATE TABLE journal_marks (owner TEXT NOT NULL PRIMARY KEY,"
            " segment INTEGER NOT NULL, position INTEGER NOT NULL)",
        ),
    ),
)

LATEST = MIGRATIONS[-1].version


class SchemaTooNew(Exception):
    """The database was migrated by a newer proxy; refusing to guess at its schema."""


async def migrate(db: aiosqlite.Connection, now: float, target: int | None = None) -> int:
    """Apply every migration newer than the database's version (up to `target`, tests
    only: an old schema to upgrade from); return the final version.

    `db` must be in autocommit mode (isolation_level=None): transactions here are explicit.
    """
    await db.execute(
        "CREATE TABLE IF NOT EXISTS schema_version ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
    )
    # IMMEDIATE takes the write lock before reading the version, so a second
    # process starting at the same moment waits (busy_timeout) and then sees ours.
    await db.execute("BEGIN IMMEDIATE")
    try:
        async with db.execute("SELECT MAX(version) FROM schema_version") as cur:
            row = await cur.fetchone()
        current = int(row[0]) if row is not None and row[0] is not None else 0
        if current > LATEST:
            raise SchemaTooNew(f"database schema v{current} is newer than this proxy (v{LATEST})")
        for migration in MIGRATIONS:
            if migration.version <= current or (target is not None and migration.version > target):
                continue
            for statement in migration.statements:
                await db.execute(statement)
            if migration.rekey:
                await _rekey(db)
            await db.execute(
                "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, now),
            )
            current = migration.version
    except BaseException:
        await db.rollback()
        raise
    await db.commit()
    return current


async def _rekey(db: aiosqlite.Connection) -> None:
    """Whole-message fingerprints for an archive written before them (see `rekey.py`)."""
    where = "WHERE tenant = ? AND key = ?"
    kinds = ", ".join(f"'{t}'" for t in EVENT_TYPES)
    for tenant, key in list(await db.execute_fetchall("SELECT tenant, key FROM conversations")):
        conv = (tenant, key)
        changes = rekey(
            [
                (r[0], r[1], r[2])
                for r in await db.execute_fetchall(
                    f"SELECT id, fingerprint, body FROM messages {where} ORDER BY id", conv
                )
            ],
            [
                (r[0], r[1], r[2])
                for r in await db.execute_fetchall(
                    f"SELECT id, type, payload FROM events {where} AND type IN ({kinds})"
                    " ORDER BY id",
                    conv,
                )
            ],
            [
                (r[0], r[1], r[2])
                for r in await db.execute_fetchall(
                    f"SELECT version, covered, boundary_hash FROM summary_versions {where}", conv
                )
            ],
        )
        await db.executemany(
            "UPDATE messages SET fingerprint = ? WHERE id = ?",
            [(fp, row_id) for row_id, fp in changes.messages],
        )
        await db.executemany(
            "UPDATE events SET payload = ? WHERE id = ?",
            [(payload, event_id) for event_id, payload in changes.events],
        )
        await db.executemany(
            f"UPDATE summary_versions SET boundary_hash = ? {where} AND version = ?",
            [(h, tenant, key, version) for version, h in changes.summaries],
        )
