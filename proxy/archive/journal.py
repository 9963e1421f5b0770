"""The archive's write-ahead journal: a record is durable once appended, stored later.

An answered request must be in the archive even if the process is killed right after
(docs/reliability.md). Committing its record to the store before the answer's final bytes
puts a database transaction, a thread hop and the GIL they share with the event loop on
every request's path. Instead the archiver appends the record here, one `write(2)` of one
line on the loop: once it returns the kernel holds the bytes, so a killed process loses
nothing (the guarantee SQLite's WAL gives with synchronous=NORMAL; neither survives a power
cut). The archiver then stores journaled records in batches, off the request path.

On disk, in one directory, per owning process (a random `owner` id):

    <owner>.lock          held with flock(2) while the process lives
    <owner>.<seq>.jsonl   segments, one record a line, in order

Each batch stored carries a `JournalMark` (segment, records of it stored) in the same
transaction (`Store.record_exchanges`); segments before the mark are then deleted. At
start-up, `orphans` finds owners whose lock nobody holds (their process died) and `replay`
reads their records after the store's mark for them, so a record is stored exactly once
however the process died. Two processes starting at once never replay the same owner: the
first to lock it does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from proxy.store import sqlite_path
from proxy.store.base import ConversationRef, ExchangeRecord, JournalMark
from proxy.store.sqlite import MEMORY

log = logging.getLogger("recap.journal")

# A segment this large is closed and a new one started (the stored ones are then deleted).
SEGMENT_BYTES = 8 << 20


def encode(record: ExchangeRecord) -> bytes:
    """One line of ASCII JSON: every string round-trips exactly, lone surrogates too."""
    conv = record.conversation
    data = [
        conv.tenant,
        conv.key,
        [list(row) for row in record.messages],
        [[type_, dict(payload)] for type_, payload in record.events],
        [list(row) for row in record.params],
        record.at,
    ]
    return json.dumps(data, separators=(",", ":")).encode("ascii") + b"\n"


def decode(line: bytes) -> ExchangeRecord:
    tenant, key, messages, events, params, at = json.loads(line)
    return ExchangeRecord(
        ConversationRef(tenant, key),
        [(str(fp), str(body)) for fp, body in messages],
        [(type_, payload) for type_, payload in events],
        [(str(fp), str(body)) for fp, body in params],
        None if at is None else float(at),
    )


def _segment_path(directory: Path, owner: str, seq: int) -> Path:
    return directory / f"{owner}.{seq:08d}.jsonl"


def _lock_path(directory: Path, owner: str) -> Path:
    return directory / f"{owner}.lock"


def _segments(directory: Path, owner: str) -> list[tuple[int, Path]]:
    found = []
    for path in directory.glob(f"{owner}.*.jsonl"):
        with contextlib.suppress(ValueError):
            found.append((int(path.name.split(".")[1]), path))
    return sorted(found)


def _remove(directory: Path, owner: str) -> None:
    """An owner's segments, then its lock file (so a journal is never found lockless)."""
    for _, path in _segments(directory, owner):
        path.unlink(missing_ok=True)
    _lock_path(directory, owner).unlink(missing_ok=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Journal:
    """This process's journal: `append` records, `stored` what the store has taken."""

    def __init__(self, directory: Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.owner = uuid.uuid4().hex
        self.segment_bytes = segment_bytes
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._segment = 0
        self._oldest = 0  # the oldest segment not yet deleted
        self._records = 0  # records appended to the current segment
        self._size = 0

    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(_lock_path(self.directory, self.owner), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock_fd = fd
        self._start(0)

    def _start(self, seq: int) -> None:
        path = _segment_path(self.directory, self.owner, seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._segment, self._records, self._size = fd, seq, 0, 0

    def append(self, record: ExchangeRecord) -> tuple[int, int]:
        """Write one record; (segment, index in it). Raises OSError (disk full, ...)."""
        if self._fd is None:
            raise OSError("the journal is not open")
        if self._size >= self.segment_bytes:
            self._start(self._segment + 1)
        line = encode(record)
        _write_all(self._fd, line)
        self._size += len(line)
        self._records += 1
        return self._segment, self._records - 1

    def mark(self, segment: int, index: int) -> JournalMark:
        """The mark saying every record up to (segment, index) is stored."""
        return JournalMark(self.owner, segment, index + 1)

    def stored(self, mark: JournalMark) -> None:
        """The store holds everything up to `mark`: delete the segments before it, and
        start afresh when the current segment is all stored."""
        if self._fd is None:
            return
        segment = mark.segment
        if segment == self._segment and mark.position >= self._records and self._records:
            self._start(self._segment + 1)
            segment = self._segment
        for seq in range(self._oldest, segment):
            _segment_path(self.directory, self.owner, seq).unlink(missing_ok=True)
        self._oldest = max(self._oldest, segment)

    def close(self, *, all_stored: bool) -> None:
        """Stop appending. With everything stored, the files go; otherwise they stay for
        the next start to replay (the lock is released either way)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if all_stored:
            _remove(self.directory, self.owner)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass
class Orphan:
    """A dead process's journal, locked by this process while it is replayed."""

    directory: Path
    owner: str
    _fd: int | None = field(default=None, repr=False)

    def records(self, after: JournalMark | None) -> Iterator[tuple[JournalMark, ExchangeRecord]]:
        """Its records after `after`, each with the mark that says it is stored. A line
        that cannot be read is skipped, with a warning: the last one cut short (the
        process died mid-write; that write never returned, so no answer waited for it),
        or one the disk damaged."""
        for seq, path in _segments(self.directory, self.owner):
            if after is not None and seq < after.segment:
                continue
            skip = after.position if after is not None and seq == after.segment else 0
            with path.open("rb") as f:
                for index, line in enumerate(f):
                    if index < skip:
                        continue
                    try:
                        if not line.endswith(b"\n"):
                            raise ValueError("cut short")
                        record = decode(line)
                    except (ValueError, TypeError) as exc:
                        log.warning("journal %s: line %d skipped (%s)", path, index + 1, exc)
                        continue
                    yield JournalMark(self.owner, seq, index + 1), record

    def remove(self) -> None:
        _remove(self.directory, self.owner)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def orphans(directory: Path, *, own: str | None = None) -> list[Orphan]:
    """Journals in `directory` whose process is gone (their lock is free), each now
    locked by this process; `own` (this process's owner id) is never one."""
    if not directory.is_dir():
        return []
    owners = {p.name.split(".")[0] for p in directory.iterdir() if p.suffix in (".lock", ".jsonl")}
    found = []
    for owner in sorted(owners - {own}):
        try:
            fd = os.open(_lock_path(directory, owner), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            log.warning("journal %s/%s: cannot open its lock (%s)", directory, owner, exc)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live process holds it
            continue
        found.append(Orphan(directory, owner, fd))
    return found


def journal_dir(store_url: str, configured: str | None, base_dir: str) -> Path | None:
    """Where the journal lives: `archive.journal_dir` if set (relative to the config's
    directory), else beside an SQLite file, else `recap-journal` in the config's
    directory; None for an in-memory store (nothing it holds survives the process)."""
    if configured:
        path = Path(configured)
        return path if path.is_absolute() else Path(base_dir) / path
    if store_url.startswith("sqlite:"):
        db = sqlite_path(store_url, base_dir)
        return None if db == MEMORY else Path(db + "-recap-journal")
    return Path(base_dir) / "recap-journal"
