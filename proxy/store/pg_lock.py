"""One compaction at a time per conversation, across every replica on one database.

Used by `PostgresStore.conversation_lock`, around a compaction in the session and loop
stages (which re-read the store once they hold it, and reuse what another replica
wrote meanwhile). The lock is a session-level PostgreSQL advisory lock keyed by a hash
of (schema, tenant, key), held on a connection of its own pool for as long as the
compaction runs: a replica that dies closes its connections, and the server drops the
session's locks with them. In process, a `KeyedLocks` comes first, so one conversation
never ties up more than one lock connection per replica.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import asyncpg

from proxy.store.base import ConversationRef, KeyedLocks
from proxy.store.migrations import advisory_key
from proxy.store.pg_boundary import reason, translated

log = logging.getLogger("recap.store")


class AdvisoryLocks:
    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._local: KeyedLocks[ConversationRef] = KeyedLocks()

    @asynccontextmanager
    async def hold(self, pool: Any, schema: str, conv: ConversationRef) -> AsyncIterator[None]:
        """Hold the conversation's lock; `pool` is the lock pool (asyncpg.Pool)."""
        async with self._local.hold(conv):
            key = advisory_key("conversation", schema, conv.tenant, conv.key)
            with translated():
                conn = await pool.acquire(timeout=self._timeout_s)
            try:
                with translated():
                    await conn.execute("SELECT pg_advisory_lock($1)", key)
            except BaseException:
                # Cancelled or broken while waiting: the lock may have been granted just
                # then, so the session goes, and with it anything it holds.
                await _discard(pool, conn)
                raise
            try:
                yield
            finally:
                await _unlock(pool, conn, key)


async def _discard(pool: Any, conn: Any) -> None:
    """Close the session for good (its advisory locks go with it) and give the slot back."""
    # Either may find the connection already gone back to the pool (closed by the server).
    with suppress(asyncpg.InterfaceError):
        conn.terminate()
    with suppress(Exception):
        await pool.release(conn)


async def _unlock(pool: Any, conn: Any, key: int) -> None:
    """Release the lock and the connection; when that fails, end the session instead."""
    try:
        await conn.execute("SELECT pg_advisory_unlock($1)", key)
        await pool.release(conn)
    except BaseException as exc:
        # The lock cannot outlive the session, so ending it is a release too.
        await _discard(pool, conn)
        if not isinstance(exc, Exception):
            raise
        log.warning("advisory unlock failed, connection closed instead: %s", reason(exc))
