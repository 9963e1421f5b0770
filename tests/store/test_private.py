"""The SQLite store's files are its owner's alone: they hold every conversation and the
deployment's compaction secret.

On ce59ff6 `recap.db`, `-wal` and `-shm` were 0644 and `data/` 0755 under the usual
umask 022 (the journal's files were already 0600). Now a store Recap creates is 0600
in a 0700 directory (SQLite gives its `-wal` and `-shm` the database file's mode), and an
existing file others may read is set to 0600 when the store opens it, with a warning.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.store.sqlite import SqliteStore
from tests.conftest import LogCapture


@pytest.fixture
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_new_store_is_readable_by_its_owner_only(tmp_path: Path, usual_umask: None) -> None:
    path = tmp_path / "data" / "recap.db"
    store = SqliteStore(str(path))
    await store.open()
    try:
        await store.deployment_secret()  # a write: the -wal and -shm are in use
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(p.exists() for p in files)
        assert {p.name: oct(mode(p)) for p in files} == {p.name: "0o600" for p in files}
        assert oct(mode(path.parent)) == "0o700"
    finally:
        await store.close()


async def test_an_existing_file_others_can_read_is_made_private(
    tmp_path: Path, usual_umask: None, logs: LogCapture
) -> None:
    path = tmp_path / "recap.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.deployment_secret()
    await store.close()
    os.chmod(path, 0o644)  # as ce59ff6 left it
    again = SqliteStore(str(path))
    await again.open()
    try:
        assert oct(mode(path)) == "0o600"
        assert oct(mode(Path(f"{path}-wal"))) == "0o600"
    finally:
        await again.close()
    (warning,) = [r for r in logs.records("recap.store") if "readable" in r["msg"]]
    assert warning["level"] == "warning"
    assert "0644" in warning["msg"] and "0600" in warning["msg"]
