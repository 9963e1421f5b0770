"""What only the PostgreSQL store has: replicas sharing one database.

The shared contract runs in test_store.py on every backend; here, several
`PostgresStore` instances on one schema stand for several replicas: migrations
at once, the cross-process conversation lock (and its death with a session),
lock ordering of batched writes, and what errors may say.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from proxy.store import ConversationRef, NewSummary, Store, StoreError, open_store
from proxy.store.base import ExchangeRecord
from proxy.store.pg_boundary import clean_text, redact
from proxy.store.postgres import PostgresStore
from proxy.store.schema import LATEST
from tests.pg import postgres_url, run_sql, with_search_path

CONV = ConversationRef("acme", "conv-1")

Factory = Callable[[], PostgresStore]


@pytest.fixture
async def replicas(pg_url: str) -> AsyncIterator[Factory]:
    """Builds opened-later stores on one schema; closes them all at the end."""
    made: list[PostgresStore] = []

    def make() -> PostgresStore:
        s = open_store(pg_url, ".")
        assert isinstance(s, PostgresStore)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


async def advisory_holders(url: str) -> list[int]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    finally:
        await conn.close()
    return [r[0] for r in rows]


def summary(covered: int) -> NewSummary:
    return NewSummary(f"summary of {covered}", covered, f"h{covered}", 1, 1, "m", "r")


async def test_concurrent_starts_migrate_once(pg_url: str, replicas: Factory) -> None:
    stores = [replicas() for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch("SELECT version FROM schema_version ORDER BY version")
        assert [r[0] for r in rows] == list(range(1, LATEST + 1))
        await conn.execute("INSERT INTO schema_version VALUES ($1, 'from the future', 0)", 99)
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="newer"):
        await replicas().open()


async def test_the_lock_spans_replicas_and_only_its_conversation(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    await asyncio.gather(a.open(), b.open())
    held, release = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def on_a() -> None:
        async with a.conversation_lock(CONV):
            order.append("a")
            held.set()
            await release.wait()
            # Written under the lock: whoever gets it next sees this version.
            await a.add_summary_version(CONV, summary(10))
            order.append("a done")

    async def on_b() -> None:
        async with b.conversation_lock(ConversationRef(CONV.tenant, CONV.key)):
            current = await b.current_summary(CONV)
            order.append(f"b sees v{current.version if current else 0}")

    first = asyncio.create_task(on_a())
    await held.wait()
    waiting = asyncio.create_task(on_b())
    # Another conversation is not held up, on either replica.
    async with b.conversation_lock(ConversationRef(CONV.tenant, "conv-2")):
        order.append("b other")
    await asyncio.sleep(0.3)
    assert order == ["a", "b other"] and not waiting.done()
    release.set()
    await asyncio.wait_for(asyncio.gather(first, waiting), timeout=10)
    assert order == ["a", "b other", "a done", "b sees v1"]


async def test_a_dead_session_releases_its_lock(pg_url: str, replicas: Factory) -> None:
    a, b = replicas(), replicas()
    await asyncio.gather(a.open(), b.open())
    held, release = asyncio.Event(), asyncio.Event()

    async def on_a() -> None:
        async with a.conversation_lock(CONV):
            held.set()
            await release.wait()

    first = asyncio.create_task(on_a())
    await held.wait()
    (pid,) = await advisory_holders(pg_url)
    waiting = asyncio.create_task(b.conversation_lock(CONV).__aenter__())
    await asyncio.sleep(0.3)
    assert not waiting.done()
    # The holder's session ends (as when its process is killed): the lock goes with it.
    run_sql(pg_url, f"SELECT pg_terminate_backend({pid})")
    await asyncio.wait_for(waiting, timeout=10)
    # The first holder leaves its context without an error: its lock was already gone.
    release.set()
    await asyncio.wait_for(first, timeout=10)
    assert await advisory_holders(pg_url) != [pid]


async def test_cancelled_waiter_leaves_no_lock_behind(pg_url: str, replicas: Factory) -> None:
    a, b = replicas(), replicas()
    await asyncio.gather(a.open(), b.open())
    held, release = asyncio.Event(), asyncio.Event()

    async def hold(store: PostgresStore) -> None:
        async with store.conversation_lock(CONV):
            held.set()
            await release.wait()

    first = asyncio.create_task(hold(a))
    await held.wait()

    async def wait_on_b() -> None:
        async with b.conversation_lock(CONV):
            raise AssertionError("never granted while a holds it")

    waiter = asyncio.create_task(wait_on_b())
    await asyncio.sleep(0.2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    await first
    # b takes it at once now, and afterwards nobody holds any advisory lock.
    held.clear()
    release.set()
    await asyncio.wait_for(hold(b), timeout=5)
    await asyncio.sleep(0.1)
    assert await advisory_holders(pg_url) == []


async def test_batches_of_two_replicas_in_opposite_orders_do_not_deadlock(
    replicas: Factory,
) -> None:
    a, b = replicas(), replicas()
    await asyncio.gather(a.open(), b.open())
    x, y = ConversationRef("t", "x"), ConversationRef("t", "y")

    def batch(i: int, first: ConversationRef, second: ConversationRef) -> list[ExchangeRecord]:
        return [
            ExchangeRecord(first, [(f"m{i}", "{}")], [("request", {"i": i})]),
            ExchangeRecord(second, [(f"m{i}", "{}")], [("request", {"i": i})]),
        ]

    await asyncio.gather(
        *(a.record_exchanges(batch(i, x, y)) for i in range(0, 40, 2)),
        *(b.record_exchanges(batch(i, y, x)) for i in range(1, 40, 2)),
    )
    for conv in (x, y):
        info = await a.get_conversation(conv)
        assert info is not None and info.message_count == 40
        assert len([e async for e in a.events(conv)]) == 40


async def test_replicas_adding_versions_at_once_number_them_serially(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    await asyncio.gather(a.open(), b.open())
    added = await asyncio.gather(
        *(s.add_summary_version(CONV, summary(i + 1)) for i, s in enumerate([a, b] * 10))
    )
    assert sorted(v.version for v in added) == list(range(1, 21))
    info = await b.get_conversation(CONV)
    assert info is not None and info.compact_count == 20 and info.current_version is not None
    assert [v.version for v in await a.summary_versions(CONV)] == list(range(1, 21))


async def test_text_postgres_cannot_hold_is_replaced(replicas: Factory) -> None:
    s = replicas()
    await s.open()
    added = await s.add_summary_version(
        CONV, dataclasses.replace(summary(3), summary="a\x00b \ud83d c")
    )
    assert added.summary == "a\ufffdb \ufffd c"
    current = await s.current_summary(CONV)
    assert current == added
    assert clean_text("中文 ok") == "中文 ok" and clean_text(None) is None


async def test_errors_name_no_password_and_no_content(pg_url: str) -> None:
    # Nothing listens on port 1.
    with pytest.raises(StoreError) as caught:
        await open_store("postgresql://recap:hunter2@127.0.0.1:1/recap", ".").open()
    assert "hunter2" not in str(caught.value) and "unreachable" in str(caught.value)
    missing = with_search_path(pg_url, "no_such_schema")
    with pytest.raises(StoreError, match="no existing schema"):
        await open_store(missing, ".").open()
    base = postgres_url()
    db = base.rsplit("/", 1)[0] + "/recap_no_such_database_x"
    with pytest.raises(StoreError) as caught:
        await open_store(db, ".").open()
    assert "3D000" in str(caught.value) and "no_such_database" not in str(caught.value)
    assert redact("postgresql://u:p4ss@h:5/d?x=1") == "postgresql://u:***@h:5/d?x=1"
    assert redact("postgresql://h/d") == "postgresql://h/d"


class Relay:
    """A TCP relay in front of PostgreSQL that counts the connections the store makes and
    can hold new ones (accepted, not forwarded): a connection attempt a test can watch."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.accepted = 0
        self.through = asyncio.Event()  # set: new connections are forwarded
        self.through.set()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.through.wait()
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            writer.close()

    def url(self, url: str) -> str:
        """`url`, pointed at the relay."""
        parts = urlsplit(url)
        user = parts.netloc.rpartition("@")[0]
        where = f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=f"{user}@{where}" if user else where))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def test_a_store_that_could_not_open_recovers_by_itself() -> None:
    base = postgres_url()
    schema = f"recap_late_{uuid.uuid4().hex[:12]}"
    parts = urlsplit(base)
    async with Relay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        store = open_store(with_search_path(relay.url(base), schema), ".")
        # As when the server is not up yet: the proxy starts anyway, and calls fail at once.
        with pytest.raises(StoreError, match="no existing schema"):
            await store.open()
        tried = relay.accepted
        assert tried >= 1
        with pytest.raises(StoreError, match="no existing schema"):
            await store.check_writable()
        assert relay.accepted == tried, "a call must fail at once, not connect itself"
        # A retry in the background, held mid-connect: calls still answer (fail) meanwhile.
        relay.through.clear()
        deadline = time.monotonic() + 10
        while relay.accepted == tried:
            assert time.monotonic() < deadline, "no connection attempt in the background"
            with pytest.raises(StoreError, match="no existing schema"):
                # A hang guard: a call that waited on the held attempt would never return.
                await asyncio.wait_for(store.check_writable(), 10)
            await asyncio.sleep(0.1)
        with pytest.raises(StoreError, match="no existing schema"):
            await asyncio.wait_for(store.check_writable(), 10)
        relay.through.set()
        await _recovers(store, base, schema)


async def _recovers(store: Store, base: str, schema: str) -> None:
    run_sql(base, f'CREATE SCHEMA "{schema}"')
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                await store.check_writable()
                break
            except StoreError:
                assert time.monotonic() < deadline, "the store never came back"
                await asyncio.sleep(0.1)
        await store.append_event(CONV, "request", {})
        assert [e.type async for e in store.events(CONV)] == ["request"]
    finally:
        await store.close()
        run_sql(base, f'DROP SCHEMA "{schema}" CASCADE')
    with pytest.raises(StoreError, match="not open"):
        await store.check_writable()
