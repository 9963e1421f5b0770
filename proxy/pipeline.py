"""The request pipeline: an ordered list of small named stages over one Exchange.

    parse -> tenant and conversation -> classify     (edge/compacting.py, before)
          -> stages, in order (run here)               e.g. archive, trim, session, loop
          -> forward and stream back                   (edge/compacting.py, after)

A stage reads and rewrites `exchange.messages` (the outgoing view) and records
what it did. Compaction is an optimisation: a stage that raises is logged and
its changes are dropped, and the request goes on with the messages it had before
that stage. The app builds the list once (`app.build_stages`); the README names it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, overload

from proxy.config import Tenant
from proxy.dialects.base import Dialect
from proxy.dialects.chat import ChatDialect
from proxy.history.identity import credentials_of
from proxy.history.measure import Measure
from proxy.history.messages import Classification, Message, chain_of, split_pinned
from proxy.planning.loop_calls import LoopBasis
from proxy.planning.outcome import CompactionOutcome, Layer, layers
from proxy.planning.riding import Forwarded
from proxy.planning.session import AppliedSummary
from proxy.record import RequestRecord
from proxy.store.base import ConversationRef, StoreError

log = logging.getLogger("recap.pipeline")

Control = Literal["off", "auto", "force"]


T = TypeVar("T")

# The share of the window kept for the answer when the request names no output limit.
DEFAULT_OUTPUT_SHARE = 0.1


async def _no_notify(_: str) -> None:
    return None


@dataclass(frozen=True)
class ClientHistory:
    """The history as the client sent it, where a layer before the route rewrote it (Codex's
    compaction items expanded to their summaries: proxy/edge/codex.py), with each message's
    fingerprint. The archive records these as the client's messages; the rewritten ones
    (the Exchange's `original`) are what the planners work on and what was sent."""

    messages: list[Message]
    fingerprints: list[str]


@dataclass
class Exchange:
    """One request on its way through the proxy; `messages` is its history in the
    neutral view of `dialect` (proxy/dialects/), `body` the API's own object."""

    request_id: str
    tenant: Tenant
    conversation: ConversationRef
    headers: Mapping[str, str]
    body: dict[str, Any]
    classification: Classification
    context_window: int
    measure: Measure
    control: Control = "auto"
    # Length of the body as the client sent it (what keeping its messages costs).
    body_bytes: int = 0
    # Tokens the upstream counts beside the history (tool definitions), estimated: the
    # context_window is already less them; calibration and overflow add them back.
    fixed_tokens: int = 0
    # Held out of compaction by the tenant's holdout (planning.cohort): `control` is "off",
    # and the overflow recovery still runs when the upstream refuses the request.
    held_out: bool = False
    # The window configured for the model (models.NAME.context_window or the default),
    # before calibration: shown beside `context_window` where an operator looks.
    configured_window: int | None = None
    messages: list[Message] = field(default_factory=list)
    # The API the request speaks: where its history sits in `body`, how it is written back.
    dialect: Dialect = field(default_factory=ChatDialect)
    # Keep-alive / progress notes for the client (SSE comments when streaming)...
    notify: Callable[[str], Awaitable[None]] = _no_notify
    # ...and how often `waiting` repeats one while a summarizer call runs (0: never).
    keepalive_s: float = 0.0
    # What the request's log line and metrics report (shared with the route), and extra
    # response headers.
    record: RequestRecord = field(default_factory=RequestRecord)
    response_headers: dict[str, str] = field(default_factory=dict)
    # What each compaction layer did, in order (read by headers, archive, and the record
    # once the estimate stage hands it on).
    outcomes: list[CompactionOutcome] = field(default_factory=list)
    # Index in `messages` of the last summary message a stage inserted (protected by
    # the last-resort fit).
    summary_index: int | None = None
    # The stored session summary that view applies (planning the next turn ahead reads it).
    session_summary: AppliedSummary | None = None
    loop_summary_index: int | None = None
    # What the loop stage saw of a tool continuation (planning the next step ahead reads it).
    loop_basis: LoopBasis | None = None
    # Fingerprints of the originals the trim stage replaced by placeholders.
    trimmed: list[str] = field(default_factory=list)
    # Fingerprints of the client's messages the last resort dropped (fit_to_window).
    dropped: list[str] = field(default_factory=list)
    # Set by the archive stage: how the client's messages are identified (`identity`,
    # from the fingerprint cache); those not yet on disk as (fingerprint, json) rows (None:
    # not worked out yet); and how to write them now.
    identify: Callable[[], History] | None = None
    unarchived: list[tuple[str, str]] | None = None
    archive_now: Callable[[], Awaitable[None]] | None = None
    archive_failed: bool = False
    # Set when the client's own history differs from `original` (see ClientHistory).
    client_history: ClientHistory | None = None
    # The request as it went upstream (edge/forward.py): a cache-riding summarizer call
    # made after its answer rides on it (planning/riding.py).
    forwarded: Forwarded | None = None

    def __post_init__(self) -> None:
        if not self.messages and isinstance(self.dialect, ChatDialect):
            # Built from a chat body alone (tests, the operator's manual compaction).
            self.messages = list(self.body.get("messages") or [])
        self.original: list[Message] = self.messages

    def report(self, outcome: CompactionOutcome) -> None:
        self.outcomes.append(outcome)

    def outcome(self, layer: Layer) -> CompactionOutcome | None:
        """The last outcome `layer` recorded on this request, if any."""
        return next((o for o in reversed(self.outcomes) if o.layer == layer), None)

    @property
    def layers(self) -> list[str]:
        """Layers that changed the outgoing view, in order ("session", "loop", "trim", ...);
        applying a stored summary is one."""
        return layers(self.outcomes)

    @property
    def compaction_failed(self) -> bool:
        return any(o.action == "failed" for o in self.outcomes)

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def params(self) -> dict[str, Any]:
        """The request's fields other than its history (model, tools, sampling, ...)."""
        return {k: v for k, v in self.body.items() if k != self.dialect.history_key}

    @property
    def room(self) -> int:
        """The tokens the view may hold: the window less what the answer may take (the
        request's own output limit, at most half the window; else DEFAULT_OUTPUT_SHARE)."""
        for key in self.dialect.output_limit_keys:
            value = self.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return self.context_window - min(value, self.context_window // 2)
        return self.context_window - int(self.context_window * DEFAULT_OUTPUT_SHARE)

    @property
    def credentials(self) -> dict[str, str]:
        """The client's own key headers (where its API carries them), for the summarizer's
        calls when the upstream has no key of its own."""
        return credentials_of(self.headers, self.dialect.credential_headers)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    async def ensure_archived(self) -> bool:
        """Before replacing any original: make sure it is on disk. False: do not compact.

        Ordering rule (seed 002 §5.5): a summary, placeholder or drop never exists
        whose originals are missing, so a failed write means no compaction.
        """
        if self.archive_now is None or self.archive_failed:
            return False
        if self.unarchived == []:
            return True
        try:
            await self.archive_now()
        except StoreError as exc:
            self.archive_failed = True
            self.record.archive_error = str(exc)
            log.warning("archive write failed, not compacting: %s", exc)
            return False
        self.unarchived = []
        return True

    async def waiting(self, work: Awaitable[T], note: str = "recap compacting") -> T:
        """`work` (a summarizer call), with `note` sent every `keepalive_s` while it runs:
        a slow local model takes minutes, and a silent stream looks dead to clients and
        intermediaries that cut idle streams. Cancelling this cancels `work`."""
        if self.keepalive_s <= 0:
            return await work
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.keepalive_s)
                if done:
                    return task.result()
                await self.notify(note)
        finally:
            task.cancel()

    def sent(self, body: bytes) -> None:
        """Note `body` (decoded JSON) as what goes upstream for this view."""
        applied = self.session_summary
        self.forwarded = Forwarded(
            dialect=self.dialect.name,
            body=body,
            # The list itself, not a copy (on every request): nothing changes it once sent.
            view=self.messages,
            pinned=len(self.split[0]),
            covered=applied.covered if applied is not None else 0,
            version=applied.version if applied is not None else None,
            loop_index=self.loop_summary_index,
            dropped=bool(self.dropped),
            fixed_tokens=self.fixed_tokens,
        )

    def count_for_log(self) -> None:
        """The logged `input_tokens`, if no stage counted them: after the response, off
        the latency path."""
        if self.record.input_tokens is None:
            self.record.input_tokens = self.measure.total(self.messages)

    @property
    def changed(self) -> bool:
        return self.messages is not self.original

    @functools.cached_property
    def split(self) -> tuple[list[Message], list[Message]]:
        """The client's messages as pinned + body, without hashing them (`identity` hashes)."""
        return split_pinned(self.original)

    @functools.cached_property
    def identity(self) -> History:
        """The client's messages as pinned + body, with their fingerprints and the body's
        chain hashes: worked out on first use (most small requests need it only once they
        are forwarded, for the archive), by `identify` when the archive stage set it."""
        if self.identify is not None:
            return self.identify()
        pinned, body = self.split
        fingerprints = [self.measure.fingerprint(m) for m in self.original]
        return History(pinned, body, chain_of(fingerprints[len(pinned) :]), fingerprints)

    @property
    def fingerprints(self) -> list[str]:
        """The fingerprints of the client's messages, in order."""
        return self.identity.fingerprints

    @property
    def chain(self) -> Sequence[str]:
        """The body's chain hashes for a lookup among stored versions: hashed only if a
        version is there to compare (`LazyChain`)."""
        return LazyChain(self)


@dataclass(frozen=True)
class History:
    pinned: list[Message]
    body: list[Message]
    chain: list[str]
    fingerprints: list[str]


class LazyChain(Sequence[str]):
    """`Exchange.identity.chain`, hashed on first look. Its length is the body's, known
    without hashing, so matching a conversation that has no stored summary costs nothing."""

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def __len__(self) -> int:
        return len(self._exchange.split[1])

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._exchange.identity.chain[index]


class Stage(Protocol):
    name: str

    async def __call__(self, exchange: Exchange, /) -> None: ...


class Pipeline:
    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    async def run(self, exchange: Exchange) -> None:
        for stage in self.stages:
            before, reported = exchange.messages, len(exchange.outcomes)
            try:
                await stage(exchange)
            except (
                Exception
            ) as exc:  # any stage failure: keep going with what we had (see docstring)
                exchange.messages = before
                del exchange.outcomes[reported:]
                exchange.record.stage_errors.append(f"{stage.name}:{type(exc).__name__}")
                log.warning(
                    "stage %s failed, request continues without it: %s: %s",
                    stage.name,
                    type(exc).__name__,
                    exc,
                    extra={"request_id": exchange.request_id},
                )
