"""An answered request is durable (issue 13 item 3): SIGKILL right after answers, under load.

`recap serve` runs as a real subprocess on each store backend; several clients send
chat requests (streamed and not) on their own conversations, and the proxy is killed
with SIGKILL by a client thread the moment it holds a complete answer, at a different
point in each round. After every round the archive must hold, for each request that
got a complete 200 answer, its request event and every original message exactly as
sent, exactly once. (The archive appends the request's record to its journal before the
answer's final bytes, and the next start stores what a killed process left there; with
the journal switched off it commits the record while the upstream answers, and the
final bytes wait for that commit.)

The SIGKILL rounds catch a regression only when a kill lands between an answer's final
bytes and its commit; `test_final_bytes_wait_for_the_commit` holds the commit itself (the
store's write lock, taken by the test) and sees the final bytes withheld until it lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml

from proxy.config import parse_config
from proxy.store import open_store
from proxy.store.base import ConversationRef
from tests.fakes import FakeUpstream, Reply
from tests.pg import fresh_schema, postgres_url
from tests.servers import free_port, read_body, recap_app, serve

REPO = Path(__file__).resolve().parents[2]
CLIENTS = 6
# Completions after which a client kills the proxy, one round each.
KILL_AFTER = (4, 25)


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'recap.db'}"
        return
    with fresh_schema(postgres_url()) as url:
        yield url


def start(config: Path, port: int, cwd: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while True:  # until it answers (or it died: then the test fails, it does not hang)
        assert proc.poll() is None, "the proxy exited before it was ready"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def one(base: str, conv: str, stream: bool) -> list[dict[str, Any]] | None:
    """One request; its messages if it got a complete 200 answer, else None."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"hello from {conv}"},
    ]
    body = {"model": "m", "messages": messages, "stream": stream}
    headers = {"x-conversation-id": conv}
    try:
        if not stream:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
            ok = r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])
            return messages if ok else None
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as s:
            if s.status_code != 200:
                return None
            lines = list(s.iter_lines())
        return messages if "data: [DONE]" in lines else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def load_until_killed(
    proc: subprocess.Popen[bytes], base: str, round_: int, kill_after: int
) -> dict[str, list[dict[str, Any]]]:
    """CLIENTS threads send requests until one of them kills the proxy after the
    `kill_after`-th complete answer; the answered conversations and their messages."""
    answered: dict[str, list[dict[str, Any]]] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while proc.poll() is None:
            conv = f"r{round_}-c{i}-{n}"
            n += 1
            messages = one(base, conv, stream=(i + n) % 2 == 0)
            if messages is None:
                continue
            with lock:
                answered[conv] = messages
                if len(answered) == kill_after:
                    proc.kill()  # SIGKILL: right after a complete answer

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proc.wait()
    return answered


@pytest.mark.timeout(600)  # subprocess starts: seconds of CPU each
@pytest.mark.parametrize("journal", [True, False], ids=["journal", "commit"])
def test_answered_requests_survive_sigkill(
    store_url: str, journal: bool, upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    fake.script([Reply(content="one two three four five six")])
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": store_url,
                "archive": {"journal": journal},
                "tenants": {"default": {"upstream": {"base_url": f"{upstream_url}/v1"}}},
            }
        )
    )
    answered: dict[str, list[dict[str, Any]]] = {}
    for round_, kill_after in enumerate(KILL_AFTER):
        port = free_port()
        proc = start(config, port, tmp_path)
        answered.update(load_until_killed(proc, f"http://127.0.0.1:{port}", round_, kill_after))
        assert proc.returncode == -9
    assert len(answered) >= sum(KILL_AFTER)
    # Started once more: it stores what the last killed process left in its journal.
    proc = start(config, free_port(), tmp_path)
    proc.terminate()
    proc.wait(30)

    async def missing() -> list[str]:
        out = []
        async with open_store(store_url, str(tmp_path)) as store:
            for conv, messages in answered.items():
                ref = ConversationRef("default", conv)
                event = await store.last_event(ref, "request")
                if event is None:
                    out.append(f"{conv}: no request event")
                    continue
                requests = [e async for e in store.events(ref) if e.type == "request"]
                if len(requests) != 1:
                    out.append(f"{conv}: {len(requests)} request events")
                fps = event.payload["messages"]
                bodies = await store.archived_messages(ref, fps)
                if [json.loads(bodies[fp]) for fp in fps if fp in bodies] != messages:
                    out.append(f"{conv}: messages missing or changed")
        return out

    assert asyncio.run(missing()) == []


def test_the_record_is_committed_while_the_upstream_answers(
    fake: FakeUpstream, proxy_factory: Any, tmp_path: Path
) -> None:
    """The request's record is on disk before the upstream has answered: the fake answers
    only once it sees the request event in the proxy's database."""
    db = tmp_path / "recap.db"

    def request_events() -> int:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            return int(
                conn.execute("SELECT count(*) FROM events WHERE type = 'request'").fetchone()[0]
            )

    async def answer_once_archived(body: dict[str, Any]) -> Reply:
        for _ in range(1000):  # a hang guard (10 s): the commit takes milliseconds
            if await asyncio.to_thread(request_events) > 0:
                return Reply(content="archived first")
            await asyncio.sleep(0.01)
        return Reply(content="not archived while the upstream worked")

    url = proxy_factory()
    fake.chat = answer_once_archived
    r = httpx.post(
        f"{url}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-recap-conversation": "durable"},
        timeout=30,
    )
    assert r.json()["choices"][0]["message"]["content"] == "archived first"


# -- the final bytes wait for the commit: deterministic, the commit held by the test ------

LAST = b'data: {"choices": [{"index": 0, "delta": {"content": "last words"}}]}\n\n'


async def _one_write_stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An upstream that sends its whole SSE answer, last content and `[DONE]`, in ONE write:
    the proxy reads them as one chunk, so whatever it sends of that chunk before the commit
    is what a gate holding back `[DONE]` lets through, and no timing decides it."""
    if scope["type"] != "http":
        return
    await read_body(receive)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    await send({"type": "http.response.body", "body": LAST + b"data: [DONE]\n\n"})


class Hold:
    """The store's write lock, taken by another connection: the proxy's commit of the
    request's record waits on it (SQLite: busy_timeout, 5 s; PostgreSQL: until released)."""

    def __init__(self, store_url: str, tmp_path: Path) -> None:
        self.sqlite = store_url.startswith("sqlite")
        self.db = tmp_path / "recap.db"
        self.url = store_url
        self._release = threading.Event()
        self._held = threading.Event()
        self._thread: threading.Thread | None = None

    def requests(self) -> int:
        """Request events on disk (committed ones only)."""
        if self.sqlite:
            with contextlib.closing(sqlite3.connect(self.db)) as conn:
                row = conn.execute("SELECT count(*) FROM events WHERE type = 'request'")
                return int(row.fetchone()[0])

        async def count() -> int:
            conn = await asyncpg.connect(self.url, timeout=10)
            try:
                return int(
                    await conn.fetchval("SELECT count(*) FROM events WHERE type = 'request'")
                )
            finally:
                await conn.close()

        return asyncio.run(count())

    def __enter__(self) -> Hold:
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self._thread.start()
        assert self._held.wait(30), "the test could not take the store's write lock"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        self._release.set()
        if self._thread is not None:
            self._thread.join(30)

    def _hold(self) -> None:
        if self.sqlite:
            conn = sqlite3.connect(self.db, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                self._held.set()
                self._release.wait(60)
                conn.execute("ROLLBACK")
            finally:
                conn.close()
            return

        async def hold() -> None:
            conn = await asyncpg.connect(self.url, timeout=10)
            try:
                async with conn.transaction():
                    await conn.execute("LOCK TABLE events IN EXCLUSIVE MODE")
                    self._held.set()
                    await asyncio.to_thread(self._release.wait, 60)
            finally:
                await conn.close()

        asyncio.run(hold())


def test_final_bytes_wait_for_the_commit(store_url: str, tmp_path: Path) -> None:
    """Without a journal, the answer's `[DONE]` is held until the request's record is
    committed: while the test holds the store's write lock, the client has the answer's
    last words (sent in the same upstream chunk as `[DONE]`) and not `[DONE]`; once the
    lock is released, `[DONE]` comes, and the record is on disk by then."""
    with serve(_one_write_stream) as upstream:
        config = parse_config(
            {
                "store": store_url,
                "archive": {"journal": False},
                "tenants": {"default": {"upstream": {"base_url": f"{upstream}/v1"}}},
            },
            env={},
            base_dir=str(tmp_path),
        )
        with serve(recap_app(config)) as proxy:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            hold = Hold(store_url, tmp_path)
            received = b""
            with (
                hold,
                httpx.stream(
                    "POST",
                    f"{proxy}/v1/chat/completions",
                    json=body,
                    headers={"x-conversation-id": "held"},
                    timeout=30,
                ) as s,
            ):
                assert s.status_code == 200
                chunks = s.iter_raw()
                while b"last words" not in received:
                    received += next(chunks)
                # The chunk that held the last words held [DONE] too: it was split there.
                assert b"[DONE]" not in received, "the final bytes went out before the commit"
                assert hold.requests() == 0  # the commit is still waiting on the test's lock
                hold.release()
                for chunk in chunks:
                    received += chunk
                    if b"[DONE]" in received:
                        # The moment the client holds a complete answer, its record is on disk.
                        assert hold.requests() == 1
                        break
            assert received.endswith(b"data: [DONE]\n\n")
