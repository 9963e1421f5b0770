"""The SQL both backends share: column lists, row mapping, JSON helpers, and the reads.

Sits between the store interface (`base.py`) and the two drivers (`sqlite.py`,
`postgres.py`). Queries are written here once, with `?` placeholders; a backend runs
them through its one small seam, `_fetch(sql, params)`, which the SQLite store answers
under its mutex and fault gate, and the PostgreSQL store on a pooled connection after
`numbered()` turned the marks into `$1, $2, ...`. Column lists are the record types'
field names, so records and tables cannot drift apart (`tests/store/test_schema.py`
checks the two schema definitions give the same tables and columns).

What is a backend's own stays there: SQLite its mutex, fault gate, summary cache and
chunked IN lists; PostgreSQL its pools, advisory locks and bulk (unnest) statements;
each its write transactions.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, cast

from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    Event,
    EventType,
    Layer,
    ListPosition,
    LoopSummary,
    Outcome,
    Store,
    SummaryVersion,
)


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
CONVERSATION_COLUMNS = ", ".join(names(ConversationInfo))
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
    return CompactionRecord(cast(Layer, layer), reason, cast(Outcome, outcome), *rest)


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
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(json.loads(text))
    return text


# -- the reads, written once -------------------------------------------------------------------


class SqlStore(Store):
    """The reads every SQL backend answers alike, over `_fetch`."""

    @abc.abstractmethod
    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """Run one read (`?` marks) as its own call; StoreError on any failure."""

    async def _fetch_one(self, sql: str, params: Sequence[Any]) -> Sequence[Any] | None:
        rows = await self._fetch(sql, params)
        return rows[0] if rows else None

    async def summary_versions(self, conv: ConversationRef) -> list[SummaryVersion]:
        rows = await self._fetch(
            f"SELECT {SUMMARY_COLUMNS} {SUMMARY_FROM} ORDER BY sv.version",
            (conv.tenant, conv.key),
        )
        return [summary(r) for r in rows]

    async def current_summary(self, conv: ConversationRef) -> SummaryVersion | None:
        row = await self._fetch_one(
            f"SELECT {SUMMARY_COLUMNS} {SUMMARY_FROM} AND sv.version = c.current_version",
            (conv.tenant, conv.key),
        )
        return None if row is None else summary(row)

    async def compactions(self, conv: ConversationRef) -> list[CompactionRecord]:
        rows = await self._fetch(
            f"SELECT {COMPACTION_COLUMNS} FROM compactions"
            " WHERE tenant = ? AND key = ? ORDER BY id",
            (conv.tenant, conv.key),
        )
        return [compaction(r) for r in rows]

    async def events(
        self, conv: ConversationRef, after_id: int = 0, *, page_size: int = 500
    ) -> AsyncIterator[Event]:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        last = after_id
        while True:
            # A fresh read per page: nothing is held while the consumer works.
            rows = await self._fetch(
                f"SELECT {EVENT_COLUMNS} FROM events"
                " WHERE tenant = ? AND key = ? AND id > ? ORDER BY id LIMIT ?",
                (conv.tenant, conv.key, last, page_size),
            )
            for row in rows:
                last = row[0]
                yield event(row)
            if len(rows) < page_size:
                return

    async def last_event(self, conv: ConversationRef, type: EventType) -> Event | None:
        row = await self._fetch_one(
            f"SELECT {EVENT_COLUMNS} FROM events"
            " WHERE tenant = ? AND key = ? AND type = ? ORDER BY id DESC LIMIT 1",
            (conv.tenant, conv.key, type),
        )
        return None if row is None else event(row)

    async def iter_archived(
        self, conv: ConversationRef, *, page_size: int = 500
    ) -> AsyncIterator[tuple[str, str]]:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        last = 0
        while True:
            # A fresh read per page, as in `events`: the consumer may be a slow client.
            rows = await self._fetch(
                "SELECT id, fingerprint, body FROM messages"
                " WHERE tenant = ? AND key = ? AND id > ? ORDER BY id LIMIT ?",
                (conv.tenant, conv.key, last, page_size),
            )
            for row_id, fp, body in rows:
                last = row_id
                yield fp, body
            if len(rows) < page_size:
                return

    async def get_loop_summary(
        self, conv: ConversationRef, turn_hash: str, max_rounds: int, now: float
    ) -> LoopSummary | None:
        row = await self._fetch_one(
            f"SELECT {LOOP_COLUMNS} FROM loop_summaries"
            " WHERE tenant = ? AND key = ? AND turn_hash = ? AND covered_rounds <= ?"
            " AND expires_at > ? ORDER BY covered_rounds DESC LIMIT 1",
            (conv.tenant, conv.key, turn_hash, max_rounds, now),
        )
        return None if row is None else LoopSummary(*row)

    async def list_conversations(
        self,
        tenant: str | None,
        limit: int = 50,
        before: float | None = None,
        after: ListPosition | None = None,
    ) -> list[ConversationInfo]:
        where: list[str] = []
        params: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            params.append(tenant)
        if before is not None:
            where.append("updated_at < ?")
            params.append(before)
        if after is not None:
            where.append("(updated_at < ? OR (updated_at = ? AND (tenant, key) > (?, ?)))")
            params += [after.updated_at, after.updated_at, after.tenant, after.key]
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        rows = await self._fetch(
            f"SELECT {CONVERSATION_COLUMNS} FROM conversations{clause}"
            " ORDER BY updated_at DESC, tenant, key LIMIT ?",
            (*params, max(0, limit)),
        )
        return [conversation(r) for r in rows]

    async def get_conversation(self, conv: ConversationRef) -> ConversationInfo | None:
        row = await self._fetch_one(
            f"SELECT {CONVERSATION_COLUMNS} FROM conversations WHERE tenant = ? AND key = ?",
            (conv.tenant, conv.key),
        )
        return None if row is None else conversation(row)
