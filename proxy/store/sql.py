"""The SQL both backends share: every query, written once (its parts: `rows.py`).

Sits between the store interface (`base.py`) and the two drivers (`sqlite.py`,
`postgres.py`). Queries are written here once, with `?` placeholders; a backend runs
them through a small seam, as httpx's transports or encode/databases' backends do:

    _fetch(sql, params)                  one read
    _fetch_in(sql, params, column, values)  one read of `AND column IN values`, any length
    _transact(body)                      one write transaction; `body` talks to a `Tx`:
        Tx.execute / Tx.fetch            one statement
        Tx.insert_rows                   many rows in one go (the bulk statement)

The SQLite store answers them under its mutex and fault gate (chunked IN lists,
executemany); the PostgreSQL store on a pooled connection after `numbered()` turned
the marks into `$1, $2, ...` (`= ANY` arrays, unnest), retrying a transaction the
server rolled back. Column lists are the record types' field names, so records and
tables cannot drift apart; the tables are the same on both databases, made by one
migration history (`schema.py`; `tests/store/test_schema.py` checks it).

What is a backend's own stays there: SQLite its mutex, fault gate, file checks and
summary cache; PostgreSQL its pools, advisory locks and bulk statements; each its
transactions and how it locks rows it prunes.
"""

from __future__ import annotations

import abc
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    Event,
    EventType,
    ExchangeRecord,
    JournalMark,
    ListPosition,
    LoopSummary,
    NewSummary,
    NotFound,
    Store,
    StoreError,
    SummaryVersion,
    pick_matching,
)
from proxy.store.rows import (
    COMPACTION_COLUMNS,
    CONVERSATION_COLUMNS,
    EVENT_COLUMNS,
    LOOP_COLUMNS,
    SUMMARY_COLUMNS,
    SUMMARY_FIELDS,
    SUMMARY_FROM,
    Tx,
    compaction,
    conversation,
    event,
    fields,
    payload_json,
    storable_rows,
    summary,
)

T = TypeVar("T")

# The `deployment` row holding the compaction-reference key.
_SECRET = "compaction_secret"


# -- the reads, written once -------------------------------------------------------------------


Candidates = list[tuple[int, int, str]]  # (version, covered, boundary_hash)


class SqlStore(Store):
    """Every read and write, over the driver seam `_fetch`, `_fetch_in` and `_transact`."""

    _clock: Callable[[], float]
    # How many conversations one prune transaction deletes, and how it treats rows another
    # transaction holds (PostgreSQL: skips them, they are being touched so are active).
    _prune_batch = 100
    _prune_lock = ""

    @abc.abstractmethod
    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """Run one read (`?` marks) as its own call; StoreError on any failure."""

    @abc.abstractmethod
    async def _transact(self, body: Callable[[Tx], Awaitable[T]]) -> T:
        """Run `body` in one write transaction: all of its statements, or none."""

    @abc.abstractmethod
    async def _fetch_in(
        self, sql: str, params: Sequence[Any], column: str, values: Sequence[Any]
    ) -> list[Sequence[Any]]:
        """The rows of `sql` (which ends in a WHERE clause) `AND column IN values`, for
        any number of distinct values, in one read."""

    def _text(self, value: Any) -> Any:
        """Free text as the backend can hold it (PostgreSQL: no NUL, no lone surrogate)."""
        return value

    def _forget(self, conv: ConversationRef) -> None:
        """A change to `conv`'s summary versions is about to be made (drop any cache)."""

    def _forget_all(self) -> None:
        """Many conversations are about to change (prune)."""

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

    async def summary_version(self, conv: ConversationRef, version: int) -> SummaryVersion | None:
        row = await self._fetch_one(
            f"SELECT {SUMMARY_COLUMNS} {SUMMARY_FROM} AND sv.version = ?",
            (conv.tenant, conv.key, version),
        )
        return None if row is None else summary(row)

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

    async def matching_summary(
        self, conv: ConversationRef, boundary_hashes: Sequence[str]
    ) -> SummaryVersion | None:
        candidates, current = await self._summary_candidates(conv)
        chosen = pick_matching(candidates, current.version if current else 0, boundary_hashes)
        if chosen is None:
            return None
        if current is not None and chosen == current.version:
            return current
        row = await self._fetch_one(
            f"SELECT {SUMMARY_COLUMNS} {SUMMARY_FROM} AND sv.version = ?",
            (conv.tenant, conv.key, chosen),
        )
        return None if row is None else summary(row)

    async def _summary_candidates(
        self, conv: ConversationRef
    ) -> tuple[Candidates, SummaryVersion | None]:
        """Every version that may match (small columns), and the whole current version:
        the current version is the usual answer, so one round trip mostly suffices."""
        full = ", ".join(
            f"CASE WHEN sv.version = c.current_version THEN sv.{c} END" for c in SUMMARY_FIELDS
        )
        rows = await self._fetch(
            f"SELECT sv.version, sv.covered, sv.boundary_hash, {full}, c.current_version"
            f" {SUMMARY_FROM} AND sv.version <= c.current_version AND sv.rolled_back = 0",
            (conv.tenant, conv.key),
        )
        current = next((summary(list(r)[3:]) for r in rows if r[0] == r[-1]), None)
        return [(r[0], r[1], r[2]) for r in rows], current

    async def archived_messages(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        return await self._archived("messages", conv, fingerprints)

    async def archived_params(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        return await self._archived("request_params", conv, fingerprints)

    async def _archived(
        self, table: str, conv: ConversationRef, fingerprints: Sequence[str] | None
    ) -> dict[str, str]:
        base = f"SELECT id, fingerprint, body FROM {table} WHERE tenant = ? AND key = ?"
        if fingerprints is None:
            rows = await self._fetch(f"{base} ORDER BY id", (conv.tenant, conv.key))
        else:
            wanted = list(dict.fromkeys(fingerprints))
            rows = await self._fetch_in(base, (conv.tenant, conv.key), "fingerprint", wanted)
            rows.sort(key=lambda r: int(r[0]))
        return {fp: body for _, fp, body in rows}

    # -- the writes ----------------------------------------------------------------------------

    async def check_writable(self) -> None:
        """A real write (the heartbeat row)."""

        async def body(tx: Tx) -> None:
            await tx.execute(
                "INSERT INTO heartbeat (id, at) VALUES (1, ?)"
                " ON CONFLICT (id) DO UPDATE SET at = excluded.at",
                (self._clock(),),
            )

        await self._transact(body)

    async def archive_messages(
        self, conv: ConversationRef, messages: Sequence[tuple[str, str]]
    ) -> int:
        if not messages:
            return 0
        now = self._clock()

        rows = await storable_rows(unique(messages))

        async def body(tx: Tx) -> int:
            await touch(tx, conv, now)
            return await add_archived(tx, "messages", conv, rows, now)

        return await self._transact(body)

    async def record_exchanges(
        self, items: Sequence[ExchangeRecord], mark: JournalMark | None = None
    ) -> None:
        if not items and mark is None:
            return
        now = self._clock()
        # Conversation rows are locked in key order, the same in every replica, so two
        # batches never wait on each other in a cycle. Stable: each one's events keep order.
        ordered = sorted(items, key=lambda i: (i.conversation.tenant, i.conversation.key))
        # The rows as the database holds them, made before the transaction: the body only
        # writes (a backend may run it whole on its own thread).
        prepared = [
            (
                item.conversation,
                await storable_rows(unique(item.messages)),
                await storable_rows(unique(item.params)),
                [(t, payload_json(p)) for t, p in item.events],
                item.at if item.at is not None else now,
            )
            for item in ordered
        ]

        async def body(tx: Tx) -> None:
            for conv, messages, params, events, at in prepared:
                await touch(tx, conv, at)
                await add_archived(tx, "messages", conv, messages, at)
                await add_archived(tx, "request_params", conv, params, at)
                if events:
                    await tx.insert_rows(
                        "events",
                        {"tenant": conv.tenant, "key": conv.key, "created_at": at},
                        ("type", "payload"),
                        events,
                    )
            if mark is not None:
                await tx.execute(
                    "INSERT INTO journal_marks (owner, segment, position) VALUES (?, ?, ?)"
                    " ON CONFLICT (owner) DO UPDATE"
                    " SET segment = excluded.segment, position = excluded.position",
                    (mark.owner, mark.segment, mark.position),
                )

        await self._transact(body)

    async def journal_mark(self, owner: str) -> JournalMark | None:
        row = await self._fetch_one(
            "SELECT segment, position FROM journal_marks WHERE owner = ?", (owner,)
        )
        return None if row is None else JournalMark(owner, int(row[0]), int(row[1]))

    async def forget_journal(self, owner: str) -> None:
        async def body(tx: Tx) -> None:
            await tx.execute("DELETE FROM journal_marks WHERE owner = ?", (owner,))

        await self._transact(body)

    async def prune(self, older_than: float) -> int:
        self._forget_all()
        pruned = 0

        async def batch(tx: Tx) -> int:
            # Each conversation goes whole: ON DELETE CASCADE takes its rows in every other
            # table with it. Re-checked inside the transaction: a request may have touched it.
            rows = await tx.fetch(
                "DELETE FROM conversations WHERE (tenant, key) IN ("
                " SELECT tenant, key FROM conversations WHERE updated_at < ?"
                f" LIMIT {int(self._prune_batch)}{self._prune_lock})"
                " AND updated_at < ? RETURNING 1",
                (older_than, older_than),
            )
            return len(rows)

        while True:
            deleted = await self._transact(batch)
            pruned += deleted
            if deleted == 0:
                return pruned

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
    lists), a record stored late (journaled, `ExchangeRecord.at`) never moving it back.
    On PostgreSQL this also takes the conversation row's lock until commit."""
    await tx.execute(
        "INSERT INTO conversations (tenant, key, created_at, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (tenant, key) DO UPDATE SET updated_at = CASE"
        " WHEN excluded.updated_at > conversations.updated_at THEN excluded.updated_at"
        " ELSE conversations.updated_at END",
        (conv.tenant, conv.key, now, now),
    )


def unique(items: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(fingerprint, JSON) rows, each fingerprint once: the first body of a repeated one."""
    first: dict[str, str] = {}
    for fp, body in items:
        first.setdefault(fp, body)
    return list(first.items())


async def add_archived(
    tx: Tx, table: str, conv: ConversationRef, rows: Sequence[tuple[str, str]], now: float
) -> int:
    """Insert-or-ignore (fingerprint, storable JSON) rows of `messages` or `request_params`
    (`unique`, `storable_rows`), in order; new messages are counted on the conversation."""
    if not rows:
        return 0
    added = await tx.insert_rows(
        table,
        {"tenant": conv.tenant, "key": conv.key, "first_seen_at": now},
        ("fingerprint", "body"),
        rows,
        " ON CONFLICT (tenant, key, fingerprint) DO NOTHING",
    )
    if added and table == "messages":
        await tx.execute(
            "UPDATE conversations SET message_count = message_count + ?"
            " WHERE tenant = ? AND key = ?",
            (added, conv.tenant, conv.key),
        )
    return added


async def insert(
    tx: Tx, table: str, conv: ConversationRef, values: Mapping[str, Any], suffix: str = ""
) -> None:
    columns = ["tenant", "key", *values]
    marks = ", ".join("?" * len(columns))
    await tx.execute(
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}){suffix}",
        (conv.tenant, conv.key, *values.values()),
    )
