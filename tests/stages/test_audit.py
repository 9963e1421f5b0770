"""Audit rows and their events are written off the forwarding path (proxy/stages/audit.py).

Through a real proxy on a real SQLite store, wrapped so that its audit write can be held
or made to fail: a compacting turn is forwarded and answered while its audit row is held,
the row is stored once it is let go, shutdown waits for it, and a failing audit write
never fails the request. The writer's own order and bound, on its own loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from proxy.stages.audit import AuditWriter
from proxy.store import ConversationRef, SqliteStore, StoreError
from proxy.store.base import CompactionRecord
from tests.conftest import LogCapture
from tests.faults import SummarizerFake, compacting_config, history, post, wait_until
from tests.servers import recap_app, serve


class HeldStore(SqliteStore):
    """The real SQLite store, whose audit rows wait for `release` (a thread's event)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed_with_rows: int | None = None

    async def record_compaction(self, conv: ConversationRef, record: CompactionRecord) -> None:
        self.entered.set()
        await asyncio.to_thread(self.release.wait)
        await super().record_compaction(conv, record)

    async def close(self) -> None:
        self.closed_with_rows = len(rows(Path(self._path)))
        await super().close()


class FailingStore(SqliteStore):
    """The real SQLite store, whose audit writes fail."""

    async def record_compaction(self, conv: ConversationRef, record: CompactionRecord) -> None:
        raise StoreError("the audit table is gone")


def rows(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT key, layer FROM compactions ORDER BY id").fetchall()


def test_a_compacting_turn_is_answered_while_its_audit_row_is_held(
    upstream: tuple[SummarizerFake, str], tmp_path: Path
) -> None:
    fake, url = upstream
    store = HeldStore(tmp_path / "recap.db")
    with serve(recap_app(compacting_config(url, tmp_path), store=store)) as proxy:
        try:
            r = post(proxy + "/v1", history(), "held")
            # Forwarded and answered with the audit write still held.
            assert r.status_code == 200 and r.headers["x-recap-compaction"] == "session"
            assert store.entered.is_set() and not store.release.is_set()
            assert fake.fake.chat_requests(), "the compacted request went upstream"
            assert rows(tmp_path / "recap.db") == []
        finally:
            store.release.set()
        assert wait_until(lambda: rows(tmp_path / "recap.db") == [("held", "session")])


def test_shutdown_writes_the_pending_audit_rows_before_the_store_closes(
    upstream: tuple[SummarizerFake, str], tmp_path: Path
) -> None:
    _, url = upstream
    store = HeldStore(tmp_path / "recap.db")
    server = serve(recap_app(compacting_config(url, tmp_path), store=store))
    proxy = server.__enter__()
    try:
        r = post(proxy + "/v1", history(), "drained")
        assert r.headers["x-recap-compaction"] == "session"
    finally:
        stopping = threading.Thread(target=server.__exit__, args=(None, None, None))
        stopping.start()
    # The lifespan's end waits for the held row, and the store is still open meanwhile.
    assert wait_until(lambda: store.audits is not None and store.audits.draining)
    assert store.closed_with_rows is None
    store.release.set()
    stopping.join()
    assert store.closed_with_rows == 1
    assert rows(tmp_path / "recap.db") == [("drained", "session")]


def test_a_failing_audit_write_never_fails_the_request(
    upstream: tuple[SummarizerFake, str], tmp_path: Path, logs: LogCapture
) -> None:
    _, url = upstream
    store = FailingStore(str(tmp_path / "recap.db"))
    with serve(recap_app(compacting_config(url, tmp_path), store=store)) as proxy:
        first = post(proxy + "/v1", history(), "failing")
        assert first.status_code == 200 and first.headers["x-recap-compaction"] == "session"
        assert wait_until(lambda: "audit row (session ok) not written" in logs.text)
        # The conversation goes on: its stored summary is applied on the next turn.
        again = post(proxy + "/v1", history(turns=46), "failing")
        assert again.status_code == 200 and "session" in again.headers["x-recap-compaction"]
    assert rows(tmp_path / "recap.db") == []


CONV = ConversationRef("default", "c")


def writer_run(body: Callable[[AuditWriter, list[str]], Awaitable[Any]], **kw: Any) -> Any:
    writer = AuditWriter(**kw)
    done: list[str] = []

    async def main() -> Any:
        result = await body(writer, done)
        await writer.drain()
        return result

    return asyncio.run(main()), writer, done


def test_one_conversations_writes_keep_their_order_and_others_do_not_wait() -> None:
    async def body(writer: AuditWriter, done: list[str]) -> None:
        gate = asyncio.Event()

        async def first() -> None:
            await gate.wait()
            done.append("c1")

        async def second() -> None:
            done.append("c2")

        async def other() -> None:
            done.append("d1")
            gate.set()

        writer.put(CONV, first, "c1")
        writer.put(CONV, second, "c2")
        writer.put(ConversationRef("default", "d"), other, "d1")
        await writer.flush()

    _, writer, done = writer_run(body)
    assert done == ["d1", "c1", "c2"]
    assert (writer.written, writer.failed, writer.pending) == (3, 0, 0)


def test_a_full_queue_drops_and_counts_and_a_failed_write_does_not_stop_the_next() -> None:
    async def body(writer: AuditWriter, done: list[str]) -> None:
        async def fails() -> None:
            raise StoreError("down")

        async def works() -> None:
            done.append("ok")

        writer.put(CONV, fails, "a")
        writer.put(CONV, works, "b")
        writer.put(CONV, works, "c")  # over max_pending: dropped
        await writer.flush()
        writer.put(CONV, works, "d")  # room again

    _, writer, done = writer_run(body, max_pending=2)
    assert done == ["ok", "ok"]
    assert (writer.written, writer.failed, writer.dropped) == (2, 1, 1)
