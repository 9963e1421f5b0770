"""What the conversation page reads from the event log: requests, rollbacks, a chosen request.

Off the data path, at the store edge: one pass over the conversation's events
(`Store.events`, read by pages) keeps the last `MAX_POINTS` requests for the chart,
every rollback for the timeline, and the request the operator chose to look at
(the last one by default). Messages are resolved through `inspection.archived`,
the same lookup as the JSON `view` route.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from proxy.archive.inspection import archived
from proxy.planning.outcome import Layer
from proxy.store.base import ConversationRef, Event, Store

MAX_POINTS = 300


@dataclass(frozen=True)
class RequestPoint:
    """One archived request: what the client sent and what went upstream, in tokens."""

    event_id: int
    created_at: float
    request_id: str
    classification: str
    model: str
    layers: tuple[str, ...]
    # None when the request was not measured (e.g. the store could not say).
    tokens_client: int | None
    tokens_sent: int | None
    # The session summary version the request was sent with (made or applied), if any.
    summary_version: int | None = None
    # The window the planners used (calibrated from usage, in Recap's tokens, less the tool
    # definitions) and the configured one, when the archive recorded them.
    window: int | None = None
    configured_window: int | None = None

    @property
    def shaped_by(self) -> str:
        """The layers that changed what was sent, naming the summary version ("" if none)."""
        names = [
            f"session (summary v{self.summary_version})"
            if x == Layer.SESSION and self.summary_version is not None
            else x
            for x in self.layers
        ]
        return ", ".join(names)


@dataclass(frozen=True)
class Rollback:
    created_at: float
    version_from: int | None
    version_to: int | None


@dataclass
class Timeline:
    points: list[RequestPoint] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)
    # How many requests the log holds (the chart shows the last MAX_POINTS).
    requests: int = 0
    chosen: Event | None = None


@dataclass(frozen=True)
class ChosenRequest:
    """Both sides of one request, message by message, with their fingerprints."""

    point: RequestPoint
    client: list[tuple[str, Any]]
    sent: list[tuple[str, Any]]
    # The client's messages the last resort dropped (not folded into a summary: lost).
    dropped: frozenset[str] = frozenset()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def point(event: Event) -> RequestPoint:
    p = event.payload
    layers = p.get("layers")
    return RequestPoint(
        event_id=event.id,
        created_at=event.created_at,
        request_id=str(p.get("request_id") or ""),
        classification=str(p.get("classification") or ""),
        model=str(p.get("model") or ""),
        layers=tuple(str(x) for x in layers) if isinstance(layers, list) else (),
        tokens_client=_int(p.get("tokens_before")),
        tokens_sent=_int(p.get("tokens_after")),
        summary_version=_int(p.get("summary_version")),
        window=_int(p.get("window")),
        configured_window=_int(p.get("configured_window")),
    )


async def read_timeline(store: Store, conv: ConversationRef, chosen: int | None) -> Timeline:
    """The chart's points, the rollbacks, and request event `chosen` (else the last)."""
    out = Timeline()
    points: deque[RequestPoint] = deque(maxlen=MAX_POINTS)
    last: Event | None = None
    async for event in store.events(conv):
        if event.type == "request":
            out.requests += 1
            points.append(point(event))
            last = event
            if event.id == chosen:
                out.chosen = event
        elif event.type == "rollback":
            p = event.payload
            out.rollbacks.append(Rollback(event.created_at, _int(p.get("from")), _int(p.get("to"))))
    out.points = list(points)
    if chosen is None:
        out.chosen = last
    return out


async def resolve(store: Store, conv: ConversationRef, event: Event) -> ChosenRequest:
    """The messages of one request event; Conflict if the archive lacks some."""
    client: list[str] = event.payload.get("messages") or []
    # `sent` is null when the request went upstream exactly as the client sent it.
    sent: list[str] = event.payload.get("sent") or client
    client_messages = await archived(store, conv, client)
    sent_messages = client_messages if sent is client else await archived(store, conv, sent)
    return ChosenRequest(
        point(event),
        list(zip(client, client_messages, strict=True)),
        list(zip(sent, sent_messages, strict=True)),
        frozenset(event.payload.get("dropped") or ()),
    )
