"""The store interface: what the proxy persists and how it asks for it back.

Sits at the IO edge of the data path. Planners read stored state (the current
summary version, loop summaries) through it before they decide; effects write
through it (new summary versions, the message archive, the audit trail, events).
Backends (SQLite now, PostgreSQL later) implement `Store`; nothing above this
package sees a driver exception: every foreign error becomes `StoreError`, which
callers read as "store unavailable, pass the request through unchanged".
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, Protocol, Self, TypeVar

from proxy.history.conversation_ref import ConversationRef as ConversationRef
from proxy.planning.outcome import Layer as Layer

# "dropped": the last resort dropped messages (it saved nothing: they were lost to the view).
Outcome = Literal["ok", "failed", "skipped", "dropped"]
EventType = Literal[
    "request",
    "response",
    "session_compact",
    "loop_compact",
    "trim",
    "manual_compact",
    "rollback",
]


class StoreError(Exception):
    """The store cannot serve this call. The message is a short reason, never stored content."""


class NotFound(StoreError):
    """The conversation or summary version asked for does not exist."""


@contextmanager
def translating(
    foreign: tuple[type[BaseException], ...],
    reason: Callable[[BaseException], str],
    plain: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """A backend's error boundary: its driver and OS errors (`foreign`) become StoreError
    with a short `reason`; its own errors (`plain`) keep their message; StoreError passes."""
    try:
        yield
    except StoreError:
        raise
    except plain as exc:
        raise StoreError(str(exc)) from exc
    except foreign as exc:
        raise StoreError(reason(exc)) from exc


@dataclass(frozen=True)
class SummaryVersion:
    version: int
    summary: str
    # How many non-pinned messages (from the start) the summary stands for.
    covered: int
    # chain_hashes(non_pinned)[covered - 1] when the summary was made.
    boundary_hash: str
    # The conversation's compaction counter when this version was made.
    compact_count: int
    input_tokens: int
    output_tokens: int
    model: str
    reason: str
    created_at: float
    updated_at: float
    current: bool
    # Discarded by a rollback past it: never applied or built on again, unless an
    # operator makes it current by name.
    rolled_back: bool = False


@dataclass(frozen=True)
class NewSummary:
    summary: str
    covered: int
    boundary_hash: str
    input_tokens: int
    output_tokens: int
    model: str
    reason: str


@dataclass(frozen=True)
class CompactionRecord:
    """One audit row per compaction attempt, whatever its outcome."""

    layer: Layer
    reason: str
    outcome: Outcome
    detail: str
    tokens_before: int
    tokens_after: int
    chars_before: int
    chars_after: int
    model: str
    duration_ms: int
    # 0.0: the store stamps it with its own clock.
    created_at: float = 0.0


@dataclass(frozen=True)
class Event:
    id: int
    type: str
    payload: dict[str, Any]
    created_at: float


@dataclass(frozen=True)
class LoopSummary:
    """Working memory of one turn's tool loop, reusable while the turn goes on."""

    turn_hash: str
    covered_rounds: int
    summary: str
    input_tokens: int
    output_tokens: int
    model: str
    created_at: float
    expires_at: float
    # Chain hash of the client's history through the last round covered: the summary
    # applies only to a request that holds exactly that history ("" for none).
    covers_hash: str = ""


@dataclass(frozen=True)
class ExchangeRecord:
    """What one request leaves in the archive: messages as (fingerprint, json), events,
    and the request's other fields (model, tools, sampling, ...) as (fingerprint, json)."""

    conversation: ConversationRef
    messages: Sequence[tuple[str, str]]
    events: Sequence[tuple[EventType, Mapping[str, Any]]]
    params: Sequence[tuple[str, str]] = ()
    # When it happened (epoch seconds), for a record stored later than that (journaled,
    # proxy/archive/journal.py); None: when it is stored.
    at: float | None = None


@dataclass(frozen=True)
class JournalMark:
    """How far one process's archive journal (proxy/archive/journal.py) is in the store: every
    record of its segments before `segment`, and the first `position` records of it."""

    owner: str
    segment: int
    position: int


@dataclass(frozen=True)
class ListPosition:
    """Where a conversation listing stopped: the last row's (updated_at, tenant, key).

    Listings are ordered by updated_at (newest first), then tenant and key, so this
    names one place in the order even when many conversations share updated_at."""

    updated_at: float
    tenant: str
    key: str


@dataclass(frozen=True)
class ConversationInfo:
    tenant: str
    key: str
    created_at: float
    updated_at: float
    message_count: int
    compact_count: int  # summary versions made
    tokens_saved: int
    current_version: int | None
    # Compactions of every layer that changed what was sent (session, loop, trim, manual,
    # remote: audit rows with outcome ok); the last resort's drops are not among them.
    compactions_made: int = 0


def pick_matching(
    versions: Sequence[tuple[int, int, str]],
    current: int,
    boundary_hashes: Sequence[str],
) -> int | None:
    """Choose which summary version applies to an incoming request, if any.

    `versions` are (version, covered, boundary_hash), rolled-back versions already left
    out by the backend. The current version wins when it matches; otherwise a client
    that edited or forked its history gets the earlier version (numbered <= current)
    that covers the most messages and still matches, so it keeps as much of its
    summary as is still true.
    Pure, so every backend shares one definition of "matches".
    """

    def matches(covered: int, boundary_hash: str) -> bool:
        n = len(boundary_hashes)
        return 1 <= covered <= n and boundary_hashes[covered - 1] == boundary_hash

    best: tuple[int, int] | None = None  # (covered, version)
    for version, covered, boundary_hash in versions:
        if version > current or not matches(covered, boundary_hash):
            continue
        if version == current:
            return version
        if best is None or (covered, version) > best:
            best = (covered, version)
    return None if best is None else best[1]


K = TypeVar("K", bound=Hashable)


class KeyedLocks(Generic[K]):
    """One asyncio.Lock per key, created on demand and dropped when nobody holds or waits.

    Refcounted rather than weak so that the lock's lifetime does not depend on
    the garbage collector, and the dict holds only keys in use right now.
    """

    def __init__(self) -> None:
        self._entries: dict[K, _LockEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @asynccontextmanager
    async def hold(self, key: K) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _LockEntry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]


class _LockEntry:
    """A lock and how many tasks hold it or wait for it."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class Deferred(Protocol):
    """Writes that need not hold a request (the audit rows and their events), run in the
    background in order per conversation (`proxy/stages/audit.py`'s `AuditWriter`)."""

    def put(self, conv: ConversationRef, write: Callable[[], Awaitable[None]], what: str) -> None:
        """Queue `write` after the conversation's earlier ones; never raises."""

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait (bounded) for the writes queued so far: a reader then sees them."""


class Store(abc.ABC):
    """Persistent state of conversations. All methods raise StoreError (or NotFound) only.

    Times are float epoch seconds. Every write runs in one transaction, so a
    crash leaves either all of it or none of it.
    """

    # Set by the app's lifespan: where audit rows go off the request path. None: the
    # caller awaits them (a store used on its own: the CLI, tests of the store).
    audits: Deferred | None = None

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and bring the schema up to date (idempotent, safe with concurrent starts)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def check_writable(self) -> None:
        """Do a real write (for /readyz); raise StoreError if it fails."""

    @abc.abstractmethod
    async def deployment_secret(self) -> bytes:
        """A random key made on first use and kept, the same for every replica on this store
        (authenticates the compaction references given to clients; docs/codex.md)."""

    @abc.abstractmethod
    def conversation_lock(self, conv: ConversationRef) -> AbstractAsyncContextManager[None]:
        """Serialise compactions of one conversation; other conversations never wait."""

    @abc.abstractmethod
    async def summary_versions(self, conv: ConversationRef) -> list[SummaryVersion]:
        """All versions, oldest first."""

    @abc.abstractmethod
    async def summary_version(self, conv: ConversationRef, version: int) -> SummaryVersion | None:
        """One version by its number (rolled back or not), None when it is not stored."""

    @abc.abstractmethod
    async def current_summary(self, conv: ConversationRef) -> SummaryVersion | None: ...

    @abc.abstractmethod
    async def matching_summary(
        self, conv: ConversationRef, boundary_hashes: Sequence[str]
    ) -> SummaryVersion | None:
        """The version that applies to a request whose non-pinned chain is boundary_hashes.

        See `pick_matching` for the rule.
        """

    @abc.abstractmethod
    async def add_summary_version(self, conv: ConversationRef, new: NewSummary) -> SummaryVersion:
        """Add a version and make it current, in one transaction."""

    @abc.abstractmethod
    async def set_current_version(self, conv: ConversationRef, version: int | None) -> None:
        """Roll back (or forward) to an existing version, or to none. NotFound if unknown.

        Every version numbered after the new current one is marked rolled back: it is
        never matched (so never applied, nor rolled into a later summary) again, also
        once newer versions exist. The version named is unmarked (an operator's choice).
        """

    @abc.abstractmethod
    async def record_compaction(self, conv: ConversationRef, record: CompactionRecord) -> None:
        """Append an audit row; an ok outcome adds tokens_before - tokens_after to tokens_saved."""

    @abc.abstractmethod
    async def archive_messages(
        self, conv: ConversationRef, messages: Sequence[tuple[str, str]]
    ) -> int:
        """Store (fingerprint, message JSON) pairs not seen before; return how many were new."""

    @abc.abstractmethod
    async def record_exchanges(
        self, items: Sequence[ExchangeRecord], mark: JournalMark | None = None
    ) -> None:
        """In one transaction, for each item: archive its messages and request parameters
        (insert-or-ignore) and append its events. Many requests' records are written
        together. `mark`: how far the journal these records came from is stored now,
        kept in the same transaction."""

    @abc.abstractmethod
    async def journal_mark(self, owner: str) -> JournalMark | None:
        """The mark last stored for this journal owner, if any."""

    @abc.abstractmethod
    async def forget_journal(self, owner: str) -> None:
        """Drop an owner's mark: its journal is gone (replayed, or closed empty)."""

    @abc.abstractmethod
    async def archived_params(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        """fingerprint -> JSON of a request's fields other than its messages, in archive
        order; None asks for all of them. `request` events name theirs as `params`."""

    @abc.abstractmethod
    async def archived_messages(
        self, conv: ConversationRef, fingerprints: Sequence[str] | None = None
    ) -> dict[str, str]:
        """fingerprint -> message JSON, in archive order; None asks for all of them."""

    @abc.abstractmethod
    async def append_event(
        self, conv: ConversationRef, type: EventType, payload: Mapping[str, Any]
    ) -> int:
        """Append to the event log; return the event id (increasing, never reused)."""

    @abc.abstractmethod
    def events(
        self, conv: ConversationRef, after_id: int = 0, *, page_size: int = 500
    ) -> AsyncIterator[Event]:
        """Events with id > after_id in id order, read a page at a time."""

    async def last_event(self, conv: ConversationRef, type: EventType) -> Event | None:
        """The newest event of this type (for the operator's view of the last request).

        This default reads the whole log; backends override it with one indexed query.
        """
        last: Event | None = None
        async for event in self.events(conv):
            if event.type == type:
                last = event
        return last

    async def iter_archived(
        self, conv: ConversationRef, *, page_size: int = 500
    ) -> AsyncIterator[tuple[str, str]]:
        """(fingerprint, message JSON) in archive order, for exports that must not hold it all.

        This default reads every message at once; backends override it to read by pages.
        """
        for item in (await self.archived_messages(conv)).items():
            yield item

    @abc.abstractmethod
    async def get_loop_summary(
        self, conv: ConversationRef, turn_hash: str, max_rounds: int, now: float
    ) -> LoopSummary | None:
        """The unexpired summary of this turn covering the most rounds <= max_rounds."""

    @abc.abstractmethod
    async def find_loop_summary(
        self, conv: ConversationRef, covers: Sequence[str], now: float
    ) -> LoopSummary | None:
        """The unexpired summary whose covers_hash is one of `covers`, covering the most rounds."""

    @abc.abstractmethod
    async def put_loop_summary(self, conv: ConversationRef, s: LoopSummary) -> None: ...

    @abc.abstractmethod
    async def list_conversations(
        self,
        tenant: str | None,
        limit: int = 50,
        before: float | None = None,
        after: ListPosition | None = None,
    ) -> list[ConversationInfo]:
        """Newest first by updated_at, then by tenant and key; only those updated
        strictly before `before`, and only those after the position `after` (keyset
        paging: no conversation is skipped or repeated when several share updated_at).

        tenant None lists every tenant (admin use).
        """

    @abc.abstractmethod
    async def get_conversation(self, conv: ConversationRef) -> ConversationInfo | None: ...

    @abc.abstractmethod
    async def compactions(self, conv: ConversationRef) -> list[CompactionRecord]:
        """Audit rows, oldest first."""

    @abc.abstractmethod
    async def prune(self, older_than: float) -> int:
        """Delete whole conversations not updated since older_than; return how many."""
