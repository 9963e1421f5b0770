"""The store contract, run against every backend (see conftest.BACKENDS).

Backend-specific behaviour (file errors, URL parsing, schema_version rows) is at
the end, in tests that take no `store` fixture.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from proxy.history.messages import chain_hashes, fingerprint, split_pinned
from proxy.planning.outcome import Layer
from proxy.store import (
    CompactionRecord,
    ConversationRef,
    KeyedLocks,
    LoopSummary,
    NewSummary,
    NotFound,
    SqliteStore,
    Store,
    StoreError,
    open_store,
    pick_matching,
    sqlite_path,
)
from proxy.store.base import ExchangeRecord, ListPosition
from proxy.store.postgres import PostgresStore
from proxy.store.schema import LATEST
from tests.store.conftest import FakeClock

REPO = Path(__file__).resolve().parents[2]
CONV = ConversationRef("acme", "conv-1")


def body(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False)


def summary_at(hashes: Sequence[str], covered: int, text: str = "") -> NewSummary:
    return NewSummary(
        summary=text or f"summary of {covered}",
        covered=covered,
        boundary_hash=hashes[covered - 1],
        input_tokens=1000 + covered,
        output_tokens=100 + covered,
        model="gpt-4o-mini",
        reason="min_new_tokens",
    )


def edited(messages: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    out = list(messages)
    out[index] = {**out[index], "content": f"{out[index].get('content')} (edited)"}
    return out


def compaction(outcome: str, before: int, after: int, created_at: float = 0.0) -> CompactionRecord:
    return CompactionRecord(
        layer="session",
        reason="trigger_ratio",
        outcome=outcome,  # type: ignore[arg-type]
        detail="",
        tokens_before=before,
        tokens_after=after,
        chars_before=before * 4,
        chars_after=after * 4,
        model="gpt-4o-mini",
        duration_ms=1234,
        created_at=created_at,
    )


def loop_summary(turn: str, rounds: int, created: float, ttl: float) -> LoopSummary:
    return LoopSummary(turn, rounds, f"{rounds} rounds done", 500, 50, "m", created, created + ttl)


@pytest.fixture
def history(sessions: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The non-pinned part of a real 62-message session."""
    longest = max(sessions, key=len)
    _, rest = split_pinned(longest)
    return [dict(m) for m in rest]


# --- schema and lifecycle -------------------------------------------------------------


async def test_open_twice_and_reopen_keep_schema_and_data(
    store: Store, store_factory: Callable[[], Store], history: list[dict[str, Any]]
) -> None:
    hashes = chain_hashes(history)
    await store.add_summary_version(CONV, summary_at(hashes, 10))
    await store.open()  # a second open of the same instance is a no-op
    await store.close()

    again = store_factory()
    async with again:
        current = await again.current_summary(CONV)
        assert current is not None and current.covered == 10
        assert (await again.add_summary_version(CONV, summary_at(hashes, 20))).version == 2


async def test_two_stores_migrating_the_same_new_database_at_once(
    store_factory: Callable[[], Store], history: list[dict[str, Any]]
) -> None:
    first, second = store_factory(), store_factory()
    await asyncio.gather(first.open(), second.open())
    try:
        hashes = chain_hashes(history)
        await first.add_summary_version(CONV, summary_at(hashes, 5))
        got = await second.current_summary(CONV)
        assert got is not None and got.covered == 5
    finally:
        await first.close()
        await second.close()


async def test_check_writable_and_closed_store(store_factory: Callable[[], Store]) -> None:
    s = store_factory()
    with pytest.raises(StoreError):
        await s.check_writable()  # not opened yet
    await s.open()
    await s.check_writable()
    await s.close()
    with pytest.raises(StoreError):
        await s.append_event(CONV, "request", {})
    await s.close()  # closing twice is harmless


# --- summary versions -----------------------------------------------------------------


async def test_version_matching(store: Store, history: list[dict[str, Any]]) -> None:
    hashes = chain_hashes(history)
    v1 = await store.add_summary_version(CONV, summary_at(hashes, 8))
    v2 = await store.add_summary_version(CONV, summary_at(hashes, 16))
    v3 = await store.add_summary_version(CONV, summary_at(hashes, 24))
    assert (v1.version, v2.version, v3.version) == (1, 2, 3)
    assert v3.current and v3.compact_count == 3

    # The client sent the same history plus more: the current version applies.
    got = await store.matching_summary(CONV, hashes)
    assert got is not None and got.version == 3 and got.current
    assert got.summary == "summary of 24" and got.boundary_hash == hashes[23]

    # Message 20 edited: v3's boundary no longer matches; v2 is the longest that does.
    got = await store.matching_summary(CONV, chain_hashes(edited(history, 20)))
    assert got is not None and got.version == 2 and not got.current

    # Message 10 edited: only v1 (8 messages) is still true.
    got = await store.matching_summary(CONV, chain_hashes(edited(history, 10)))
    assert got is not None and got.version == 1

    # Forked at the first message: nothing applies.
    assert await store.matching_summary(CONV, chain_hashes(edited(history, 0))) is None

    # A shorter request than the current summary covers: it is not applied.
    got = await store.matching_summary(CONV, hashes[:20])
    assert got is not None and got.version == 2
    assert await store.matching_summary(CONV, hashes[:7]) is None
    assert await store.matching_summary(CONV, []) is None

    # Another conversation with the same messages has no summary.
    assert await store.matching_summary(ConversationRef("acme", "other"), hashes) is None


async def test_matching_never_uses_versions_after_current(
    store: Store, history: list[dict[str, Any]]
) -> None:
    hashes = chain_hashes(history)
    for covered in (8, 16, 24):
        await store.add_summary_version(CONV, summary_at(hashes, covered))
    await store.set_current_version(CONV, 1)
    got = await store.matching_summary(CONV, hashes)
    assert got is not None and got.version == 1 and got.current
    await store.set_current_version(CONV, 2)
    got = await store.matching_summary(CONV, chain_hashes(edited(history, 12)))
    assert got is not None and got.version == 1


def test_pick_matching_prefers_most_covered_then_newest() -> None:
    hashes = ["a", "b", "c", "d"]
    versions = [(1, 2, "b"), (2, 3, "x"), (3, 2, "b"), (4, 1, "a"), (5, 3, "c")]
    assert pick_matching(versions, current=2, boundary_hashes=hashes) == 1
    assert pick_matching(versions, current=2, boundary_hashes=["z", "y", "w"]) is None
    assert pick_matching(versions, current=4, boundary_hashes=hashes) == 4  # current matches
    assert pick_matching(versions, current=5, boundary_hashes=hashes) == 5
    assert pick_matching(versions, current=5, boundary_hashes=hashes[:2]) == 3
    assert pick_matching([(1, 0, "")], current=1, boundary_hashes=hashes) is None


async def test_one_version_by_number_rolled_back_or_not(
    store: Store, history: list[dict[str, Any]]
) -> None:
    hashes = chain_hashes(history)
    for covered in (8, 16):
        await store.add_summary_version(CONV, summary_at(hashes, covered))
    await store.set_current_version(CONV, 1)
    one, two = await store.summary_version(CONV, 1), await store.summary_version(CONV, 2)
    assert one is not None and (one.summary, one.current, one.rolled_back) == (
        "summary of 8",
        True,
        False,
    )
    assert two is not None and (two.boundary_hash, two.rolled_back) == (hashes[15], True)
    assert await store.summary_version(CONV, 3) is None
    assert await store.summary_version(ConversationRef("acme", "nobody"), 1) is None


async def test_rollback_to_earlier_and_to_none(store: Store, history: list[dict[str, Any]]) -> None:
    hashes = chain_hashes(history)
    for covered in (8, 16, 24):
        await store.add_summary_version(CONV, summary_at(hashes, covered))

    await store.set_current_version(CONV, 1)
    current = await store.current_summary(CONV)
    assert current is not None and current.version == 1
    assert [v.current for v in await store.summary_versions(CONV)] == [True, False, False]

    await store.set_current_version(CONV, None)
    assert await store.current_summary(CONV) is None
    assert await store.matching_summary(CONV, hashes) is None
    assert len(await store.summary_versions(CONV)) == 3  # nothing is deleted

    with pytest.raises(NotFound):
        await store.set_current_version(CONV, 9)
    with pytest.raises(NotFound):
        await store.set_current_version(ConversationRef("acme", "nobody"), None)
    assert await store.current_summary(CONV) is None  # the failed calls changed nothing

    # A new compaction after a rollback takes the next free number and becomes current.
    v4 = await store.add_summary_version(CONV, summary_at(hashes, 12))
    assert v4.version == 4 and v4.compact_count == 4
    versions = await store.summary_versions(CONV)
    assert [(v.version, v.covered, v.current) for v in versions] == [
        (1, 8, False),
        (2, 16, False),
        (3, 24, False),
        (4, 12, True),
    ]
    info = await store.get_conversation(CONV)
    assert info is not None and info.current_version == 4 and info.compact_count == 4


async def test_rollback_sticks(store: Store, history: list[dict[str, Any]]) -> None:
    """Versions a rollback discarded are never matched again: not when newer versions
    take numbers above them, and not for a history they would still match."""
    hashes = chain_hashes(history)
    for covered in (8, 16, 24):
        await store.add_summary_version(CONV, summary_at(hashes, covered))
    await store.set_current_version(CONV, 1)
    assert [v.rolled_back for v in await store.summary_versions(CONV)] == [False, True, True]
    # A compaction of a forked history (matching none of them) becomes version 4 ...
    fork = chain_hashes(edited(history, 2))
    v4 = await store.add_summary_version(CONV, summary_at(fork, 30))
    assert v4.version == 4 and not v4.rolled_back
    # ... and the original history still gets version 1, never the discarded 2 or 3.
    found = await store.matching_summary(CONV, hashes)
    assert found is not None and found.version == 1
    found = await store.matching_summary(CONV, fork)
    assert found is not None and found.version == 4
    # Asked again (the SQLite store answers from its cache): the same.
    found = await store.matching_summary(CONV, hashes)
    assert found is not None and found.version == 1

    # To none: everything is discarded, also for later versions' matching.
    await store.set_current_version(CONV, None)
    v5 = await store.add_summary_version(CONV, summary_at(fork, 31))
    assert await store.matching_summary(CONV, hashes) is None
    assert [v.rolled_back for v in await store.summary_versions(CONV)] == [
        True,
        True,
        True,
        True,
        False,
    ]
    assert v5.version == 5

    # An operator may name a discarded version: it is current (and matched) again,
    # the versions after it are discarded, the others stay as they were.
    await store.set_current_version(CONV, 3)
    found = await store.matching_summary(CONV, hashes)
    assert found is not None and found.version == 3 and found.current
    versions = await store.summary_versions(CONV)
    assert [(v.version, v.rolled_back) for v in versions] == [
        (1, True),
        (2, True),
        (3, False),
        (4, True),
        (5, True),
    ]


async def test_summary_text_round_trips_exactly(
    store: Store, history: list[dict[str, Any]]
) -> None:
    text = (
        "用户 mia_li_3668 预订了 JFK→SEA 的单程机票（HAT136、HAT039），\n"
        "付款：certificate_7504069。"
    )
    added = await store.add_summary_version(CONV, summary_at(chain_hashes(history), 4, text))
    current = await store.current_summary(CONV)
    assert current == added
    assert current is not None and current.summary == text


# --- audit and archive ----------------------------------------------------------------


async def test_compactions_are_audited_and_only_ok_saves_tokens(
    store: Store, clock: FakeClock
) -> None:
    await store.record_compaction(CONV, compaction("ok", 30000, 8000))
    await store.record_compaction(CONV, compaction("failed", 30000, 30000, created_at=5.0))
    await store.record_compaction(CONV, compaction("skipped", 9000, 1000))
    await store.record_compaction(CONV, compaction("ok", 12000, 7000))
    records = await store.compactions(CONV)
    assert [r.outcome for r in records] == ["ok", "failed", "skipped", "ok"]
    assert records[0].created_at == clock.now  # stamped by the store when left at 0
    assert records[1].created_at == 5.0
    assert records[3] == compaction("ok", 12000, 7000, created_at=clock.now)
    info = await store.get_conversation(CONV)
    assert info is not None and info.tokens_saved == 22000 + 5000
    assert info.compact_count == 0  # counting compactions is add_summary_version's job


async def test_compactions_are_counted_across_layers_and_a_drop_is_not_one(
    store: Store,
) -> None:
    """The list's "Compactions": every layer's compaction that changed what was sent (a
    loop's working summaries and trims count as a session summary does), not the summary
    versions only; a failed or skipped attempt is not one, and neither is the last resort's
    drop, which saves nothing: it lost messages."""
    for layer, outcome in [
        (Layer.SESSION, "ok"),
        (Layer.LOOP, "ok"),
        (Layer.LOOP, "ok"),
        (Layer.TRIM, "ok"),
        (Layer.MANUAL, "ok"),
        (Layer.LOOP, "failed"),
        (Layer.SESSION, "skipped"),
        (Layer.FIT, "dropped"),
    ]:
        record = dataclasses.replace(compaction(outcome, 9000, 4000), layer=layer)
        await store.record_compaction(CONV, record)
    info = await store.get_conversation(CONV)
    assert info is not None and info.compactions_made == 5
    assert info.tokens_saved == 5 * 5000  # the drop saved nothing
    (listed,) = await store.list_conversations(CONV.tenant)
    assert listed.compactions_made == 5


async def test_archive_deduplicates(store: Store, history: list[dict[str, Any]]) -> None:
    pairs = [(fingerprint(m), body(m)) for m in history]
    first = await store.archive_messages(CONV, pairs[:30])
    assert first == len({fp for fp, _ in pairs[:30]})
    # The next request repeats the first 30 and brings 10 more.
    again = await store.archive_messages(CONV, pairs[:40])
    assert again == len({fp for fp, _ in pairs[:40]}) - first
    assert await store.archive_messages(CONV, pairs[:40]) == 0
    assert await store.archive_messages(CONV, []) == 0
    # The same message twice in one batch is stored once.
    assert await store.archive_messages(CONV, [pairs[45], pairs[45]]) == 1

    stored = await store.archived_messages(CONV)
    expected = dict([*pairs[:40], pairs[45]])
    assert stored == expected
    assert list(stored) == list(expected)  # archive order
    info = await store.get_conversation(CONV)
    assert info is not None and info.message_count == len(expected)

    wanted = [pairs[3][0], pairs[45][0], "0" * 64, pairs[3][0]]
    assert await store.archived_messages(CONV, wanted) == {
        pairs[3][0]: pairs[3][1],
        pairs[45][0]: pairs[45][1],
    }
    assert await store.archived_messages(CONV, []) == {}


async def test_archive_many_fingerprints_and_odd_text(store: Store) -> None:
    messages = [{"role": "user", "content": f"第 {i} 条消息"} for i in range(1500)]
    pairs = [(fingerprint(m), body(m)) for m in messages]
    assert await store.archive_messages(CONV, pairs) == 1500
    wanted = [fp for fp, _ in pairs[::2]] + ["f" * 64]
    got = await store.archived_messages(CONV, wanted)
    assert got == dict(pairs[::2])

    # A lone surrogate is valid in JSON text but not in UTF-8: the JSON value survives.
    odd = '{"role": "user", "content": "broken \ud83d emoji"}'
    assert await store.archive_messages(CONV, [("odd", odd)]) == 1
    stored = await store.archived_messages(CONV, ["odd"])
    assert json.loads(stored["odd"]) == json.loads(odd)

    # The same for a large non-ASCII text (checked in a worker thread, in slices), and one
    # that is valid UTF-8 is kept byte for byte.
    large = json.dumps({"content": "长" * 300_000 + "\udc00"}, ensure_ascii=False)
    fine = json.dumps({"content": "长" * 300_000}, ensure_ascii=False)
    await store.record_exchanges([ExchangeRecord(CONV, [("large", large), ("fine", fine)], [])])
    stored = await store.archived_messages(CONV, ["large", "fine"])
    assert json.loads(stored["large"]) == json.loads(large)
    assert stored["fine"] == fine


# --- events ---------------------------------------------------------------------------


async def test_events_in_order_across_pages(store: Store) -> None:
    other = ConversationRef("acme", "conv-2")
    ids = []
    for i in range(23):
        ids.append(await store.append_event(CONV, "request", {"n": i, "text": "你好"}))
        await store.append_event(other, "response", {"n": i})
    assert ids == sorted(ids) and len(set(ids)) == 23

    events = [e async for e in store.events(CONV, page_size=5)]
    assert [e.id for e in events] == ids
    assert [e.payload for e in events] == [{"n": i, "text": "你好"} for i in range(23)]
    assert {e.type for e in events} == {"request"}

    after = [e.payload["n"] async for e in store.events(CONV, after_id=ids[9], page_size=5)]
    assert after == list(range(10, 23))
    assert [e async for e in store.events(CONV, after_id=ids[-1])] == []

    # Pages are separate reads: events appended while streaming are still delivered.
    seen = []
    async for e in store.events(CONV, page_size=4):
        seen.append(e.payload["n"])
        if e.payload["n"] == 10:
            await store.append_event(CONV, "rollback", {"n": 23})
    assert seen == list(range(24))


async def test_events_default_page_size(store: Store) -> None:
    for i in range(501):
        await store.append_event(CONV, "trim", {"i": i})
    got = [e.payload["i"] async for e in store.events(CONV)]
    assert got == list(range(501))


async def test_record_exchanges_batches_conversations_in_one_transaction(
    store: Store, history: list[dict[str, Any]]
) -> None:
    a, b = ConversationRef("acme", "a"), ConversationRef("acme", "b")
    pairs = [(fingerprint(m), body(m)) for m in history]
    await store.record_exchanges(
        [
            ExchangeRecord(a, pairs[:5], [("request", {"n": 1})]),
            ExchangeRecord(b, pairs[3:8], []),
            ExchangeRecord(a, [*pairs[:7], pairs[2]], [("response", {"n": 2}), ("trim", {"n": 3})]),
        ]
    )
    await store.record_exchanges([])
    assert await store.archived_messages(a) == dict(pairs[:7])
    assert list(await store.archived_messages(a)) == list(dict(pairs[:7]))
    assert await store.archived_messages(b) == dict(pairs[3:8])
    info = await store.get_conversation(a)
    assert info is not None and info.message_count == len(dict(pairs[:7]))
    assert [(e.type, e.payload["n"]) async for e in store.events(a)] == [
        ("request", 1),
        ("response", 2),
        ("trim", 3),
    ]
    assert [e async for e in store.events(b)] == []

    # All or nothing: an item that cannot be written takes the whole batch with it.
    c = ConversationRef("acme", "c")
    with pytest.raises(TypeError):
        await store.record_exchanges(
            [
                ExchangeRecord(c, pairs[:2], [("request", {})]),
                ExchangeRecord(a, pairs[10:12], [("request", {"bad": object()})]),
            ]
        )
    assert await store.get_conversation(c) is None
    assert await store.archived_messages(a) == dict(pairs[:7])


async def test_last_event_and_paged_archive(store: Store) -> None:
    conv = ConversationRef("t", "k")
    assert await store.last_event(conv, "request") is None
    rows = [(f"fp{i:02d}", json.dumps({"role": "user", "content": str(i)})) for i in range(7)]
    await store.archive_messages(conv, rows[:4])
    await store.archive_messages(conv, rows[2:])
    for i in range(3):
        await store.append_event(conv, "request", {"n": i})
        await store.append_event(conv, "response", {"n": i})
    last = await store.last_event(conv, "request")
    assert last is not None and last.payload == {"n": 2} and last.type == "request"
    assert [x async for x in store.iter_archived(conv, page_size=2)] == rows
    assert [x async for x in store.iter_archived(conv)] == rows
    other = ConversationRef("u", "k")
    assert [x async for x in store.iter_archived(other)] == []
    assert await store.last_event(other, "request") is None


# --- loop summaries -------------------------------------------------------------------


async def test_loop_summary_rounds_and_ttl(store: Store, clock: FakeClock) -> None:
    t0 = clock.now
    await store.put_loop_summary(CONV, loop_summary("turn-a", 3, t0, ttl=1000))
    await store.put_loop_summary(CONV, loop_summary("turn-a", 6, t0, ttl=100))
    await store.put_loop_summary(CONV, loop_summary("turn-b", 9, t0, ttl=1000))

    async def rounds(turn: str, max_rounds: int, now: float) -> int | None:
        got = await store.get_loop_summary(CONV, turn, max_rounds, now)
        return None if got is None else got.covered_rounds

    assert await rounds("turn-a", 10, t0) == 6
    assert await rounds("turn-a", 6, t0) == 6
    assert await rounds("turn-a", 5, t0) == 3
    assert await rounds("turn-a", 2, t0) is None
    assert await rounds("turn-c", 10, t0) is None
    assert await rounds("turn-a", 10, t0 + 100) == 3  # the 6-round one expired
    assert await rounds("turn-a", 10, t0 + 1000) is None
    other = ConversationRef("acme", "conv-2")
    assert await store.get_loop_summary(other, "turn-a", 10, t0) is None

    # Writing the same (turn, rounds) again replaces it.
    await store.put_loop_summary(CONV, loop_summary("turn-a", 6, t0 + 50, ttl=1000))
    got = await store.get_loop_summary(CONV, "turn-a", 10, t0 + 500)
    assert got == loop_summary("turn-a", 6, t0 + 50, ttl=1000)


# --- conversations, tenants, prune ----------------------------------------------------


async def fill(store: Store, conv: ConversationRef, messages: list[dict[str, Any]]) -> None:
    """Put a row for `conv` into every table."""
    hashes = chain_hashes(messages)
    await store.archive_messages(conv, [(fingerprint(m), body(m)) for m in messages])
    await store.add_summary_version(conv, summary_at(hashes, 4))
    await store.record_compaction(conv, compaction("ok", 5000, 1000))
    await store.append_event(conv, "session_compact", {"version": 1})
    await store.put_loop_summary(conv, loop_summary("turn", 2, 0.0, ttl=1e12))


async def contents(store: Store, conv: ConversationRef) -> tuple[Any, ...]:
    return (
        await store.get_conversation(conv),
        await store.summary_versions(conv),
        await store.archived_messages(conv),
        await store.compactions(conv),
        [e async for e in store.events(conv)],
        await store.get_loop_summary(conv, "turn", 10, 0.0),
    )


async def test_prune_removes_old_conversations_entirely(
    store: Store, clock: FakeClock, history: list[dict[str, Any]]
) -> None:
    old, touched, new = (ConversationRef("acme", k) for k in ("old", "touched", "new"))
    await fill(store, old, history[:10])
    await fill(store, touched, history[:10])
    clock.advance(3600)
    cutoff = clock.now
    clock.advance(3600)
    await store.append_event(touched, "request", {})  # any write is activity
    await fill(store, new, history[:10])
    before_new = await contents(store, new)
    before_touched = await contents(store, touched)

    assert await store.prune(older_than=cutoff) == 1
    assert await contents(store, old) == (None, [], {}, [], [], None)
    assert await contents(store, new) == before_new
    assert await contents(store, touched) == before_touched
    assert await store.prune(older_than=cutoff) == 0

    # The conversation can start again from scratch after a prune.
    again = await store.add_summary_version(old, summary_at(chain_hashes(history), 4))
    assert again.version == 1 and again.compact_count == 1


async def test_tenants_are_isolated(store: Store, history: list[dict[str, Any]]) -> None:
    a, b = ConversationRef("tenant-a", "same-key"), ConversationRef("tenant-b", "same-key")
    await fill(store, a, history[:10])
    assert await contents(store, b) == (None, [], {}, [], [], None)
    assert await store.matching_summary(b, chain_hashes(history)) is None
    await fill(store, b, history[10:20])
    assert (await store.archived_messages(a)).keys().isdisjoint(await store.archived_messages(b))
    assert [c.tenant for c in await store.list_conversations("tenant-a")] == ["tenant-a"]
    assert {c.tenant for c in await store.list_conversations(None)} == {"tenant-a", "tenant-b"}
    assert await store.list_conversations("tenant-c") == []
    await store.set_current_version(a, None)
    current = await store.current_summary(b)
    assert current is not None and current.version == 1


async def test_list_conversations_keyset_pages_skip_nothing_that_shares_updated_at(
    store: Store, clock: FakeClock
) -> None:
    # One archive batch stamps many conversations with one time: ties are the rule.
    clock.advance(10)
    await store.record_exchanges(
        [
            ExchangeRecord(ConversationRef(t, k), [], [("request", {})])
            for t, k in [("b", "x"), ("a", "z"), ("a", "y"), ("b", "w"), ("a", "\u00e9")]
        ]
    )
    clock.advance(10)
    await store.append_event(ConversationRef("a", "newest"), "request", {})
    clock.advance(-30)
    await store.append_event(ConversationRef("a", "oldest"), "request", {})
    everything = [(c.tenant, c.key) for c in await store.list_conversations(None, limit=100)]
    assert everything == [
        ("a", "newest"),
        ("a", "y"),
        ("a", "z"),
        ("a", "\u00e9"),  # byte order on both backends
        ("b", "w"),
        ("b", "x"),
        ("a", "oldest"),
    ]
    for tenant, size in ((None, 1), (None, 2), (None, 3), ("a", 2)):
        seen: list[tuple[str, str]] = []
        after: ListPosition | None = None
        while True:
            page = await store.list_conversations(tenant, limit=size, after=after)
            seen += [(c.tenant, c.key) for c in page]
            if len(page) < size:
                break
            after = ListPosition(page[-1].updated_at, page[-1].tenant, page[-1].key)
        assert seen == [x for x in everything if tenant in (None, x[0])], (tenant, size)


async def test_list_conversations_newest_first_and_paged(store: Store, clock: FakeClock) -> None:
    keys = [f"c{i}" for i in range(7)]
    for k in keys:
        clock.advance(10)
        await store.append_event(ConversationRef("acme", k), "request", {})
    clock.advance(10)
    await store.append_event(ConversationRef("other", "x"), "request", {})

    page = await store.list_conversations("acme", limit=3)
    assert [c.key for c in page] == ["c6", "c5", "c4"]
    page = await store.list_conversations("acme", limit=3, before=page[-1].updated_at)
    assert [c.key for c in page] == ["c3", "c2", "c1"]
    page = await store.list_conversations("acme", limit=3, before=page[-1].updated_at)
    assert [c.key for c in page] == ["c0"]
    everyone = await store.list_conversations(None, limit=2)
    assert [(c.tenant, c.key) for c in everyone] == [("other", "x"), ("acme", "c6")]

    info = await store.get_conversation(ConversationRef("acme", "c0"))
    assert info is not None and info.created_at == info.updated_at == clock.now - 70
    assert (info.message_count, info.compact_count, info.tokens_saved) == (0, 0, 0)
    assert info.current_version is None
    assert await store.get_conversation(ConversationRef("acme", "nope")) is None


# --- the conversation lock ------------------------------------------------------------


async def test_conversation_lock_serialises_one_conversation_only(store: Store) -> None:
    first_in, release = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def holder() -> None:
        async with store.conversation_lock(CONV):
            order.append("first")
            first_in.set()
            await release.wait()
            order.append("first done")

    async def same() -> None:
        async with store.conversation_lock(ConversationRef(CONV.tenant, CONV.key)):
            order.append("same")

    async def other() -> None:
        async with store.conversation_lock(ConversationRef(CONV.tenant, "conv-2")):
            order.append("other")

    hold = asyncio.create_task(holder())
    await first_in.wait()
    waiting = asyncio.create_task(same())
    # The other conversation gets through while the first is still held.
    await asyncio.wait_for(other(), timeout=5)
    for _ in range(10):  # plenty of loop turns for `same` to get in, if it could
        await asyncio.sleep(0)
    assert order == ["first", "other"]
    assert not waiting.done()
    release.set()
    await asyncio.wait_for(asyncio.gather(hold, waiting), timeout=5)
    assert order == ["first", "other", "first done", "same"]


async def test_keyed_locks_forget_idle_keys() -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    async with locks.hold("a"), locks.hold("b"):
        assert len(locks) == 2
    assert len(locks) == 0

    # A waiter cancelled while queued does not leak its entry either.
    entered = asyncio.Event()

    async def hold_forever() -> None:
        async with locks.hold("a"):
            entered.set()
            await asyncio.Event().wait()

    holder = asyncio.create_task(hold_forever())
    await entered.wait()
    waiter = asyncio.create_task(locks.hold("a").__aenter__())
    await asyncio.sleep(0)
    waiter.cancel()
    holder.cancel()
    await asyncio.gather(holder, waiter, return_exceptions=True)
    assert len(locks) == 0


# --- crash safety ---------------------------------------------------------------------


async def test_a_failed_transaction_rolls_back(store: Store) -> None:
    with pytest.raises(TypeError):
        await store.append_event(CONV, "request", {"not json": object()})
    # NOT NULL fails on the last statement, after the conversation row was
    # created and its counter and current pointer were updated: none of it stays.
    broken = NewSummary(None, 3, "h", 1, 1, "m", "r")  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="NOT NULL"):
        await store.add_summary_version(CONV, broken)
    assert await store.get_conversation(CONV) is None
    assert await store.summary_versions(CONV) == []
    await store.append_event(CONV, "request", {})
    assert await store.get_conversation(CONV) is not None


CRASH_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from proxy.store import ConversationRef, NewSummary, open_store

    async def main(url: str, base_dir: str) -> None:
        store = open_store(url, base_dir)
        await store.open()
        i = 0
        while True:
            conv = ConversationRef("t", f"c{i % 4}")
            await store.add_summary_version(
                conv, NewSummary("s" * 2000, i % 50 + 1, f"h{i}", 1, 1, "m", "crash test")
            )
            if i % 4 == 0:
                await store.archive_messages(conv, [(f"m{i}", f'{{"n": {i}}}'), ("same", "{}")])
            if i % 7 == 3:
                await store.set_current_version(conv, 1)
            i += 1
            if i == 40:
                print("running", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.timeout(600)  # subprocess starts: seconds of CPU each
async def test_sigkill_never_leaves_half_written_state(
    store_url: str, tmp_path: Path, store_factory: Callable[[], Store]
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(CRASH_WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    store_factory()  # skips here when the backend is unavailable
    # Several short runs: each kill lands at a random point of a write; the
    # invariants below are cumulative, so a torn write in any run stays visible.
    for _ in range(8):
        proc = subprocess.Popen(
            [sys.executable, str(script), store_url, str(tmp_path)],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line == b"running\n", line
            await asyncio.sleep(0.1)  # let it get into its loop; the kill lands anywhere
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

        async with store_factory() as s:
            conversations = await s.list_conversations(None)
            assert len(conversations) == 4
            for info in conversations:
                conv = ConversationRef(info.tenant, info.key)
                versions = [v.version for v in await s.summary_versions(conv)]
                assert versions == list(range(1, len(versions) + 1))
                assert info.current_version in versions
                assert info.compact_count == len(versions)
                assert info.message_count == len(await s.archived_messages(conv))


# --- SQLite specifics -----------------------------------------------------------------


async def test_sqlite_garbage_file_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    path.write_bytes(b"this is not a database, just some bytes\x00\xff" * 200)
    s = SqliteStore(str(path))
    with pytest.raises(StoreError) as caught:
        await s.open()
    assert "not a database" in str(caught.value)
    with pytest.raises(StoreError):
        await s.current_summary(CONV)


async def test_sqlite_parent_is_a_file_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("a file, not a directory")
    with pytest.raises(StoreError):
        await SqliteStore(str(tmp_path / "plain" / "recap.db")).open()


async def test_sqlite_newer_schema_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "recap.db")
    async with SqliteStore(path):
        pass
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO schema_version VALUES (?, 'from the future', 0)", (LATEST + 1,))
    with pytest.raises(StoreError, match="newer"):
        await SqliteStore(path).open()


async def test_sqlite_migrations_recorded_once_and_pragmas(tmp_path: Path) -> None:
    path = str(tmp_path / "recap.db")
    stores = [SqliteStore(path) for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))
    for s in stores:
        await s.close()
    async with SqliteStore(path):
        pass
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
        assert rows == [(v,) for v in range(1, LATEST + 1)]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_memory_store(tmp_path: Path) -> None:
    async with open_store("sqlite://:memory:", str(tmp_path)) as s:
        await s.append_event(CONV, "request", {"a": 1})
        assert [e.payload async for e in s.events(CONV)] == [{"a": 1}]
    assert list(tmp_path.iterdir()) == []


def test_store_urls(tmp_path: Path) -> None:
    base = str(tmp_path)
    assert sqlite_path("sqlite:///./data/recap.db", base) == str(tmp_path / "data" / "recap.db")
    assert sqlite_path("sqlite:///x.db", base) == str(tmp_path / "x.db")
    assert sqlite_path("sqlite:////var/lib/recap.db", base) == "/var/lib/recap.db"
    assert sqlite_path("sqlite://:memory:", base) == ":memory:"
    store = open_store("sqlite:///data/recap.db", base)
    assert isinstance(store, SqliteStore) and store.path == str(tmp_path / "data" / "recap.db")
    for bad in (
        "sqlite://",
        "sqlite:///",
        "sqlite://host/x.db",
        "sqlite:x.db",
        "sqlite:///a.db?x=1",
    ):
        with pytest.raises(StoreError):
            open_store(bad, base)
    for url in ("postgresql://user:secret@db/recap", "postgres://user:secret@db:5433/recap"):
        pg = open_store(url, base)  # nothing connects before open()
        assert isinstance(pg, PostgresStore)
        assert "secret" not in repr(pg) and "user:***@db" in repr(pg)
    with pytest.raises(StoreError) as caught:
        open_store("mysql://user:secret@db/recap", base)
    assert "secret" not in str(caught.value)


async def test_the_deployment_secret_is_made_once_and_kept(
    store_factory: Callable[[], Store],
) -> None:
    first, second = store_factory(), store_factory()
    await first.open()
    await second.open()
    try:
        # Two replicas asking at once agree on one secret.
        a, b = await asyncio.gather(first.deployment_secret(), second.deployment_secret())
        assert a == b and len(a) == 32
    finally:
        await first.close()
        await second.close()
    again = store_factory()
    await again.open()
    try:
        assert await again.deployment_secret() == a
    finally:
        await again.close()
