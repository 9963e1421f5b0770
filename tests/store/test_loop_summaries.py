"""Loop working summaries are found by the chain hash of the rounds they cover (issue 12.1)."""

from __future__ import annotations

from pathlib import Path

import aiosqlite
import pytest

from proxy.store import ConversationRef, LoopSummary, Store, open_store
from proxy.store.migrations import migrate_sqlite
from tests.store.conftest import FakeClock

pytestmark = pytest.mark.quick

CONV = ConversationRef("acme", "conv-1")


def covering(turn: str, rounds: int, covers: str, now: float, ttl: float = 1000) -> LoopSummary:
    return LoopSummary(turn, rounds, f"{covers} summary", 10, 2, "m", now, now + ttl, covers)


async def test_found_only_by_what_it_covers(store: Store, clock: FakeClock) -> None:
    t0 = clock.now
    await store.put_loop_summary(CONV, covering("turn", 3, "h3", t0))
    await store.put_loop_summary(CONV, covering("turn", 6, "h6", t0, ttl=100))
    # A fork: the same turn and round count, other rounds. Both are kept.
    await store.put_loop_summary(CONV, covering("turn", 6, "fork6", t0))

    async def found(*covers: str, now: float = t0) -> str | None:
        got = await store.find_loop_summary(CONV, list(covers), now)
        return None if got is None else got.covers_hash

    assert await found("h1", "h2", "h3", "h4", "h5", "h6") == "h6"  # the longest match
    assert await found("h1", "h3", "x6") == "h3"
    assert await found("fork6", "h3") == "fork6"
    assert await found("other") is None
    assert await found() is None
    assert await found("h3", "h6", now=t0 + 100) == "h3"  # the 6-round one expired
    assert await store.find_loop_summary(ConversationRef("acme", "x"), ["h3"], t0) is None
    got = await store.find_loop_summary(CONV, ["fork6"], t0)
    assert got == covering("turn", 6, "fork6", t0)


async def test_migration_drops_unverifiable_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        assert await migrate_sqlite(db, 0.0, target=1) == 1
        await db.execute("INSERT INTO conversations VALUES ('acme', 'conv-1', 0, 0, NULL, 0, 0, 0)")
        await db.execute(
            "INSERT INTO loop_summaries VALUES"
            " ('acme', 'conv-1', 't', 3, 'old', 1, 1, 'm', 0, 1e12)"
        )
    store = open_store(f"sqlite:///{path}", str(tmp_path))
    await store.open()
    try:
        assert await store.find_loop_summary(CONV, [""], 0.0) is None
        await store.put_loop_summary(CONV, covering("t", 3, "h3", 0.0, ttl=1e12))
        assert (await store.find_loop_summary(CONV, ["h3"], 1.0)) is not None
    finally:
        await store.close()
