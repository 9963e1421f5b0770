"""What SQLite and OS failures say about the embedded store, and the checks on its file.

Pure pieces of the SQLite store's fault handling (`proxy/store/sqlite.py` holds the
state: the current fault, retries, reconnecting): which errors mean "unavailable"
rather than "a bug of ours", how they become StoreError with a short reason, and the
checks a write makes that SQLite itself cannot (is the path still our file, is there
room left).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from contextlib import AbstractContextManager

from proxy.store.base import StoreError, translating
from proxy.store.migrations import SchemaTooNew

# SQLite primary result codes (sqlite3.h) that mean "unavailable", not "a bug of ours".
# Writes fail but the connection is sound: BUSY, LOCKED (another writer), FULL.
_WRITE_FAULTS = frozenset({5, 6, 13})
# The connection or its file is suspect: READONLY, IOERR, CORRUPT, CANTOPEN, NOTADB.
_FILE_FAULTS = frozenset({8, 10, 11, 14, 26})
_BUSY = frozenset({5, 6})
_DAMAGED = frozenset({11, 26})  # CORRUPT, NOTADB
_HEADER = b"SQLite format 3\x00"
# /readyz is not ready below this much free space: the next archive batch may not fit.
MIN_FREE_BYTES = 1 << 20


class FileFault(Exception):
    """The database file itself is gone, replaced or not a database (checked before writes)."""

    def __init__(self, reason: str, *, damaged: bool = False) -> None:
        super().__init__(reason)
        self.damaged = damaged


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a failure says about the store."""

    # The connection is suspect: reopen it before the next call.
    reconnect: bool = False
    # Another writer holds the lock: probes ask briefly instead of queueing.
    busy: bool = False
    # The content is damaged: a reopened file is checked (quick_check) before it is used.
    damaged: bool = False


@dataclasses.dataclass
class Fault:
    reason: str
    kind: Kind
    since: float
    retry_at: float


def fault_kind(exc: BaseException) -> Kind | None:
    """How `exc` makes the store unavailable; None when it is not a store fault (a bug)."""
    if isinstance(exc, FileFault):
        return Kind(reconnect=True, damaged=exc.damaged)
    if isinstance(exc, OSError):
        return Kind(reconnect=True)
    if isinstance(exc, sqlite3.Error):
        code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
        if code in _DAMAGED:
            return Kind(reconnect=True, damaged=True)
        if code in _FILE_FAULTS:
            return Kind(reconnect=True)
        if code in _WRITE_FAULTS:
            return Kind(busy=code in _BUSY)
        if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
            return Kind(reconnect=True)
    return None


def fault_reason(exc: BaseException) -> str:
    """A short cause for logs and /readyz: the error class, never any stored text."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
        # SQLite messages name tables and constraints, not bound values.
        return f"sqlite {code}: {str(exc)[:120]}"
    if isinstance(exc, UnicodeError):
        return "text is not valid UTF-8"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'os error'}"
    if isinstance(exc, FileFault | SchemaTooNew):
        return str(exc)
    return type(exc).__name__


def translated() -> AbstractContextManager[None]:
    """The one place where driver and OS errors become StoreError."""
    return translating(
        (sqlite3.Error, OSError, UnicodeError, FileFault), fault_reason, plain=(SchemaTooNew,)
    )


def check_file(path: str, identity: tuple[int, int]) -> None:
    """Before a write: is `path` still our database? (A few syscalls, no SQLite.)

    A deleted file would take writes into an unlinked inode, and a file
    overwritten in place is only noticed by SQLite when a page is not cached.
    `identity` is the (device, inode) the store opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileFault("database file is missing") from None
    try:
        st = os.fstat(fd)
        head = os.read(fd, len(_HEADER))
    finally:
        os.close(fd)
    if (st.st_dev, st.st_ino) != identity:
        raise FileFault("database file was replaced")
    if head and head != _HEADER:
        raise FileFault("database file is not a SQLite database", damaged=True)


def check_free_space(path: str) -> None:
    """StoreError when the file system holding `path` has under MIN_FREE_BYTES left."""
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise StoreError(fault_reason(exc)) from None
    free = fs.f_bavail * fs.f_frsize
    if free < MIN_FREE_BYTES:
        raise StoreError(f"disk nearly full: {free // 1024} KiB free")
