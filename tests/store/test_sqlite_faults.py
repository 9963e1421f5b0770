"""How the SQLite store reads a failure, and the file checks it makes before writes."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.store.sqlite_faults import DatabaseFile, FileFault, Kind, fault_kind


def _db(path: Path) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("CREATE TABLE t (x)")
        db.commit()
    st = path.stat()
    return st.st_dev, st.st_ino


def _identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def test_file_check_names_what_happened_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    _db(path)
    # Held open by SQLite, as the store holds it: the check reads through that descriptor.
    with contextlib.closing(sqlite3.connect(path)) as held:
        held.execute("SELECT * FROM t").fetchall()
        DatabaseFile(str(path), _identity(path)).check()  # ours, whole: nothing to say
        old = DatabaseFile(str(path), _identity(path))
        copy = tmp_path / "copy.db"
        copy.write_bytes(path.read_bytes())
        os.replace(copy, path)
        with pytest.raises(FileFault, match="replaced"):
            old.check()
    with contextlib.closing(sqlite3.connect(path)) as held:
        held.execute("SELECT * FROM t").fetchall()
        file = DatabaseFile(str(path), _identity(path))
        file.check()
        with path.open("r+b") as f:
            f.write(b"garbage garbage!")
        with pytest.raises(FileFault, match="not a SQLite database") as damaged:
            file.check()
        assert damaged.value.damaged
    path.unlink()
    with pytest.raises(FileFault, match="missing"):
        file.check()


def test_file_check_keeps_the_locks_sqlite_holds(tmp_path: Path) -> None:
    """Closing any descriptor of the file drops this process's POSIX locks on it. With its
    shared lock gone, another process closing its connection takes itself for the last
    one and deletes the write-ahead log this process still writes into."""
    path = tmp_path / "recap.db"
    _db(path)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as ours:
        ours.execute("INSERT INTO t VALUES (1)")  # WAL open, shared lock held
        file = DatabaseFile(str(path), _identity(path))
        for _ in range(3):
            file.check()
        other = subprocess.run(
            [sys.executable, "-c", OTHER_PROCESS, str(path)], capture_output=True, text=True
        )
        assert other.returncode == 0, other.stderr
        assert other.stdout.strip() == "1"  # it saw our commit
        assert os.path.exists(f"{path}-wal")  # and did not take our log away
        ours.execute("INSERT INTO t VALUES (2)")
    with contextlib.closing(sqlite3.connect(path)) as after:
        assert after.execute("SELECT COUNT(*) FROM t").fetchone() == (2,)


# Another process (the `recap` CLI) opening, reading and closing the same file.
OTHER_PROCESS = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
print(db.execute("SELECT COUNT(*) FROM t").fetchone()[0])
db.close()
"""


def test_fault_kinds_from_real_sqlite_errors(tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    _db(path)
    with (
        contextlib.closing(sqlite3.connect(path, timeout=0)) as a,
        contextlib.closing(sqlite3.connect(path, timeout=0)) as b,
    ):
        a.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError) as busy:
            b.execute("BEGIN IMMEDIATE")
        a.rollback()
    assert fault_kind(busy.value) == Kind(busy=True)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all " * 100)
    with (
        contextlib.closing(sqlite3.connect(garbage)) as db,
        pytest.raises(sqlite3.DatabaseError) as notadb,
    ):
        db.execute("SELECT * FROM sqlite_master")
    assert fault_kind(notadb.value) == Kind(reconnect=True, damaged=True)
    with (
        contextlib.closing(sqlite3.connect(":memory:")) as db,
        pytest.raises(sqlite3.OperationalError) as bug,
    ):
        db.execute("SELECT * FROM no_such_table")
    assert fault_kind(bug.value) is None  # a bug of ours, not a fault of the store
