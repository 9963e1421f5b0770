"""The persistent store: the interface, its record types and `open_store`.

The app calls `open_store(config.store, config.base_dir)` in its lifespan, then
`await store.open()`; everything else imports only the names below.

URLs:
    sqlite:///relative/path.db   relative to base_dir (the config file's directory)
    sqlite:////abs/path.db       absolute
    sqlite://:memory:            in memory (tests)
    postgresql://user:pass@host:port/db[?search_path=schema&sslmode=...]
    postgres://...               the same: PostgreSQL (asyncpg), for several replicas;
                                 query parameters asyncpg does not know are server settings
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from proxy.config import StorePool
from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    Event,
    EventType,
    KeyedLocks,
    Layer,
    LoopSummary,
    NewSummary,
    NotFound,
    Outcome,
    Store,
    StoreError,
    SummaryVersion,
    pick_matching,
)
from proxy.store.sqlite import MEMORY, SqliteStore

__all__ = [
    "CompactionRecord",
    "ConversationInfo",
    "ConversationRef",
    "Event",
    "EventType",
    "KeyedLocks",
    "Layer",
    "LoopSummary",
    "NewSummary",
    "NotFound",
    "Outcome",
    "SqliteStore",
    "Store",
    "StoreError",
    "SummaryVersion",
    "open_store",
    "pick_matching",
    "sqlite_path",
]

_SQLITE = "sqlite://"


def sqlite_path(url: str, base_dir: str) -> str:
    """The database file a sqlite URL names (or ":memory:")."""
    if not url.startswith(_SQLITE):
        raise StoreError("sqlite URL must start with sqlite://")
    rest = url[len(_SQLITE) :]
    if rest in (MEMORY, "/" + MEMORY):
        return MEMORY
    if not rest.startswith("/") or rest == "/" or "?" in rest:
        raise StoreError("sqlite URL must be sqlite:///relative.db, sqlite:////abs.db or :memory:")
    path = rest[1:]
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def open_store(
    url: str,
    base_dir: str,
    *,
    clock: Callable[[], float] = time.time,
    pool: StorePool | None = None,
) -> Store:
    """Build the backend the URL names; the caller awaits `open()` (or uses `async with`).

    `pool` sizes a PostgreSQL store's connection pools (config `store_pool`); SQLite ignores it.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        return SqliteStore(sqlite_path(url, base_dir), clock=clock)
    if scheme in ("postgresql", "postgres"):
        # Imported here: a SQLite deployment never loads the PostgreSQL driver.
        from proxy.store.postgres import PostgresStore

        pool = pool or StorePool()
        return PostgresStore(
            url,
            clock=clock,
            min_size=pool.min_size,
            max_size=pool.max_size,
            lock_max_size=pool.lock_max_size,
            timeout_s=pool.timeout_s,
        )
    # Only the scheme: the rest of a URL may hold a password.
    raise StoreError(f"unsupported store URL scheme {scheme!r}")
