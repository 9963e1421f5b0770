"""One compaction at a time per SQLite conversation, across processes.

`recap compact` (the CLI) and a server on the same file each compacted one conversation
at once on ce59ff6 (the lock was an asyncio lock, in-process only): two summarizer calls,
and the manual version superseded at once. The lock is now a byte-range lock of an open
file description (Linux's OFD lock) on a file beside the database, under the in-process
one: another process waits for it, a process that dies drops it, and another conversation
is never held up.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from proxy.store.base import ConversationRef
from proxy.store.sqlite import SqliteStore
from proxy.store.sqlite_lock import lock_path

CONV = ConversationRef("acme", "conv-1")

# A second process: holds CONV's lock until it reads a line (or is killed).
HOLDER = """
import asyncio, sys
from proxy.store.base import ConversationRef
from proxy.store.sqlite import SqliteStore

async def main() -> None:
    store = SqliteStore(sys.argv[1])
    await store.open()
    async with store.conversation_lock(ConversationRef("acme", "conv-1")):
        print("held", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print("released", flush=True)
    await store.close()

asyncio.run(main())
"""

# Time a lock that does not hold across processes has to let the waiter in (it would
# at once); only the test's power to catch that depends on it, never its passing.
GRACE_S = 0.5


async def holder(path: Path) -> asyncio.subprocess.Process:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLDER,
        str(path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    assert await asyncio.wait_for(child.stdout.readline(), 60) == b"held\n"
    return child


async def test_another_process_holding_the_conversation_is_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    store = SqliteStore(str(path))
    await store.open()
    child = await holder(path)
    order: list[str] = []

    async def take() -> None:
        async with store.conversation_lock(ConversationRef(CONV.tenant, CONV.key)):
            order.append("server compacts")

    try:
        waiting = asyncio.create_task(take())
        # Another conversation of the same file is not held up.
        async with store.conversation_lock(ConversationRef(CONV.tenant, "conv-2")):
            order.append("other conversation")
        await asyncio.sleep(GRACE_S)
        order.append("cli done")
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(b"go\n")
        await asyncio.wait_for(waiting, 60)
        assert await child.stdout.readline() == b"released\n"
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        await store.close()
    assert order == ["other conversation", "cli done", "server compacts"]
    assert oct(lock_path(str(path)).stat().st_mode & 0o777) == "0o600"


async def test_a_process_that_dies_holding_the_lock_releases_it(tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    store = SqliteStore(str(path))
    await store.open()
    child = await holder(path)
    child.send_signal(signal.SIGKILL)
    await child.wait()
    try:
        async with asyncio.timeout(60):  # only so a broken build fails instead of hanging
            async with store.conversation_lock(CONV):
                pass
    finally:
        await store.close()


async def test_two_stores_of_one_process_exclude_each_other(tmp_path: Path) -> None:
    """The lock belongs to the store's open file, not to the process: a second store on
    the same file (a CLI command run in the server's process, as tests do) waits too,
    and closing it drops nothing the first holds."""
    path = str(tmp_path / "recap.db")
    a, b = SqliteStore(path), SqliteStore(path)
    await a.open()
    await b.open()
    order: list[str] = []
    try:
        async with a.conversation_lock(CONV):
            waiting = asyncio.create_task(_hold(b, order))
            await asyncio.sleep(GRACE_S)
            order.append("a done")
        await asyncio.wait_for(waiting, 60)
    finally:
        await a.close()
        await b.close()
    assert order == ["a done", "b"]


async def _hold(store: SqliteStore, order: list[str]) -> None:
    async with store.conversation_lock(CONV):
        order.append("b")
