"""The archiver's writes: a response event shares the next request's transaction."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from proxy.archive.archiver import Archiver
from proxy.config import parse_config
from proxy.history.measure import Measure
from proxy.history.messages import Classification
from proxy.history.tokens import TokenCounter
from proxy.pipeline import Exchange
from proxy.store import ConversationRef, SqliteStore
from proxy.store.base import ExchangeRecord, JournalMark


class CountingStore(SqliteStore):
    """A real SQLite store that remembers each write transaction's records."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.transactions: list[list[str]] = []

    async def record_exchanges(
        self, items: Sequence[ExchangeRecord], mark: JournalMark | None = None
    ) -> None:
        await super().record_exchanges(items, mark)
        self.transactions.append([t for item in items for t, _ in item.events])


def exchange(key: str) -> Exchange:
    return Exchange(
        request_id=key,
        tenant=parse_config({}, env={}).tenants["default"],
        conversation=ConversationRef("default", "c"),
        headers={},
        body={"model": "m", "messages": [{"role": "user", "content": key}]},
        classification=Classification.TURN_START,
        context_window=1000,
        measure=Measure(TokenCounter(), None),
    )


async def test_a_response_event_goes_with_the_next_request(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "recap.db"))
    async with store:
        archiver = Archiver(store)
        archiver.linger_s = 3600.0  # only the next request (or drain) writes it
        first = exchange("a")
        assert await archiver.begin(first) is True
        archiver.finish(first, {"status": 200})
        await asyncio.sleep(0.05)  # time the writer would take to write it alone
        second = exchange("b")
        assert await archiver.begin(second) is True
        assert store.transactions == [["request"], ["response", "request"]]
        await archiver.drain(timeout=5)


async def test_a_lone_response_event_is_written_after_the_linger(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "recap.db"))
    async with store:
        archiver = Archiver(store)
        archiver.linger_s = 0.01
        ex = exchange("a")
        assert await archiver.begin(ex) is True
        archiver.finish(ex, {"status": 200})
        for _ in range(1000):  # a hang guard: the timer fires after 10 ms
            if len(store.transactions) == 2:
                break
            await asyncio.sleep(0.01)
        assert store.transactions == [["request"], ["response"]]
        await archiver.drain(timeout=5)


async def test_drain_writes_what_lingers(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "recap.db"))
    async with store:
        archiver = Archiver(store)
        archiver.linger_s = 3600.0
        ex = exchange("a")
        await archiver.begin(ex)
        archiver.finish(ex, {"status": 200})
        await archiver.drain(timeout=5)
        assert [e.type async for e in store.events(ConversationRef("default", "c"))] == [
            "request",
            "response",
        ]


async def test_the_response_event_carries_the_time_recap_added(tmp_path: Path) -> None:
    """The holdout report's added latency is read from here (proxy/archive/holdout.py)."""
    store = CountingStore(str(tmp_path / "recap.db"))
    async with store:
        archiver = Archiver(store)
        ex = exchange("a")
        ex.record.overhead_ms = 12.5
        await archiver.begin(ex)
        archiver.finish(ex, {"status": 200, "finish_reason": "stop"})
        await archiver.drain(timeout=5)
        events = [e async for e in store.events(ConversationRef("default", "c"))]
        assert events[-1].payload == {
            "request_id": "a",
            "overhead_ms": 12.5,
            "status": 200,
            "finish_reason": "stop",
        }
