"""Store faults: whatever happens to the SQLite file, chat requests go through (uncompacted),
/readyz says why it is not ready, the log says why, and the proxy recovers by itself when
the file does. And a proxy killed in the middle of a compaction never leaves a half-made
summary behind.

Every fault is a real one on a real file under a real server: another connection holding
the write lock, the file deleted or overwritten, a full or read-only filesystem (a small
tmpfs; those two need root and skip otherwise), SIGKILL of a real `python -m proxy serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.archive.archiver import Archiver
from proxy.config import parse_config
from proxy.history.conversation import check_history
from proxy.history.measure import Measure
from proxy.history.messages import Classification, chain_hashes, fingerprint, split_pinned
from proxy.history.tokens import TokenCounter
from proxy.pipeline import Exchange
from proxy.planning.framing import FRAME_CLOSE, FRAME_OPEN
from proxy.store import ConversationRef, SqliteStore, StoreError
from proxy.store.base import ExchangeRecord, JournalMark
from tests.conftest import REPO, LogCapture
from tests.faults import (
    MODEL,
    Answer,
    SummarizerFake,
    compacting_config,
    compacting_data,
    history,
    summaries_in,
    wait_until,
)
from tests.servers import free_port, recap_app, serve

RETRY_S = 1.0  # SqliteStore's default retry interval


class Probe:
    """One proxy under test, with what a test asks of it."""

    def __init__(self, url: str, fake: SummarizerFake, logs: LogCapture, first: int = 0) -> None:
        self.url = url
        self.fake = fake
        self.logs = logs
        self.n = first  # conversations are numbered on: each probe starts a new one

    def ready(self) -> httpx.Response:
        return httpx.get(self.url.removesuffix("/v1") + "/readyz", timeout=30)

    def chat(self, key: str | None = None) -> tuple[httpx.Response, bytes]:
        """A request that compacts when the store works; returns what the upstream got."""
        self.n += 1
        raw = json.dumps({"model": MODEL, "messages": history(seed=self.n)}).encode()
        r = httpx.post(
            f"{self.url}/chat/completions",
            content=raw,
            headers={
                "x-conversation-id": key or f"probe-{self.n}",
                "content-type": "application/json",
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r, self.fake.fake.chat_requests()[-1].body

    def through_uncompacted(self) -> None:
        r, forwarded = self.chat()
        assert r.headers["x-recap-compaction"] in ("none", "failed")
        sent = json.dumps({"model": MODEL, "messages": history(seed=self.n)}).encode()
        assert forwarded == sent  # the client's exact bytes

    def compacts(self) -> None:
        r, forwarded = self.chat()
        assert r.headers["x-recap-compaction"] == "session", r.headers
        assert summaries_in(json.loads(forwarded)["messages"]) == [1]

    def not_ready(self, *reasons: str) -> str:
        r = self.ready()
        assert r.status_code == 503
        reason = str(r.json()["store"])
        assert any(x in reason for x in reasons), reason
        return reason

    def recovers(self, timeout: float = 3 * RETRY_S + 2) -> None:
        assert wait_until(lambda: self.ready().status_code == 200, timeout=timeout, step=0.1)
        self.compacts()
        assert any("available again" in r.get("msg", "") for r in self.logs.records("recap.store"))

    def logged(self, *reasons: str) -> None:
        errors = [r["msg"] for r in self.logs.records("recap.store") if r["level"] == "error"]
        assert any(x in m for m in errors for x in reasons), errors


@pytest.fixture
def probe(
    upstream: tuple[SummarizerFake, str], tmp_path: Path, logs: LogCapture
) -> Iterator[Probe]:
    fake, url = upstream
    fake.answer = lambda body: Answer()
    with serve(recap_app(compacting_config(url, tmp_path))) as proxy:
        p = Probe(proxy + "/v1", fake, logs)
        assert p.ready().status_code == 200
        p.compacts()
        yield p


def _backup(path: Path) -> Path:
    """A consistent copy, as an operator would take it (one file, no -wal)."""
    copy = path.with_name("backup.db")
    with (
        contextlib.closing(sqlite3.connect(path)) as src,
        contextlib.closing(sqlite3.connect(copy)) as dst,
    ):
        src.backup(dst)
    return copy


def _restore(backup: Path, path: Path) -> None:
    """Put a backup back as an operator must: no stale -wal/-shm beside it, atomically."""
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{path}{suffix}")
    staged = path.with_name("staged.db")
    shutil.copyfile(backup, staged)
    os.replace(staged, path)


def test_write_lock_held_by_another_process(probe: Probe, tmp_path: Path) -> None:
    """Another connection holds the write lock past busy_timeout (5 s)."""
    locker = sqlite3.connect(tmp_path / "recap.db", isolation_level=None)
    try:
        locker.execute("BEGIN IMMEDIATE")
        locker.execute("INSERT INTO heartbeat (id, at) VALUES (99, 0)")
        # Answered while the lock is still held: the store gave up, the request did not.
        probe.through_uncompacted()
        probe.not_ready("locked")
        probe.logged("locked")
        # Known to be down, the store fails the next writes without asking for the lock
        # (test_a_store_known_locked_does_not_ask_for_the_lock_again).
        probe.through_uncompacted()
        probe.through_uncompacted()
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    probe.recovers()
    # Lossless on disk: what the requests made during the fault is archived after it.
    during = [f"probe-{n}" for n in (2, 3, 4)]

    def archived() -> bool:
        with contextlib.closing(sqlite3.connect(tmp_path / "recap.db")) as db:
            found = db.execute(
                "SELECT COUNT(DISTINCT key) FROM events"
                " WHERE type = 'request' AND key IN (?, ?, ?)",
                during,
            ).fetchone()
        return bool(found == (3,))

    assert wait_until(archived, timeout=3 * RETRY_S + 2, step=0.1)


def test_a_key_sqlite_cannot_hold_is_kept_as_an_escape(probe: Probe, tmp_path: Path) -> None:
    """A body's conversation key may hold a lone surrogate (valid JSON, not UTF-8): it is
    stored escaped, so that conversation is archived and compacted like any other."""
    raw = json.dumps(
        {"model": MODEL, "metadata": {"conversation_id": "bad\ud800key"}, "messages": history()}
    ).encode()
    r = httpx.post(f"{probe.url}/chat/completions", content=raw, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-recap-compaction"] == "session"

    def archived() -> bool:
        with contextlib.closing(sqlite3.connect(tmp_path / "recap.db")) as db:
            (n,) = db.execute(
                "SELECT COUNT(*) FROM events WHERE key = ? AND type = 'request'",
                ("bad\\ud800key",),
            ).fetchone()
        return bool(n)

    assert wait_until(archived, timeout=3)


async def test_a_store_known_locked_does_not_ask_for_the_lock_again(tmp_path: Path) -> None:
    """After a write gave up on another process's write lock, writes fail at once until
    the retry is due: they do not queue on the lock again. Shown by freeing the lock: a
    write that asked for it would succeed. Reads go on meanwhile."""
    path = tmp_path / "recap.db"
    conv = ConversationRef("default", "locked")
    async with SqliteStore(str(path), busy_timeout_ms=100, retry_s=3600) as store:
        await store.append_event(conv, "request", {})
        locker = sqlite3.connect(path, isolation_level=None)
        try:
            locker.execute("BEGIN IMMEDIATE")
            locker.execute("INSERT INTO heartbeat (id, at) VALUES (99, 0)")
            with pytest.raises(StoreError, match="locked"):
                await store.append_event(conv, "response", {})
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        # The lock is free now, but the retry is not due: nothing asks for it.
        with pytest.raises(StoreError, match="locked"):
            await store.append_event(conv, "response", {})
        with pytest.raises(StoreError, match="locked"):
            await store.check_writable()
        assert [e.type async for e in store.events(conv)] == ["request"]


async def test_a_write_queues_for_a_lock_held_briefly(tmp_path: Path) -> None:
    """Two proxies on one file: a write waits (busy_timeout) for the other's lock instead of
    failing, and goes through once it is free."""
    path = tmp_path / "recap.db"
    conv = ConversationRef("default", "queued")
    async with SqliteStore(str(path), busy_timeout_ms=60_000) as store:
        await store.check_writable()
        locker = sqlite3.connect(path, isolation_level=None)
        try:
            locker.execute("BEGIN IMMEDIATE")
            write = asyncio.ensure_future(store.append_event(conv, "request", {}))
            # Room for the write to reach the lock; it must still be waiting there.
            await asyncio.sleep(0.3)
            assert not write.done()
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        await asyncio.wait_for(write, 30)  # a hang guard: it goes through once the lock is free
        assert [e.type async for e in store.events(conv)] == ["request"]


class PickyStore(SqliteStore):
    """A working store that cannot hold one conversation's records (whatever the reason)."""

    async def record_exchanges(
        self, items: Sequence[ExchangeRecord], mark: JournalMark | None = None
    ) -> None:
        if any(item.conversation.key == "poison" for item in items):
            raise StoreError("sqlite SQLITE_TOOBIG: string or blob too big")
        await super().record_exchanges(items, mark)


async def test_a_record_the_store_cannot_hold_blocks_no_other(tmp_path: Path) -> None:
    store = PickyStore(str(tmp_path / "recap.db"))
    tenant = parse_config({}, env={}).tenants["default"]
    async with store:
        archiver = Archiver(store)
        for key in ("before", "poison", "after"):
            exchange = Exchange(
                request_id=key,
                tenant=tenant,
                conversation=ConversationRef("default", key),
                headers={},
                body={"model": "m", "messages": [{"role": "user", "content": key}]},
                classification=Classification.TURN_START,
                context_window=1000,
                measure=Measure(TokenCounter(), None),
            )
            archiver.begin(exchange)
            archiver.finish(exchange, {"status": 200})
        await archiver.drain(timeout=5)
        written = [
            info.key
            for info in await store.list_conversations(None)
            if await store.last_event(ConversationRef("default", info.key), "request")
        ]
    assert sorted(written) == ["after", "before"]


def test_database_file_deleted_under_the_proxy(probe: Probe, tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    backup = _backup(path)
    for suffix in ("", "-wal", "-shm"):
        os.remove(f"{path}{suffix}")
    probe.through_uncompacted()
    probe.not_ready("missing")
    probe.logged("database file is missing")
    # Not re-created empty behind the operator's back while it is gone.
    time.sleep(RETRY_S + 0.2)
    probe.through_uncompacted()
    assert not path.exists()
    _restore(backup, path)
    probe.recovers()
    # The restored file is the one in use: what was compacted before is still there.
    with contextlib.closing(sqlite3.connect(path)) as db:
        (versions,) = db.execute("SELECT COUNT(*) FROM summary_versions").fetchone()
    assert versions >= 2


def test_database_file_replaced_under_the_proxy(probe: Probe, tmp_path: Path) -> None:
    """Another file put at the path (a restored backup): the proxy moves to it instead of
    writing on into the file it had open, which is no longer at any path."""
    path = tmp_path / "recap.db"
    _restore(_backup(path), path)  # the same content, as a new file
    probe.through_uncompacted()
    probe.not_ready("replaced")
    probe.logged("database file was replaced")
    probe.recovers()
    with contextlib.closing(sqlite3.connect(path)) as db:
        (versions,) = db.execute("SELECT COUNT(*) FROM summary_versions").fetchone()
    assert versions >= 2  # the compaction after recovery is in the file at the path


def test_database_file_corrupted_under_the_proxy(probe: Probe, tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    backup = _backup(path)
    with contextlib.closing(sqlite3.connect(path)) as db:
        # Everything into the main file first: otherwise closing the proxy's connection
        # would checkpoint a young database's whole content back over the garbage.
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    with path.open("r+b") as f:  # in place: same inode, garbage content
        f.write(os.urandom(size))
    probe.through_uncompacted()
    probe.not_ready("not a SQLite database", "not a database")
    probe.logged("not a SQLite database", "not a database")
    time.sleep(RETRY_S + 0.2)
    probe.through_uncompacted()  # the reconnect finds garbage too
    probe.not_ready("not a database", "not a SQLite database")
    _restore(backup, path)
    probe.recovers()


def test_overwritten_file_is_noticed_before_sqlite_reads_it(probe: Probe, tmp_path: Path) -> None:
    """Garbage written over the file while everything SQLite needs is in its page cache and
    its write-ahead log: SQLite would go on reading and writing as if nothing happened
    (and checkpoint onto the garbage later); the check before each write stops it."""
    path = tmp_path / "recap.db"
    backup = _backup(path)
    size = path.stat().st_size
    with path.open("r+b") as f:  # no checkpoint first: the log and the cache stay valid
        f.write(os.urandom(size))
    probe.through_uncompacted()
    probe.not_ready("not a SQLite database")
    _restore(backup, path)
    probe.recovers()


def test_garbage_file_at_start_up_then_replaced(
    upstream: tuple[SummarizerFake, str], tmp_path: Path, logs: LogCapture
) -> None:
    """A store that cannot be opened at start: the proxy serves anyway, then gets ready."""
    fake, url = upstream
    path = tmp_path / "recap.db"
    path.write_bytes(b"not a database at all " * 500)
    with serve(recap_app(compacting_config(url, tmp_path))) as proxy:
        probe = Probe(proxy + "/v1", fake, logs)
        probe.not_ready("not a database")
        probe.through_uncompacted()
        path.unlink()  # the operator moves the bad file away
        probe.recovers()


def test_damaged_pages_keep_the_store_down_until_repaired(
    upstream: tuple[SummarizerFake, str], tmp_path: Path, logs: LogCapture
) -> None:
    """Corruption inside a table (header and schema intact): a reconnect alone would look
    healthy until the next read of that page; the reopened file is checked first."""
    fake, url = upstream
    path = tmp_path / "recap.db"
    config = compacting_config(url, tmp_path)
    with serve(recap_app(config)) as proxy:
        Probe(proxy + "/v1", fake, logs).compacts()
    backup = _backup(path)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page,) = db.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'summary_versions'"
        ).fetchone()
        (size,) = db.execute("PRAGMA page_size").fetchone()
    with path.open("r+b") as f:
        f.seek((page - 1) * size)
        f.write(os.urandom(size))
    with serve(recap_app(config)) as proxy:
        probe = Probe(proxy + "/v1", fake, logs, first=100)
        probe.through_uncompacted()  # looking for its summary reads the damaged page
        probe.not_ready("malformed", "corrupt")
        for _ in range(2):
            # Each retry reopens the file and checks it before use: writes (the archive,
            # the heartbeat) do not touch the damaged table, so without the check the
            # store would look healthy until a request next reads that page.
            time.sleep(RETRY_S + 0.2)
            probe.not_ready("malformed", "corrupt")
            probe.through_uncompacted()
        _restore(backup, path)
        probe.recovers()


# -- full and read-only filesystems (a small tmpfs) -------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "mnt"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "recap-test", str(mount)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def tmpfs_probe(
    upstream: tuple[SummarizerFake, str], tmpfs: Path, logs: LogCapture
) -> Iterator[Probe]:
    fake, url = upstream
    config = compacting_config(url, tmpfs.parent, store=f"sqlite:///{tmpfs / 'recap.db'}")
    with serve(recap_app(config)) as proxy:
        p = Probe(proxy + "/v1", fake, logs)
        assert p.ready().status_code == 200
        p.compacts()
        yield p


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_disk_full(tmpfs_probe: Probe, tmpfs: Path) -> None:
    filler = _fill(tmpfs)
    tmpfs_probe.through_uncompacted()
    tmpfs_probe.not_ready("full")
    tmpfs_probe.logged("full")
    filler.unlink()
    tmpfs_probe.recovers()


def test_disk_nearly_full_is_not_ready_before_writes_fail(tmpfs_probe: Probe, tmpfs: Path) -> None:
    """Under 1 MiB free, /readyz says so while writes still succeed: the operator hears of
    it before requests lose their compaction."""
    free = shutil.disk_usage(tmpfs).free
    filler = tmpfs / "filler"
    filler.write_bytes(b"\0" * (free - 512 * 1024))
    tmpfs_probe.not_ready("nearly full")
    tmpfs_probe.compacts()
    filler.unlink()
    assert wait_until(lambda: tmpfs_probe.ready().status_code == 200, timeout=3 * RETRY_S + 2)
    tmpfs_probe.compacts()


@pytest.fixture
def immutable() -> Iterator[Callable[[Path, bool], None]]:
    """`chattr +i`: no process, root included, may write the file, even through an fd it
    already holds (a mode of 0444 stops neither root nor open descriptors)."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("chattr +i needs root")
    marked: list[Path] = []

    def mark(path: Path, on: bool) -> None:
        subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)
        if on:
            marked.append(path)

    yield mark
    for path in marked:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_read_only_database_file(
    probe: Probe, tmp_path: Path, immutable: Callable[[Path, bool], None]
) -> None:
    files = [tmp_path / "recap.db", tmp_path / "recap.db-wal"]
    for path in files:
        immutable(path, True)
    try:
        probe.through_uncompacted()
        probe.not_ready("I/O", "IOERR", "readonly", "read-only", "unable to open")
        probe.logged("I/O", "IOERR", "readonly", "read-only", "unable to open")
        time.sleep(RETRY_S + 0.2)
        probe.through_uncompacted()  # reopened, still read-only
        probe.not_ready("I/O", "IOERR", "readonly", "read-only", "unable to open")
    finally:
        for path in files:
            immutable(path, False)
    probe.recovers()


# -- SIGKILL in the middle of a compaction ------------------------------------------------


class Proxy:
    """`python -m proxy serve` in its own process, on a config file and a port."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timers: list[threading.Timer] = []
        self.log = (workdir / f"proxy-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "proxy", "serve", "--config", str(config)),
                *("--host", "127.0.0.1", "--port", str(self.port), "--log-format", "json"),
            ],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        # Until it answers or dies; the deadline is only a hang guard (a start takes
        # seconds of CPU: on a loaded machine, tens of seconds).
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("proxy did not start")
            time.sleep(0.05)

    def kill_soon(self, delay: float) -> None:
        # Popen.send_signal never signals a pid it has reaped (which could be reused).
        timer = threading.Timer(delay, self.proc.send_signal, (signal.SIGKILL,))
        self.timers.append(timer)
        timer.start()

    def kill_when(self, event: Callable[[], bool]) -> None:
        """SIGKILL as soon as `event()` holds (checked from a thread, every 10 ms)."""

        def watch() -> None:
            while self.proc.poll() is None:
                if event():
                    self.proc.send_signal(signal.SIGKILL)
                    return
                time.sleep(0.01)

        threading.Thread(target=watch, daemon=True).start()

    def kill(self) -> None:
        for timer in self.timers:
            timer.cancel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def _versions(path: Path, key: str) -> int:
    """Summary versions committed for `key` (read-only: never in the proxy's way)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        (n,) = db.execute("SELECT COUNT(*) FROM summary_versions WHERE key = ?", (key,)).fetchone()
        return int(n)


def _verify_store(
    path: Path, conversations: dict[str, list[dict[str, Any]]], made: set[str]
) -> int:
    """Every stored summary version is one the summarizer made, whole, and matches the
    history it stands for, whose originals are all archived. Returns how many versions."""
    count = 0
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        for key, messages in conversations.items():
            _, body = split_pinned(messages)
            chain = chain_hashes(body)
            archived = {
                fp for (fp,) in db.execute("SELECT fingerprint FROM messages WHERE key = ?", (key,))
            }
            rows = db.execute(
                "SELECT version, summary, covered, boundary_hash, compact_count"
                " FROM summary_versions WHERE key = ? ORDER BY version",
                (key,),
            ).fetchall()
            current = db.execute(
                "SELECT current_version, compact_count FROM conversations WHERE key = ?", (key,)
            ).fetchone()
            assert [r[0] for r in rows] == list(range(1, len(rows) + 1))
            for version, summary, covered, boundary, _ in rows:
                assert summary in made, f"{key} v{version}: not a summary the summarizer made"
                assert 0 < covered < len(body)
                assert boundary == chain[covered - 1]
                assert {fingerprint(m) for m in body[:covered]} <= archived
            if rows:
                assert current is not None and current[0] in {r[0] for r in rows}
                assert current[1] == len(rows)
            count += len(rows)
    return count


# Eight processes started one after another: the 120 s hang guard is too short when the
# machine is loaded (each start is seconds of CPU).
@pytest.mark.timeout(600)
def test_sigkill_mid_compaction_leaves_no_half_made_summary(
    upstream: tuple[SummarizerFake, str], tmp_path: Path
) -> None:
    fake, url = upstream
    data = compacting_data(url, tmp_path, session={"max_batch_messages": 24})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    made: set[str] = set()
    conversations: dict[str, list[dict[str, Any]]] = {}
    proxy: Proxy | None = None

    def summary(n: int) -> str:
        # A long text with an end marker: a torn write would lose the end.
        text = f"## User Goal\nsummary {n} " + "details " * 300 + f"\nEND-OF-SUMMARY-{n}"
        made.add(text)
        return f"<summary>\n{text}\n</summary>"

    # Where the kill lands: during the 2nd summarizer call of the compaction, this long
    # after its answer went out (while the proxy reads it, stores it, or starts the next),
    # or once the 2nd version is on disk (the event, so that a kill after storing it is
    # always among them, however slow the machine).
    moments: list[float | str | None] = [None, 0.0, 0.01, 0.02, 0.05, 0.1, "stored"]
    stored: list[int] = []
    try:
        for i, moment in enumerate(moments):
            proxy = victim = Proxy(config, tmp_path)
            calls = fake.count()

            def answer(
                body: dict[str, Any],
                moment: float | None = moment,
                calls: int = calls,
                victim: Proxy = victim,
            ) -> Answer:
                n = fake.count()
                if n - calls == 2:
                    if moment is None:
                        victim.kill_soon(0.1)
                        return Answer(delay_s=30)
                    if isinstance(moment, float):
                        victim.kill_soon(moment)
                return Answer(content=summary(n))

            fake.answer = answer
            key = f"killed-{i}"
            if moment == "stored":
                victim.kill_when(lambda key=key: _versions(tmp_path / "recap.db", key) >= 2)
            conversations[key] = history(seed=100 + i)
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    f"{proxy.url}/v1/chat/completions",
                    json={"model": MODEL, "messages": conversations[key]},
                    headers={"x-conversation-id": key},
                    timeout=30,
                )
            proxy.kill()
            assert proxy.proc.returncode == -signal.SIGKILL
            stored.append(_verify_store(tmp_path / "recap.db", {key: conversations[key]}, made))
        # Kills landed on both sides of storing the second summary (not just before it).
        assert min(stored) == 1 and max(stored) >= 2, stored
        assert fake.count() >= 2 * len(moments)

        # Restarted on the same file: every conversation goes on from a whole summary.
        fake.answer = lambda body: Answer(content=summary(fake.count()))
        proxy = Proxy(config, tmp_path)
        for key, messages in conversations.items():
            r = httpx.post(
                f"{proxy.url}/v1/chat/completions",
                json={"model": MODEL, "messages": messages},
                headers={"x-conversation-id": key},
                timeout=30,
            )
            assert r.status_code == 200
            forwarded = fake.fake.chat_requests()[-1].json["messages"]
            assert check_history(forwarded) == []
            (at,) = summaries_in(forwarded)
            content = forwarded[at]["content"]
            assert content.count(FRAME_OPEN) == 1 and content.endswith(FRAME_CLOSE)
            text = content.split(FRAME_OPEN + "\n", 1)[1].removesuffix("\n" + FRAME_CLOSE)
            assert text in made
        proxy.kill()
        assert _verify_store(tmp_path / "recap.db", conversations, made) >= len(moments)
    finally:
        if proxy is not None and proxy.proc.poll() is None:
            proxy.kill()
