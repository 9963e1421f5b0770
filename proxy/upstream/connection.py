"""One HTTP/1.1 connection to an upstream: an asyncio Protocol, its answers parsed by httptools.

IO edge of the data path, under `proxy/upstream/transport.py` (the pool and httpx's
transport interface). A connection carries one exchange at a time: the transport writes the
request (`write`, `drain`), waits for the answer's head (`receive_head`), then reads its body
(`receive_body`) as it arrives. Parsing happens in the loop's callbacks as bytes come in
(llhttp, in C); the reader only waits on one future, woken once per received chunk.

Flow control both ways: writing waits while the socket's buffer is over its high-water mark
(`pause_writing`), and reading the socket stops while more than `PAUSE_BYTES` of the body are
unread, so a slow client never makes the proxy hold an unbounded answer.

Failures are httpx's own exception types, the ones httpcore raises for the same cause, so the
one error boundary (`proxy.upstream.client.mapped_errors`) reads them unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import typing
from collections.abc import Callable

import httptools
import httpx

# Unread body bytes past which the socket is no longer read, and below which it is again.
PAUSE_BYTES = 256 * 1024
RESUME_BYTES = 64 * 1024
# An answer's head (status line and headers) at most: h11's bound as httpcore sets it.
MAX_HEAD_BYTES = 100 * 1024

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NO_BODY_STATUS = frozenset({204, 304})

Origin = tuple[str, str, int]  # scheme, host, port


def encode_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request line and the headers as given: order, case and duplicates kept.

    A CR, LF or NUL anywhere but the separators would let one header end the request (a
    request smuggled in a value): refused, as h11 refuses it."""
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if _TOKEN.fullmatch(name) is None:
            raise httpx.LocalProtocolError(f"Illegal header name {name!r}")
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(headers) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines or b"\0" in head:
        raise httpx.LocalProtocolError("Illegal character in the request line or a header value")
    return head


class _Surplus(Exception):
    """Bytes past the end of the answer."""


def _woken(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(True)


def _timed_out(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Connection(asyncio.Protocol):
    """One upstream connection and the state of the exchange on it (httptools' callbacks are
    this object's `on_*` methods)."""

    def __init__(self, origin: Origin, on_close: Callable[[Connection], None]) -> None:
        self.origin = origin
        self._on_close: Callable[[Connection], None] | None = on_close
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.socket: socket.socket | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._write_paused = False
        self._read_paused = False
        # The socket gave its last byte (EOF or lost): `_lost_exc` says how, None for a clean EOF.
        self.ended = False
        self._lost_exc: BaseException | None = None
        self._error: httpx.TransportError | None = None
        self.closed = False
        self.expires_at = 0.0  # when idle in the pool: the monotonic time it is dropped at
        # The exchange (reset by `start`).
        self._parser: httptools.HttpResponseParser | None = None
        self._head_request = False
        self._received = 0
        self._interim = False
        self._close_delimited = False
        self.status = 0
        self.reason = b""
        self.http_version = b"HTTP/1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0  # unread body bytes

    # -- asyncio's callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods, not its class.
        self._transport = transport = typing.cast(asyncio.Transport, transport)
        self.socket = sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self.complete:
            # Bytes on an idle connection, or past the end of the answer: no request of
            # ours asked for them, so nothing after them can be trusted.
            self.keep_alive = False
            self.close(abort=True)
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.complete = True  # 101 Switching Protocols: nothing more of ours on it
            self.keep_alive = False
        except httptools.HttpParserError as exc:
            if self.complete and isinstance(exc, httptools.HttpParserCallbackError):
                self.keep_alive = False  # bytes past the answer: the connection is not reused
            else:
                self._fail(httpx.RemoteProtocolError(f"Invalid answer from the upstream: {exc}"))
                return
        if not self.head_done:  # counted once parsed: a read may hold the head and more
            self._received += len(data)
            if self._received > MAX_HEAD_BYTES:
                self._fail(httpx.RemoteProtocolError("The answer's head is too large."))
                return
        self._wake()

    def eof_received(self) -> bool | None:
        self._end(None)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)
        self.closed = True
        self._forget()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # -- httptools' callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Surplus  # a second answer to one request: stops the parser
        self.headers = []
        self.reason = b""

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # skipped: the final answer follows
            return
        self.status = status
        self.http_version = b"HTTP/" + parser.get_http_version().encode()
        self.keep_alive = parser.should_keep_alive()
        self.head_done = True
        if self._head_request or status in _NO_BODY_STATUS or status == 101:
            self.complete = True
            return
        framed = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                framed = True
        self._close_delimited = not framed
        if not framed:
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self._chunks.append(body)
        self.buffered += len(body)
        if self.buffered > PAUSE_BYTES and not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True

    # -- the exchange ------------------------------------------------------------------------

    def start(self, *, head_request: bool) -> None:
        """Ready for a new exchange (a new parser: the last one may have stopped mid-body,
        as after the head of a HEAD request's answer)."""
        self._parser = httptools.HttpResponseParser(self)
        self._head_request = head_request
        self._received = 0
        self._interim = False
        self._close_delimited = False
        self.status = 0
        self.headers = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False

    def idle(self, expires_at: float) -> None:
        """The exchange is over (its answer read to the end); the connection waits in the pool."""
        self._parser = None
        self.expires_at = expires_at

    def write(self, data: bytes | list[bytes]) -> None:
        if self.ended or self.closed or self._transport is None:
            raise httpx.WriteError("The upstream closed the connection.")
        if isinstance(data, list):
            self._transport.writelines(data)
        else:
            self._transport.write(data)

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    async def drain(self, timeout: float | None) -> None:
        """Back once the socket's write buffer is under its low-water mark."""
        while self._write_paused:
            if self.ended or self.closed:
                raise httpx.WriteError("The upstream closed the connection.")
            if not await self._wait(timeout):
                raise httpx.WriteTimeout("Timed out writing the request.")

    async def receive_head(self, timeout: float | None) -> None:
        while not self.head_done:
            self._raise_failure()
            if not await self._wait(timeout):
                raise httpx.ReadTimeout("Timed out waiting for the upstream's answer.")

    async def receive_body(self, timeout: float | None) -> bytes:
        """What arrived of the body since the last call (waiting for some); b"" at its end."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self.buffered = 0
                if self._read_paused and self._transport is not None:
                    self._read_paused = False
                    self._transport.resume_reading()
                return data
            if self.complete:
                return b""
            self._raise_failure()
            if not await self._wait(timeout):
                raise httpx.ReadTimeout("Timed out reading the upstream's answer.")

    def close(self, *, abort: bool = False) -> None:
        """Close the socket (at once when `abort`: the exchange did not finish) and free the
        pool's slot now, not when asyncio reports the loss on a later turn of the loop."""
        if not self.closed:
            self.closed = True
            if self._transport is not None:
                if abort:
                    self._transport.abort()
                else:
                    self._transport.close()
        self._forget()

    # -- inside ------------------------------------------------------------------------------

    async def _wait(self, timeout: float | None) -> bool:
        """True when woken by the socket, False when `timeout` passed first."""
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._waiter = fut
        handle = None if timeout is None else self._loop.call_later(timeout, _timed_out, fut)
        try:
            return await fut
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None:
            _woken(fut)

    def _end(self, exc: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        self._lost_exc = exc
        self.keep_alive = False
        if self._close_delimited and self.head_done and exc is None:
            self.complete = True  # the end of a body delimited by the connection's close
        self._wake()

    def _fail(self, error: httpx.TransportError) -> None:
        self._error = error
        self.close(abort=True)
        self._wake()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error
        if not (self.ended or self.closed):
            return
        if isinstance(self._lost_exc, OSError):
            raise httpx.ReadError(str(self._lost_exc) or type(self._lost_exc).__name__)
        if not self.head_done:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        raise httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body"
        )

    def _forget(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)
