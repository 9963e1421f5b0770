"""Schema v2 re-keys an archive written with the old, partial fingerprints (both backends).

An archive at schema v1 is written row by row as the old proxy wrote it (keys from six
fields only, events naming those keys, a summary matched by the old chain hash); the
current store opens it, and then every message has its whole-message key, the events
name the new keys, and the summary still applies to the same history.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import aiosqlite
import asyncpg
import pytest

from proxy.history.messages import chain_hashes, chain_of, fingerprint, split_pinned
from proxy.store import ConversationRef, open_store
from proxy.store.migrations import migrate_postgres, migrate_sqlite
from proxy.store.rekey import rekey
from tests.pg import fresh_schema, postgres_url

pytestmark = pytest.mark.quick

_OLD_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call")


def old_fingerprint(message: dict[str, Any]) -> str:
    """The fingerprint of schema v1 (5725a87): six fields, nulls left out."""
    identity = {k: message[k] for k in _OLD_FIELDS if message.get(k) is not None}
    canonical = json.dumps(identity, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Plan a trip.", "name": None},
    {"role": "assistant", "content": "Where to?", "reasoning_content": "THOUGHT-1"},
    {"role": "user", "content": "Paris."},
    {"role": "assistant", "content": None, "refusal": "I can't book that."},
    {"role": "user", "content": "Why not?"},
]
CONV = ("default", "old")
COVERED = 3  # the summary stands for the first three non-pinned messages


def v1_rows() -> dict[str, list[tuple[Any, ...]]]:
    """The rows a v1 proxy left after one compacted request and one trim."""
    old = [old_fingerprint(m) for m in HISTORY]
    pinned = len(split_pinned(HISTORY)[0])
    boundary = chain_of(old[pinned:])[COVERED - 1]
    request = {"request_id": "r1", "messages": old, "sent": None, "model": "m"}
    trim = {"request_id": "r1", "trimmed": 1, "originals": [old[4]]}
    return {
        "conversations": [(*CONV, 1.0, 2.0, 1, len(HISTORY), 0, 1)],
        "messages": [
            (i + 1, *CONV, fp, json.dumps(m), 1.0)
            for i, (fp, m) in enumerate(zip(old, HISTORY, strict=True))
        ],
        "events": [
            (1, *CONV, "request", json.dumps(request), 1.0),
            (2, *CONV, "trim", json.dumps(trim), 1.0),
            (3, *CONV, "response", json.dumps({"request_id": "r1"}), 1.0),
        ],
        "summary_versions": [
            (*CONV, 1, "the summary", COVERED, boundary, 1, 10, 5, "m", "r", 1.0, 1.0)
        ],
    }


COLUMNS = {
    "conversations": "tenant, key, created_at, updated_at, current_version, message_count,"
    " tokens_saved, compact_count",
    "messages": "id, tenant, key, fingerprint, body, first_seen_at",
    "events": "id, tenant, key, type, payload, created_at",
    "summary_versions": "tenant, key, version, summary, covered, boundary_hash, compact_count,"
    " input_tokens, output_tokens, model, reason, created_at, updated_at",
}


async def write_v1_sqlite(path: Path) -> None:
    async with aiosqlite.connect(path, isolation_level=None) as db:
        assert await migrate_sqlite(db, 0.0, target=1) == 1
        for table, rows in v1_rows().items():
            marks = ", ".join("?" * len(rows[0]))
            await db.executemany(f"INSERT INTO {table} ({COLUMNS[table]}) VALUES ({marks})", rows)


async def write_v1_postgres(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        _, version = await migrate_postgres(conn, 0.0, target=1)
        assert version == 1
        for table, rows in v1_rows().items():
            marks = ", ".join(f"${i + 1}" for i in range(len(rows[0])))
            await conn.executemany(f"INSERT INTO {table} ({COLUMNS[table]}) VALUES ({marks})", rows)
    finally:
        await conn.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_a_v1_archive_is_rekeyed_and_its_summary_still_applies(
    backend: str, tmp_path: Path
) -> None:
    if backend == "sqlite":
        path = tmp_path / "recap.db"
        await write_v1_sqlite(path)
        await check_rekeyed(f"sqlite:///{path}", tmp_path)
    else:
        with fresh_schema(postgres_url()) as url:
            await write_v1_postgres(url)
            await check_rekeyed(url, tmp_path)


async def check_rekeyed(url: str, tmp_path: Path) -> None:
    new = [fingerprint(m) for m in HISTORY]
    old = [old_fingerprint(m) for m in HISTORY]
    assert new[2] != old[2] and new[1] != old[1] and new[4] != old[4]  # the test means it
    conv = ConversationRef(*CONV)
    async with open_store(url, str(tmp_path)) as store:
        archived = await store.archived_messages(conv)
        assert list(archived) == new
        assert [json.loads(b) for b in archived.values()] == HISTORY
        events = [e async for e in store.events(conv)]
        assert events[0].payload["messages"] == new
        assert events[1].payload["originals"] == [new[4]]
        assert events[2].payload == {"request_id": "r1"}
        # The summary is matched by the new chain of the same history.
        _, body = split_pinned(HISTORY)
        found = await store.matching_summary(conv, chain_hashes(body))
        assert found is not None and found.version == 1 and found.covered == COVERED
    # Opening again finds nothing left to do.
    async with open_store(url, str(tmp_path)) as store:
        assert list(await store.archived_messages(conv)) == new


def test_rekey_leaves_unknown_keys_and_other_events_alone() -> None:
    m = {"role": "user", "content": "hi", "x": 1}
    changes = rekey(
        [(1, "old-key", json.dumps(m))],
        [
            (1, "request", json.dumps({"messages": ["old-key", "not-archived"], "sent": None})),
            (2, "request", json.dumps({"messages": ["not-archived"]})),
        ],
        [(1, 1, "no-such-boundary")],
    )
    assert changes.messages == [(1, fingerprint(m))]
    assert [json.loads(p)["messages"] for _, p in changes.events] == [
        [fingerprint(m), "not-archived"]
    ]
    assert changes.summaries == []  # no request it covered: left as it was (never matches)
