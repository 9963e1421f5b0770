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
import stat
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
_FD_DIR = "/proc/self/fd"
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


class DatabaseFile:
    """The checks before a write that SQLite cannot make: is the path still our file?

    A deleted file would take writes into an unlinked inode, and a file overwritten
    in place is only noticed by SQLite when a page is not cached.

    The file is never opened here: closing any descriptor of the database file drops
    every POSIX lock this process holds on it, SQLite's included (a documented SQLite
    pitfall). Another process's connection (the `recap` CLI) then believes it is the
    last one and deletes the write-ahead log this process goes on writing into. So
    identity is checked by `stat` on the path, and the header is read with `pread` on
    the descriptor SQLite itself holds, found by `fstat` and never opened or closed.
    """

    def __init__(self, path: str, identity: tuple[int, int]) -> None:
        self.path = path
        # The (device, inode) the store opened.
        self.identity = identity
        self._fd: int | None = None  # SQLite's descriptor of it, once found

    def check(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise FileFault("database file is missing") from None
        if (st.st_dev, st.st_ino) != self.identity:
            raise FileFault("database file was replaced")
        head = self._header()
        if head is not None and head != _HEADER:
            raise FileFault("database file is not a SQLite database", damaged=True)

    def _header(self) -> bytes | None:
        """The file's first bytes; None where no descriptor of it can be found."""
        if self._fd is None or not self._holds(self._fd):
            self._fd = next((fd for fd in _descriptors() if self._holds(fd)), None)
        if self._fd is None:
            return None
        try:
            return os.pread(self._fd, len(_HEADER), 0)
        except OSError:
            self._fd = None
            return None

    def _holds(self, fd: int) -> bool:
        try:
            st = os.fstat(fd)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == self.identity


def _descriptors() -> list[int]:
    """This process's open descriptors (Linux: /proc/self/fd; elsewhere none)."""
    try:
        return [int(name) for name in os.listdir(_FD_DIR) if name.isdigit()]
    except OSError:
        return []


def check_free_space(path: str) -> None:
    """StoreError when the file system holding `path` has under MIN_FREE_BYTES left."""
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise StoreError(fault_reason(exc)) from None
    free = fs.f_bavail * fs.f_frsize
    if free < MIN_FREE_BYTES:
        raise StoreError(f"disk nearly full: {free // 1024} KiB free")
