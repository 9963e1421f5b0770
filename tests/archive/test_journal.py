"""The archive journal (proxy/archive/journal.py) with a real SQLite store: each record appended
is stored exactly once, whether the process stops cleanly, dies before the store took
it, or dies after the store took it but before its segment was deleted."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import pytest

from proxy.archive.archiver import Archiver
from proxy.archive.journal import Journal, decode, encode, orphans
from proxy.store import ConversationRef, SqliteStore
from proxy.store.base import ExchangeRecord

pytestmark = pytest.mark.quick

CONV = ConversationRef("default", "c")


def record(i: int, text: str = "") -> ExchangeRecord:
    body = '{"role":"user","content":"%s"}' % (text or f"m{i}")
    return ExchangeRecord(
        CONV,
        [(f"fp{i}", body)],
        [("request", {"request_id": f"r{i}", "messages": [f"fp{i}"]})],
        [],
    )


async def request_ids(store: SqliteStore) -> list[str]:
    return [e.payload["request_id"] async for e in store.events(CONV) if e.type == "request"]


def test_a_record_round_trips_exactly_lone_surrogates_and_all() -> None:
    odd = ExchangeRecord(
        ConversationRef("t\u00e9", "k\ud800"),
        [("fp", '{"content":"\\ud800 \u4e2d\u6587 \\u0000"}')],
        [("response", {"text": "\U0001f600 \udc00", "n": 1.5, "none": None})],
        [("pf", '{"model":"m"}')],
    )
    line = encode(odd)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
    assert decode(line) == odd


def test_a_live_journal_is_no_orphan_and_a_dead_one_is(tmp_path: Path) -> None:
    live = Journal(tmp_path)
    live.open()
    live.append(record(1))
    assert orphans(tmp_path) == []  # its lock is held
    live.close(all_stored=False)  # as a killed process: the files stay, the lock goes
    found = orphans(tmp_path)
    assert [o.owner for o in found] == [live.owner]
    # Locked by the finder now: a second process starting at once does not take it too.
    assert orphans(tmp_path) == []
    assert [r for _, r in found[0].records(None)] == [record(1)]
    found[0].remove()
    assert list(tmp_path.iterdir()) == []


def test_a_line_cut_short_ends_the_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open()
    journal.append(record(1))
    journal.append(record(2))
    journal.close(all_stored=False)
    (segment,) = tmp_path.glob("*.jsonl")
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # died mid-write of record 2: that write never returned
    (orphan,) = orphans(tmp_path)
    assert [r for _, r in orphan.records(None)] == [record(1)]
    orphan.release()


async def test_journaled_records_are_durable_at_once_and_stored_later(tmp_path: Path) -> None:
    async with SqliteStore(str(tmp_path / "recap.db")) as store:
        journal = Journal(tmp_path / "journal")
        journal.open()
        archiver = Archiver(store, journal=journal)
        archiver.linger_s = 3600.0  # only a flush (or drain) stores them
        done = archiver._record(record(1), urgent=True)
        assert done.done() and done.result() is True  # nobody waits for the store
        assert await request_ids(store) == []
        await archiver.flush()
        assert await request_ids(store) == ["r1"]
        mark = await store.journal_mark(journal.owner)
        assert mark is not None and (mark.segment, mark.position) == (0, 1)
        # All stored: the segment was replaced by an empty one.
        assert [p.name.split(".")[1] for p in (tmp_path / "journal").glob("*.jsonl")] == [
            "00000001"
        ]
        await archiver.drain(timeout=5)
        assert list((tmp_path / "journal").iterdir()) == []
        assert await store.journal_mark(journal.owner) is None


async def test_a_killed_process_journal_is_replayed_once(tmp_path: Path) -> None:
    path = str(tmp_path / "recap.db")
    directory = tmp_path / "journal"
    async with SqliteStore(path) as store:
        journal = Journal(directory, segment_bytes=1)  # a new segment for every record
        journal.open()
        archiver = Archiver(store, journal=journal)
        archiver.linger_s = 3600.0
        for i in range(4):
            archiver._record(record(i), urgent=False)
        # The store took the first two, with their mark, and then the process died
        # before it deleted their segments (and before it stored the other two).
        batch = archiver._queue[:2]
        await store.record_exchanges(batch, archiver._mark(2))
        journal.close(all_stored=False)
        if archiver._linger is not None:
            archiver._linger.cancel()
    async with SqliteStore(path) as store:
        assert await Archiver(store).replay(directory) == 2
        assert await request_ids(store) == ["r0", "r1", "r2", "r3"]
        assert await store.journal_mark(journal.owner) is None
        assert list(directory.iterdir()) == []
        assert await Archiver(store).replay(directory) == 0  # nothing twice


async def test_an_unwritable_journal_falls_back_to_committing(tmp_path: Path) -> None:
    async with SqliteStore(str(tmp_path / "recap.db")) as store:
        journal = Journal(tmp_path / "journal")
        journal.open()
        archiver = Archiver(store, journal=journal)
        archiver.linger_s = 3600.0
        assert journal._fd is not None
        os.close(journal._fd)
        journal._fd = os.open(os.devnull, os.O_RDONLY)  # every write fails now
        done = archiver._record(record(1), urgent=True)
        assert await asyncio.wait_for(done, 10) is True  # committed, as without a journal
        assert await request_ids(store) == ["r1"]
        await archiver.drain(timeout=5)


def test_the_lock_is_flock_on_the_lock_file(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open()
    fd = os.open(tmp_path / f"{journal.owner}.lock", os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        else:
            held = False
        assert held
    finally:
        os.close(fd)
        journal.close(all_stored=True)


def test_a_damaged_line_is_skipped_and_the_rest_replayed(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open()
    for i in range(3):
        journal.append(record(i))
    journal.close(all_stored=False)
    (segment,) = tmp_path.glob("*.jsonl")
    lines = segment.read_bytes().split(b"\n")
    lines[1] = b"{not json" + lines[1][9:]
    segment.write_bytes(b"\n".join(lines))
    (orphan,) = orphans(tmp_path)
    got = list(orphan.records(None))
    assert [r for _, r in got] == [record(0), record(2)]
    # Marks count lines, the skipped one too: a replay stopped after record 2 resumes after it.
    assert [(m.segment, m.position) for m, _ in got] == [(0, 1), (0, 3)]
    orphan.release()
