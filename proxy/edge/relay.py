"""Talking to the client at the ASGI level: body in, response (often a stream) out.

Pure ASGI rather than Starlette responses, because the proxy needs three things
those hide: starting an SSE response before the upstream answers (keep-alive
comments during compaction), forwarding each upstream chunk as it arrives, and
noticing a client disconnect so the upstream call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from proxy.errors import OPENAI_ERRORS, ErrorShape, PayloadTooLarge, RecapError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client went away; whatever it was waiting for is cancelled."""


def content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", []):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def check_declared(declared: int | None, limit: int) -> None:
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"Request body is over the proxy's limit of {limit} bytes.")


async def body_chunks(receive: Receive, limit: int) -> AsyncIterator[bytes]:
    """The request body as it arrives, refused past `limit` bytes; a disconnect ends it."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body is over the proxy's limit of {limit} bytes.")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def read_body(receive: Receive, limit: int, declared: int | None) -> bytes:
    check_declared(declared, limit)
    return b"".join([chunk async for chunk in body_chunks(receive, limit)])


def header_map(scope: Scope) -> dict[str, str]:
    """The request headers by lower-case name (the last of repeated ones)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def until_disconnect(
    receive: Receive, work: Coroutine[Any, Any, T], body_read: asyncio.Event | None = None
) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Listening starts once the request body has been read (now, or when `body_read`
    is set by a body that is being streamed): from then on the only thing
    `receive` can return is the disconnect.
    """
    # The work runs in this task (no second task, no asyncio.wait on every request's
    # path); the watcher cancels it when the client goes.
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        if body_read is not None:
            await body_read.wait()
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()  # the cancel was the watcher's: the request ends as disconnected
        raise ClientDisconnected() from None
    except Exception:
        if gone:
            # The work was abandoned on purpose: whatever it raised while cancelling is moot.
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()


class Responder:
    """Sends one response, possibly starting it early as an SSE stream.

    `started` tells whether the status line is out: after that, errors can only
    be reported in-band (a final event: `errors.event`, in the route's API's shape).
    """

    def __init__(
        self,
        send: Send,
        base_headers: list[tuple[bytes, bytes]],
        errors: ErrorShape = OPENAI_ERRORS,
    ) -> None:
        self._send = send
        self._base = base_headers
        self.errors = errors
        self.started = False
        self.status = 0
        self.sse = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._send(
            {"type": "http.response.start", "status": status, "headers": headers + self._base}
        )

    async def start_sse(self, extra: list[tuple[bytes, bytes]]) -> None:
        self.sse = True
        await self.start(200, SSE_HEADERS + extra)

    async def chunk(self, data: bytes) -> None:
        if data:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def comment(self, text: str) -> None:
        """An SSE comment line: ignored by SSE parsers, keeps the connection alive."""
        await self.chunk(f": {text}\n\n".encode())

    async def error(self, err: RecapError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.started:
            if self.sse:
                await self.chunk(self.errors.event(err))
            await self.end()
            return
        headers = [(b"content-type", b"application/json")] + (extra or [])
        await self.start(err.status, headers)
        await self.end(self.errors.body(err))

    async def json(self, status: int, body: Any) -> None:
        await self.start(status, [(b"content-type", b"application/json")])
        await self.end(json.dumps(body).encode())


DONE_MARKER = b"data: [DONE]"
# Past this, the answer goes out even if the archive has not confirmed its commit: a
# store that hangs must not hang the client (the record stays queued for retry).
COMMIT_WAIT_S = 10.0


class FinalBytesGate:
    """Forwards an answer as it arrives, except its final bytes: those wait for `committed`.

    So a client never holds a complete answer whose request is not yet on disk. What is
    held back: in an SSE stream, its API's final event onwards (`marker`: chat's
    `data: [DONE]`, the route's dialect's `stream_end`; without one, only the end of the
    body); in a body with a Content-Length, its last chunk; in one without, one chunk at
    a time. Everything before goes out at once, so the first
    byte is never delayed; the commit started before the request went upstream, so by
    the end of a model's answer it is normally long done.
    """

    def __init__(
        self,
        committed: Awaitable[bool],
        *,
        sse: bool,
        length: int | None,
        marker: bytes = DONE_MARKER,
    ) -> None:
        self._committed = committed
        self._marker = marker
        self._sse = sse
        self._length = length
        self._seen = 0
        self._tail = b""
        self._held = b""
        self._open = False

    async def _wait(self) -> None:
        if not self._open:
            self._open = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._committed), COMMIT_WAIT_S)

    async def forward(self, chunk: bytes, responder: Responder) -> None:
        if self._open:
            await responder.chunk(chunk)
            return
        self._seen += len(chunk)
        if self._sse:
            window = self._tail + chunk
            at = window.find(self._marker)
            self._tail = window[-len(self._marker) :]
            if at < 0:
                await responder.chunk(chunk)
                return
            split = max(0, at - (len(window) - len(chunk)))
            await responder.chunk(chunk[:split])
            await self._wait()
            await responder.chunk(chunk[split:])
        elif self._length is not None:
            if self._seen >= self._length:
                await self._wait()
            await responder.chunk(chunk)
        else:
            await responder.chunk(self._held)
            self._held = chunk

    async def end(self, responder: Responder) -> None:
        await self._wait()
        await responder.chunk(self._held)
        self._held = b""
