"""What the shared SQL reads and writes are made of: the write seam `Tx`, column lists
named after the record types' fields (so records and tables cannot drift apart), row
mapping, and JSON as both databases can hold it. Pure: no database is touched here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    Event,
    Layer,
    LoopSummary,
    Outcome,
    SummaryVersion,
)


class Tx(Protocol):
    """One open write transaction of a backend (`?` marks)."""

    async def execute(self, sql: str, params: Sequence[Any]) -> None: ...

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]: ...

    async def insert_rows(
        self,
        table: str,
        fixed: Mapping[str, Any],
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        suffix: str = "",
    ) -> int:
        """Insert one row per `rows` item (text `columns`, plus the `fixed` values every
        row shares), in order, with `suffix` (an ON CONFLICT clause); how many were new.
        The bulk statement is the backend's own (SQLite: executemany; PostgreSQL: unnest)."""
        ...


def names(record_type: type[Any], prefix: str = "") -> list[str]:
    """Column names are the record's field names, so the two cannot drift apart."""
    return [prefix + f.name for f in dataclasses.fields(record_type)]


def fields(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


SUMMARY_FIELDS = [c for c in names(SummaryVersion) if c != "current"]
SUMMARY_COLUMNS = ", ".join([f"sv.{c}" for c in SUMMARY_FIELDS] + ["c.current_version"])
SUMMARY_FROM = (
    "FROM summary_versions sv JOIN conversations c ON c.tenant = sv.tenant AND c.key = sv.key"
    " WHERE sv.tenant = ? AND sv.key = ?"
)
# The stored columns, then `compactions` counted from the audit rows (compactions_conv index).
CONVERSATION_COLUMNS = ", ".join(
    [c for c in names(ConversationInfo) if c != "compactions_made"]
    + [
        "(SELECT COUNT(*) FROM compactions a WHERE a.tenant = conversations.tenant"
        " AND a.key = conversations.key AND a.outcome = 'ok')"
    ]
)
LOOP_COLUMNS = ", ".join(names(LoopSummary))
COMPACTION_COLUMNS = ", ".join(names(CompactionRecord))
EVENT_COLUMNS = "id, type, payload, created_at"


def numbered(sql: str) -> str:
    """`?` marks as PostgreSQL's `$1, $2, ...` (our SQL has no `?` inside literals)."""
    parts = sql.split("?")
    return parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))


# -- row mapping -----------------------------------------------------------------------------


def summary(row: Sequence[Any]) -> SummaryVersion:
    """A summary row; its last column is the conversation's current_version."""
    values = dict(zip(SUMMARY_FIELDS, row, strict=False))
    values["rolled_back"] = bool(values["rolled_back"])
    return SummaryVersion(**values, current=row[-1] == values["version"])


def compaction(row: Sequence[Any]) -> CompactionRecord:
    layer, reason, outcome, *rest = row
    return CompactionRecord(Layer(layer), reason, cast(Outcome, outcome), *rest)


def conversation(row: Sequence[Any]) -> ConversationInfo:
    return ConversationInfo(*row)


def event(row: Sequence[Any]) -> Event:
    return Event(row[0], row[1], json.loads(row[2]), row[3])


# -- JSON ------------------------------------------------------------------------------------


def payload_json(payload: Mapping[str, Any]) -> str:
    return storable_json(json.dumps(dict(payload), ensure_ascii=False))


def storable_json(text: str) -> str:
    """JSON text both databases can hold: lone surrogates (valid in JSON escapes) cannot
    be UTF-8. Re-escaping changes the bytes but not the JSON value, and only for such
    text. JSON never has a raw NUL (control characters are escaped inside strings)."""
    if text.isascii() or _encodable(text):
        return text
    return json.dumps(json.loads(text))


_CHECK_CHARS = 1 << 18


async def storable_rows(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(fingerprint, storable JSON) rows. ASCII text is storable as it is (a flag, O(1));
    checking large non-ASCII text costs milliseconds, so it runs in a worker thread."""
    heavy = sum(len(body) for _, body in rows if not body.isascii())
    if heavy < _CHECK_CHARS:
        return [(fp, storable_json(body)) for fp, body in rows]
    return await asyncio.to_thread(lambda: [(fp, storable_json(body)) for fp, body in rows])


def _encodable(text: str) -> bool:
    """Whether `text` is valid as UTF-8 (no lone surrogate), checked in slices: encoding a
    30 MB text at once would hold the GIL for about 20 ms (a str's surrogates are lone by
    definition, so a slice boundary cannot split a valid pair)."""
    try:
        for i in range(0, len(text), _CHECK_CHARS):
            text[i : i + _CHECK_CHARS].encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
