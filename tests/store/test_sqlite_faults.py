"""How the SQLite store reads a failure, and the file checks it makes before writes."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import pytest

from proxy.store.sqlite_faults import FileFault, Kind, check_file, fault_kind


def _db(path: Path) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE t (x)")
        db.commit()
    st = path.stat()
    return st.st_dev, st.st_ino


def test_check_file_names_what_happened_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "recap.db"
    identity = _db(path)
    check_file(str(path), identity)  # ours, whole: nothing to say
    copy = tmp_path / "copy.db"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)
    with pytest.raises(FileFault, match="replaced"):
        check_file(str(path), identity)
    identity = (path.stat().st_dev, path.stat().st_ino)
    with path.open("r+b") as f:
        f.write(b"garbage garbage!")
    with pytest.raises(FileFault, match="not a SQLite database") as damaged:
        check_file(str(path), identity)
    assert damaged.value.damaged
    path.unlink()
    with pytest.raises(FileFault, match="missing"):
        check_file(str(path), identity)


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
