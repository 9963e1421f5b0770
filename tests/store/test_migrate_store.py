"""`recap migrate-store FROM TO`: SQLite -> PostgreSQL -> SQLite, nothing lost on the way."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.history.messages import chain_hashes, fingerprint, split_pinned
from proxy.ops.cli import main
from proxy.store import (
    CompactionRecord,
    ConversationRef,
    LoopSummary,
    NewSummary,
    Store,
    open_store,
)
from proxy.store.base import ExchangeRecord
from tests.store.conftest import FakeClock

CONVS = [
    ConversationRef("acme", "alpha"),
    ConversationRef("acme", "beta/β"),
    ConversationRef("b", "x"),
]
TURNS = ("turn-1", "turn-2")


async def fill(store: Store, clock: FakeClock, sessions: list[list[dict[str, Any]]]) -> None:
    """Every kind of row, in every table, with rollbacks and mixed outcomes."""
    longest = sorted(sessions, key=len, reverse=True)
    for n, conv in enumerate(CONVS):
        _, body = split_pinned(longest[n])
        hashes = chain_hashes(body)
        pairs = [(fingerprint(m), json.dumps(m, ensure_ascii=False)) for m in body]
        await store.archive_messages(conv, pairs[:10])
        for covered in (4, 8, 12):
            clock.advance(5)
            await store.add_summary_version(
                conv,
                NewSummary(
                    f"摘要 {conv.key} 到 {covered}",
                    covered,
                    hashes[covered - 1],
                    900,
                    90,
                    "m",
                    "trigger_ratio",
                ),
            )
            await store.record_compaction(
                conv,
                CompactionRecord(
                    "session",
                    "trigger_ratio",
                    "ok" if covered != 8 else "failed",
                    "" if covered != 8 else "timeout",
                    9000,
                    3000,
                    36000,
                    12000,
                    "m",
                    1500,
                ),
            )
        await store.record_exchanges(
            [
                ExchangeRecord(
                    conv,
                    pairs[5:],
                    [
                        ("request", {"messages": [p[0] for p in pairs]}),
                        ("response", {"status": 200}),
                    ],
                )
            ]
        )
        await store.append_event(conv, "trim", {"trimmed": n})
        for turn in TURNS:
            await store.put_loop_summary(
                conv,
                LoopSummary(
                    turn, 3 + n, f"working memory {turn}", 10, 2, "m", clock.now, clock.now + 3600
                ),
            )
    await store.set_current_version(CONVS[0], 2)
    await store.set_current_version(CONVS[1], None)


async def snapshot(store: Store) -> list[Any]:
    """Everything the Store interface can tell about every conversation."""
    out: list[Any] = []
    for info in await store.list_conversations(None, limit=1000):
        conv = ConversationRef(info.tenant, info.key)
        archived = await store.archived_messages(conv)
        out.append(
            (
                info,
                await store.summary_versions(conv),
                list(archived.items()),
                await store.compactions(conv),
                [e async for e in store.events(conv)],
                [await store.get_loop_summary(conv, t, 100, 0.0) for t in TURNS],
            )
        )
    return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def opened(url: str, base: str, clock: FakeClock | None = None) -> Store:
    store = open_store(url, base, clock=clock) if clock else open_store(url, base)
    await store.open()
    return store


async def fill_at(url: str, base: str, clock: FakeClock, sessions: Any) -> list[Any]:
    store = await opened(url, base, clock)
    try:
        await fill(store, clock, sessions)
        return await snapshot(store)
    finally:
        await store.close()


async def snapshot_at(url: str, base: str) -> list[Any]:
    store = await opened(url, base)
    try:
        return await snapshot(store)
    finally:
        await store.close()


def test_sqlite_to_postgres_and_back(
    pg_url: str,
    tmp_path: Path,
    sessions: list[list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = str(tmp_path)
    sqlite_url = f"sqlite:///{tmp_path / 'old.db'}"
    original = run(fill_at(sqlite_url, base, FakeClock(), sessions))
    assert len(original) == 3

    assert main(["migrate-store", sqlite_url, pg_url]) == 0
    printed = capsys.readouterr().out
    assert "3 conversations" in printed and "9 summary_versions" in printed
    assert run(snapshot_at(pg_url, base)) == original

    async def new_ids() -> tuple[int, int]:
        async with open_store(pg_url, base) as store:
            conv = CONVS[0]
            highest = max([e.id async for e in store.events(conv)])
            return highest, await store.append_event(conv, "request", {"after": "migration"})

    highest, added = run(new_ids())
    assert added > highest  # the sequence continues after the copied ids

    back = f"sqlite:///{tmp_path / 'back.db'}"
    assert main(["migrate-store", pg_url, back]) == 0
    # The copy back holds what PostgreSQL holds now: the original plus the new event.
    again = run(snapshot_at(back, base))
    assert again == run(snapshot_at(pg_url, base))
    assert again[1:] == original[1:] and again[0][4][:-1] == original[0][4]


def test_refuses_a_target_that_has_conversations(
    pg_url: str,
    tmp_path: Path,
    sessions: list[list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = str(tmp_path)
    sqlite_url = f"sqlite:///{tmp_path / 'old.db'}"
    run(fill_at(sqlite_url, base, FakeClock(), sessions))
    run(fill_at(pg_url, base, FakeClock(5.0), sessions[3:]))
    before = run(snapshot_at(pg_url, base))
    assert main(["migrate-store", sqlite_url, pg_url]) == 1
    assert "already holds conversations" in capsys.readouterr().err
    assert run(snapshot_at(pg_url, base)) == before
    # A store that cannot be opened is an error too, and its password is not printed.
    assert main(["migrate-store", sqlite_url, "postgresql://u:hunter2@127.0.0.1:1/x"]) == 1
    assert "hunter2" not in capsys.readouterr().err
    # A source that does not exist is not created (as an empty store) and copied.
    missing = tmp_path / "missing.db"
    assert main(["migrate-store", f"sqlite:///{missing}", f"sqlite:///{tmp_path / 'n.db'}"]) == 1
    assert "no SQLite database" in capsys.readouterr().err and not missing.exists()
