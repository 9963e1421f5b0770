"""One compaction at a time per conversation, across every process on one SQLite file.

Used by `SqliteStore.conversation_lock`, around a compaction in the session and loop
stages (which re-read the store once they hold it and reuse what another process wrote
meanwhile), so `recap compact` beside a running server waits for the server's compaction
of that conversation instead of making a second summary that supersedes the first.

The lock is one byte of a file beside the database (`recap.db.locks`, owner-only), at
an offset given by a hash of (tenant, key), locked with an open file description lock
(Linux's `F_OFD_SETLK`): it belongs to this store's open file, not to the process, so
another store on the same file waits for it even in the same process, and closing any
other descriptor never drops it (POSIX record locks would be, the pitfall
proxy/store/sqlite_faults.py avoids for the database itself); a process that dies drops
it with its descriptors. Without OFD locks (not Linux) the lock is a POSIX one, which
still excludes other processes. The lock is taken without blocking and asked again every
`POLL_S`: a thread blocked in fcntl could not be cancelled with the request that waits.
In process, a `KeyedLocks` comes first: the store's coroutines share one descriptor, and
the kernel lets its owner take its own lock twice.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from proxy.store.base import ConversationRef, KeyedLocks, StoreError
from proxy.store.private import PRIVATE_FILE

# How often a lock another process holds is asked for again.
POLL_S = 0.05
# Offsets are drawn from 2**40 bytes (never written: a lock may lie past the end of file).
_OFFSETS = 1 << 40
_OFD = getattr(fcntl, "F_OFD_SETLK", None)


def lock_path(database: str) -> Path:
    return Path(database + ".locks")


def offset(conv: ConversationRef) -> int:
    digest = hashlib.sha256(f"{conv.tenant}\x00{conv.key}".encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest()[:8], "big") % _OFFSETS


class FileLocks:
    """The conversation locks of one SQLite database (`database`: its path)."""

    def __init__(self, database: str) -> None:
        self._path = lock_path(database)
        self._fd: int | None = None
        self._local: KeyedLocks[ConversationRef] = KeyedLocks()
        # Offsets this store holds, with how many of its conversations hold each (two
        # conversations may hash to one byte: it is unlocked when the last one is done).
        self._held: dict[int, int] = {}

    @asynccontextmanager
    async def hold(self, conv: ConversationRef) -> AsyncIterator[None]:
        async with self._local.hold(conv):
            at = offset(conv)
            await self._acquire(at)
            try:
                yield
            finally:
                self._release(at)

    async def _acquire(self, at: int) -> None:
        if at in self._held:
            self._held[at] += 1
            return
        fd = self._descriptor()
        while not _try_lock(fd, at):
            await asyncio.sleep(POLL_S)
        self._held[at] = 1

    def _release(self, at: int) -> None:
        self._held[at] -= 1
        if self._held[at] == 0:
            del self._held[at]
            if self._fd is not None:
                _unlock(self._fd, at)

    def _descriptor(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
            except OSError as exc:
                raise StoreError(
                    f"cannot open the lock file {self._path}: {exc.strerror}"
                ) from None
        return self._fd

    def close(self) -> None:
        """Let the file go (its locks with it); only once nothing is held."""
        if self._fd is not None and not self._held:
            os.close(self._fd)
            self._fd = None


def _flock(kind: int, at: int) -> bytes:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0: required for OFD locks).
    return struct.pack("@hhqqi4x", kind, os.SEEK_SET, at, 1, 0)


def _try_lock(fd: int, at: int) -> bool:
    try:
        if _OFD is not None:
            fcntl.fcntl(fd, _OFD, _flock(fcntl.F_WRLCK, at))
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, at, os.SEEK_SET)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another holds it
        return False
    except OSError as exc:
        raise StoreError(f"cannot lock the conversation: {exc.strerror}") from None
    return True


def _unlock(fd: int, at: int) -> None:
    if _OFD is not None:
        fcntl.fcntl(fd, _OFD, _flock(fcntl.F_UNLCK, at))
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, at, os.SEEK_SET)
