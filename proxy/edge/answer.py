"""The upstream's answer on its way to the client: relayed as it arrives, archived as it goes.

The compacting route's relay step (compacting.py). The bytes go out raw, as the upstream
sent them (a compressed answer keeps its Content-Encoding); the adapter's recorder keeps
a bounded copy for the archive. When the request's archive record is not yet on disk,
the answer's final bytes wait for it (`FinalBytesGate`), so a client never holds a
complete answer whose request could be lost. A stream that compaction progress already
opened (SSE comments) can only report an upstream error in-band, as one event of the
route's API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from proxy.dialects.base import Dialect, Recorder
from proxy.edge.relay import FinalBytesGate, Responder
from proxy.pipeline import Exchange
from proxy.record import RequestRecord
from proxy.upstream.client import response_headers
from proxy.upstream.error_answer import bounded_read


async def relay(
    response: httpx.Response,
    responder: Responder,
    dialect: Dialect,
    extra: dict[str, str],
    recorder: Recorder | None,
    committed: Awaitable[bool] | None,
    start: float,
    record: RequestRecord,
) -> None:
    upstream_id = response.headers.get("x-request-id")
    if upstream_id:
        record.upstream_request_id = upstream_id
    early = responder.started
    gate = None
    if committed is not None and not _durable(committed):
        gate = FinalBytesGate(
            committed,
            sse=response.headers.get("content-type", "").startswith("text/event-stream"),
            length=_length(response.headers.get("content-length")),
            marker=dialect.stream_end,
        )
    if responder.started:
        # The SSE stream is already open (compaction progress was sent): an
        # upstream error can only be reported in-band.
        if response.status_code >= 400:
            body = await bounded_read(response)
            if gate is not None:
                await gate.end(responder)
            await responder.chunk(dialect.error_event(body, response.status_code))
            await responder.end()
            return
        if upstream_id:
            # Its headers went out before the upstream answered: the upstream's
            # request id (what its operators ask for) comes as an SSE comment instead.
            await responder.comment(f"x-request-id: {upstream_id}")
    else:
        responder.sse = response.headers.get("content-type", "").startswith("text/event-stream")
        if responder.sse:
            extra = {**extra, "x-accel-buffering": "no"}
        headers = response_headers(response.headers, decoded=False, extra=extra)
        await responder.start(response.status_code, headers)
    # Raw bytes, as the upstream sent them (compressed ones stay compressed, with
    # their Content-Encoding): nothing is decoded on the way to the client.
    async for chunk in response.aiter_raw():
        if early and record.ttfb_ms is None:
            # The client's first byte was a progress comment; the log's time to
            # first byte is the model's, as for a stream that did not compact.
            record.ttfb_ms = round((time.perf_counter() - start) * 1000, 1)
        if recorder is not None:
            recorder.feed(chunk)
        if gate is None:
            await responder.chunk(chunk)
        else:
            await gate.forward(chunk, responder)
    if gate is not None:
        await gate.end(responder)
    await responder.end()


def sse_notifier(responder: Responder, exchange: Exchange) -> Callable[[str], Awaitable[None]]:
    """Compaction progress as SSE comments: the first one opens the stream, with the
    response headers the stages have decided so far."""

    async def notify(text: str) -> None:
        if not responder.started:
            await responder.start_sse(
                [(k.encode(), v.encode()) for k, v in exchange.response_headers.items()]
            )
        await responder.comment(text)

    return notify


def _durable(committed: Awaitable[bool]) -> bool:
    """The record is on disk already (journaled): no final bytes need to wait for it."""
    return isinstance(committed, asyncio.Future) and committed.done() and committed.result()


def _length(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
