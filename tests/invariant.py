"""The first law, checked: nothing the client sent is lost silently (issue 12.2).

Every message the client sent is in the forwarded body verbatim, or replaced by a
placeholder naming its archived original (`recap://message/<fingerprint>`), or covered
by a summary whose recorded coverage includes it: a session summary version whose
boundary hash is this request's chain hash at its boundary, or a loop working summary
whose covers hash is this request's chain hash through its last round. The coverage
is read from the proxy's own store (its SQLite file), as recorded, not inferred.
Only the last-resort fit may drop more, and then the response says how many and why.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.compaction.framing import FRAME_OPEN, defuse
from proxy.compaction.trim import ARCHIVE_SCHEME
from proxy.conversation import check_history
from proxy.messages import chain_hashes, fingerprint, is_pinned, split_pinned


def _rows(db: Path, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return list(conn.execute(sql, params))


def covered_indices(
    db: Path, tenant: str, key: str, body: list[Any], forwarded: list[Any]
) -> set[int]:
    """Indices into `body` that a summary in `forwarded` stands for, by recorded coverage."""
    chain = chain_hashes(body)
    at = {h: i for i, h in enumerate(chain)}
    sessions = _rows(
        db,
        "SELECT summary, boundary_hash FROM summary_versions WHERE tenant = ? AND key = ?",
        (tenant, key),
    )
    loops = _rows(
        db,
        "SELECT summary, turn_hash, covers_hash FROM loop_summaries WHERE tenant = ? AND key = ?",
        (tenant, key),
    )
    covered: set[int] = set()
    for message in forwarded:
        content = message.get("content")
        if not isinstance(content, str) or FRAME_OPEN not in content:
            continue
        inside = content.split(FRAME_OPEN, 1)[1]
        found = False
        for summary, boundary in sessions:
            if boundary in at and defuse(summary.strip()) in inside:
                covered.update(range(at[boundary] + 1))
                found = True
        for summary, turn, covers in loops:
            if turn in at and covers in at and defuse(summary.strip()) in inside:
                covered.update(range(at[turn] + 1, at[covers] + 1))
                found = True
        assert found, "a summary is forwarded whose recorded coverage is not this history"
    return covered


def assert_nothing_lost(
    db: Path,
    tenant: str,
    key: str,
    sent: list[Any],
    forwarded: list[Any],
    headers: Mapping[str, str],
) -> int:
    """Fails unless the invariant holds; returns how many messages the fit dropped."""
    pinned, body = split_pinned(sent)
    assert forwarded[: len(pinned)] == pinned, "leading instructions changed"
    if check_history(sent) == []:
        assert check_history(forwarded) == [], check_history(forwarded)
    covered = covered_indices(db, tenant, key, body, forwarded)
    blob = repr(forwarded)
    lost: list[int] = []
    for i, m in enumerate(body):
        if is_pinned(m):
            assert m in forwarded, f"instruction {i} was not forwarded as sent"
        elif i in covered or m in forwarded or f"{ARCHIVE_SCHEME}{fingerprint(m)}" in blob:
            continue
        else:
            lost.append(i)
    dropped = int(headers.get("x-recap-dropped-messages", "0"))
    assert len(lost) <= dropped, f"messages {lost} neither sent, archived-placeholder nor covered"
    if dropped:
        assert headers.get("x-recap-dropped-reason"), "dropped without saying why"
    return dropped
