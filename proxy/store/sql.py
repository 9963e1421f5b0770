"""The SQL both backends share: column lists, row mapping, JSON helpers, and the reads.

Sits between the store interface (`base.py`) and the two drivers (`sqlite.py`,
`postgres.py`). Queries are written here once, with `?` placeholders; a backend runs
them through a small seam of two calls: `_fetch(sql, params)` for one read, and
`_transact(body)` for one write transaction whose `body` talks to a `Tx`. The SQLite
store answers both under its mutex and fault gate; the PostgreSQL store on a pooled
connection after `numbered()` turned the marks into `$1, $2, ...`, retrying a
transaction the server rolled back. Column lists are the record types'
field names, so records and tables cannot drift apart (`tests/store/test_schema.py`
checks the two schema definitions give the same tables and columns).

What is a backend's own stays there: SQLite its mutex, fault gate, summary cache and
chunked IN lists; PostgreSQL its pools, advisory locks and bulk (unnest) statements
(archive writes, prune, summary matching); each its transactions.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    Event,
    EventType,
    Layer,
    ListPosition,
    LoopSummary,
    NewSummary,
    NotFound,
    Outcome,
    Store,
    StoreError,
    SummaryVersion,
)

T = TypeVar("T")

# The `deployment` row holding the compaction-reference key.
_SECRET = "compaction_secret"


class Tx(Protocol):
    """One open write transaction of a backend (`?` marks)."""

    async def execute(self, sql: str, params: Sequence[Any]) -> None: ...

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]: ...


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
    """The reads and writes every SQL backend answers alike, over `_fetch` and `_transact`."""

    _clock: Callable[[], float]

    @abc.abstractmethod
    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """Run one read (`?` marks) as its own call; StoreError on any failure."""

    @abc.abstractmethod
    async def _transact(self, body: Callable[[Tx], Awaitable[T]]) -> T:
        """Run `body` in one write transaction: all of its statements, or none."""

    def _text(self, value: Any) -> Any:
        """Free text as the backend can hold it (PostgreSQL: no NUL, no lone surrogate)."""
        return value

    def _forget(self, conv: ConversationRef) -> None:
        """A change to `conv`'s summary versions is about to be made (drop any cache)."""

    async def _fetch_one(self, sql: str, params: Sequence[Any]) -> Sequence[Any] | None:
        rows = await self._fetch(sql, params)
        return rows[0] if rows else None

    async def deployment_secret(self) -> bytes:
        sql = "SELECT value FROM deployment WHERE name = ?"
        row = await self._fetch_one(sql, (_SECRET,))
        if row is None:
            made = secrets.token_hex(32)

            async def write(tx: Tx) -> None:
                # Two replicas starting at once: the first write wins, both read it back.
                await tx.execute(
                    "INSERT INTO deployment (name, value) VALUES (?, ?)"
                    " ON CONFLICT (name) DO NOTHING",
                    (_SECRET, made),
                )

            await self._transact(write)
            row = await self._fetch_one(sql, (_SECRET,))
        if row is None:
            raise StoreError("the deployment secret was not kept")
        try:
            return bytes.fromhex(str(row[0]))
        except ValueError:
            raise StoreError("the stored deployment secret is not hex") from None

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

    async def find_loop_summary(
        self, conv: ConversationRef, covers: Sequence[str], now: float
    ) -> LoopSummary | None:
        hashes = [h for h in dict.fromkeys(covers) if h]
        if not hashes:
            return None
        marks = ", ".join("?" * len(hashes))
        row = await self._fetch_one(
            f"SELECT {LOOP_COLUMNS} FROM loop_summaries"
            f" WHERE tenant = ? AND key = ? AND covers_hash IN ({marks})"
            " AND expires_at > ? ORDER BY covered_rounds DESC LIMIT 1",
            (conv.tenant, conv.key, *hashes, now),
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

    # -- the writes ----------------------------------------------------------------------------

    async def add_summary_version(self, conv: ConversationRef, new: NewSummary) -> SummaryVersion:
        self._forget(conv)
        now = self._clock()

        async def body(tx: Tx) -> SummaryVersion:
            await touch(tx, conv, now)  # holds the conversation row: numbering is serial
            # MAX + 1, not current + 1: after a rollback the later numbers stay taken.
            ((version,),) = await tx.fetch(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM summary_versions"
                " WHERE tenant = ? AND key = ?",
                (conv.tenant, conv.key),
            )
            ((compact_count,),) = await tx.fetch(
                "UPDATE conversations SET current_version = ?, compact_count = compact_count + 1"
                " WHERE tenant = ? AND key = ? RETURNING compact_count",
                (version, conv.tenant, conv.key),
            )
            row = {
                **{k: self._text(v) for k, v in fields(new).items()},
                "version": version,
                "compact_count": compact_count,
                "created_at": now,
                "updated_at": now,
            }
            await insert(tx, "summary_versions", conv, row)
            return SummaryVersion(**row, current=True)

        return await self._transact(body)

    async def set_current_version(self, conv: ConversationRef, version: int | None) -> None:
        self._forget(conv)
        now = self._clock()

        async def body(tx: Tx) -> None:
            if version is not None:
                found = await tx.fetch(
                    "SELECT 1 FROM summary_versions WHERE tenant = ? AND key = ? AND version = ?",
                    (conv.tenant, conv.key, version),
                )
                if not found:
                    raise NotFound(f"no summary version {version}")
            updated = await tx.fetch(
                "UPDATE conversations SET current_version = ?, updated_at = ?"
                " WHERE tenant = ? AND key = ? RETURNING 1",
                (version, now, conv.tenant, conv.key),
            )
            if not updated:
                raise NotFound("no such conversation")
            # Rolled back past: never matched again (see Store.set_current_version).
            await tx.execute(
                "UPDATE summary_versions SET rolled_back = CASE WHEN version > ? THEN 1"
                " WHEN version = ? THEN 0 ELSE rolled_back END WHERE tenant = ? AND key = ?",
                (version or 0, version or 0, conv.tenant, conv.key),
            )

        await self._transact(body)

    async def record_compaction(self, conv: ConversationRef, record: CompactionRecord) -> None:
        now = self._clock()
        saved = max(0, record.tokens_before - record.tokens_after) if record.outcome == "ok" else 0

        async def body(tx: Tx) -> None:
            await touch(tx, conv, now)
            row = {k: self._text(v) for k, v in fields(record).items()}
            row["created_at"] = record.created_at or now
            await insert(tx, "compactions", conv, row)
            if saved:
                await tx.execute(
                    "UPDATE conversations SET tokens_saved = tokens_saved + ?"
                    " WHERE tenant = ? AND key = ?",
                    (saved, conv.tenant, conv.key),
                )

        await self._transact(body)

    async def append_event(
        self, conv: ConversationRef, type: EventType, payload: Mapping[str, Any]
    ) -> int:
        now = self._clock()
        text = payload_json(payload)

        async def body(tx: Tx) -> int:
            await touch(tx, conv, now)
            rows = await tx.fetch(
                "INSERT INTO events (tenant, key, type, payload, created_at)"
                " VALUES (?, ?, ?, ?, ?) RETURNING id",
                (conv.tenant, conv.key, type, text, now),
            )
            if not rows:
                raise StoreError("event id not returned")
            return int(rows[0][0])

        return await self._transact(body)

    async def put_loop_summary(self, conv: ConversationRef, s: LoopSummary) -> None:
        now = self._clock()

        async def body(tx: Tx) -> None:
            await touch(tx, conv, now)
            # Expired working memory is useless; dropping it here keeps the table small.
            await tx.execute(
                "DELETE FROM loop_summaries WHERE tenant = ? AND key = ? AND expires_at <= ?",
                (conv.tenant, conv.key, now),
            )
            row = {k: self._text(v) for k, v in fields(s).items()}
            key = ("turn_hash", "covered_rounds", "covers_hash")
            replace = ", ".join(f"{c} = excluded.{c}" for c in row if c not in key)
            await insert(
                tx,
                "loop_summaries",
                conv,
                row,
                f" ON CONFLICT (tenant, key, {', '.join(key)}) DO UPDATE SET {replace}",
            )

        await self._transact(body)


async def touch(tx: Tx, conv: ConversationRef, now: float) -> None:
    """Create the conversation on first write; every write counts as activity (prune,
    lists). On PostgreSQL this also takes the conversation row's lock until commit."""
    await tx.execute(
        "INSERT INTO conversations (tenant, key, created_at, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (tenant, key) DO UPDATE SET updated_at = excluded.updated_at",
        (conv.tenant, conv.key, now, now),
    )


async def insert(
    tx: Tx, table: str, conv: ConversationRef, values: Mapping[str, Any], suffix: str = ""
) -> None:
    columns = ["tenant", "key", *values]
    marks = ", ".join("?" * len(columns))
    await tx.execute(
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}){suffix}",
        (conv.tenant, conv.key, *values.values()),
    )
