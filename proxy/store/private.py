"""Files only their owner may read: the SQLite store's database and what sits beside it.

Used by the SQLite store when it opens its file (proxy/store/sqlite.py). The database holds
every conversation Recap archived and the deployment's compaction secret, so a store Recap
creates is made owner-only whatever the umask says: its directory 0700 (when Recap
creates it), the file 0600 (SQLite gives the `-wal` and `-shm` it creates later the
database file's mode). A file that already exists and that others may read (made by an
earlier release, or copied in) has its group and other bits taken away, with a warning;
one Recap cannot change (another user's) is left as it is, with a warning saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable

log = logging.getLogger("recap.store")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# SQLite's files beside a database: the WAL, its index, a rollback journal.
SIDECARS = ("-wal", "-shm", "-journal")


def make_private(database: str) -> None:
    """Before SQLite opens `database`: its directory and file made (owner-only) if missing,
    and any existing file of it that others may read made owner-only."""
    parent = os.path.dirname(os.path.abspath(database))
    os.makedirs(parent, mode=PRIVATE_DIR, exist_ok=True)
    # An empty file is a new database to SQLite; O_EXCL: a store created at this moment
    # by another process is that process's, and is checked below like any other.
    with contextlib.suppress(FileExistsError):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))
    tighten([database, *(database + suffix for suffix in SIDECARS)])


def tighten(paths: Iterable[str]) -> None:
    """Take group and other permissions away from each existing file of `paths`."""
    for path in paths:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        if not mode & 0o077:
            continue
        private = mode & 0o700
        try:
            os.chmod(path, private)
        except OSError as exc:
            log.warning(
                "%s is readable by other users (mode %04o) and its mode cannot be changed "
                "(%s): it holds every archived conversation and the compaction secret",
                path,
                mode,
                exc.strerror,
            )
            continue
        log.warning(
            "%s was readable by other users (mode %04o): set to %04o (it holds every "
            "archived conversation and the compaction secret)",
            path,
            mode,
            private,
        )
