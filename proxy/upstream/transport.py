"""Recap's own httpx transport: HTTP/1.1 over asyncio Protocols, a keep-alive pool per origin.

IO edge of the data path: `proxy.upstream.client.UpstreamClient` sends every upstream request
through `handle_async_request` (httpx's transport interface, so `httpx.Response` and the one
error boundary stay as they are). It replaces httpx's default transport (httpcore over h11
over anyio streams, all pure Python) on the hot path: answers are parsed in C by httptools
in the loop's own callbacks (`proxy.upstream.connection`), and a request costs one write of
its head and body and one wake-up per chunk of the answer.

What it keeps of httpcore's behaviour, so that nothing above it changes:
  * `httpx.Limits`: at most `max_connections` (connecting, busy and idle ones, all origins),
    at most `max_keepalive_connections` idle, an idle one dropped after `keepalive_expiry`;
    requests past the limit wait in order, at most the request's `pool` timeout;
  * `httpx.Timeout` from the request's `extensions["timeout"]`: `connect` (TCP and TLS),
    `write` (each wait for the socket to take more), `read` (each wait for bytes), `pool`;
  * httpx's exception types for the causes httpcore raises them for (ConnectError,
    ConnectTimeout, ReadTimeout, WriteTimeout, PoolTimeout, ReadError, WriteError,
    RemoteProtocolError, LocalProtocolError);
  * a connection goes back to the pool only when its answer was read to the end and neither
    side said `Connection: close`; an idle one the upstream closed (uvicorn closes idle ones
    after 5 s) is dropped before reuse: asyncio reports the close as it comes, and the
    socket is polled when taken, as httpcore polls it (`has_expired`);
  * no request is sent twice. httpcore retries only when the connection it was given turns
    out not to be available before anything is written (`ConnectionNotAvailable`); here that
    is an idle connection handed to a waiting request and closed by the upstream before that
    request's task ran, and it is done the same way: another connection. A request
    written to a connection the upstream was closing at that moment fails, as it does with
    httpcore: model calls are POSTs (billed, not idempotent), and the pool's
    `keepalive_expiry` under the upstream's idle timeout is what keeps that window shut
    (`client.KEEPALIVE_S`).

Cancellation-safe: every cleanup is synchronous (a socket closed, a slot freed, a waiter
handed on), so a task cancelled at any await leaves no connection or slot behind.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import select
import ssl
import time

import httpx

from proxy.upstream.connection import Connection, Origin, encode_head

_PORTS = {"http": 80, "https": 443}


class _Pool:
    """The connections of one transport: idle ones per origin (most recent first out) and the
    requests waiting for a slot, in order."""

    def __init__(self, limits: httpx.Limits) -> None:
        self.max_connections = limits.max_connections or 1 << 62
        self.max_idle = (
            limits.max_keepalive_connections
            if limits.max_keepalive_connections is not None
            else self.max_connections
        )
        self.expiry = math.inf if limits.keepalive_expiry is None else limits.keepalive_expiry
        self.open = 0  # connections counted against max_connections (incl. ones connecting)
        self.idle: dict[Origin, list[Connection]] = {}
        self.idle_count = 0
        self.live: set[Connection] = set()
        self.waiters: collections.deque[tuple[Origin, asyncio.Future[Connection | None]]] = (
            collections.deque()
        )
        self.closed = False

    async def acquire(self, origin: Origin, timeout: float | None) -> Connection | None:
        """An idle connection to `origin`, or None: a slot is reserved for a new one."""
        if self.closed:
            raise httpx.ConnectError("The transport is closed.")
        conn = self._take_idle(origin)
        if conn is not None:
            return conn
        if self.open < self.max_connections:
            self.open += 1
            return None
        if self._drop_other_idle(origin):  # frees a slot: this request takes it
            self.open += 1
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Connection | None] = loop.create_future()
        entry = (origin, fut)
        self.waiters.append(entry)
        handle = None if timeout is None else loop.call_later(timeout, _pool_timed_out, fut)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._hand_back(fut.result(), origin)  # given one, then cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # a timeout's set_exception left it
                    self.waiters.remove(entry)
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def release(self, conn: Connection, *, reusable: bool) -> None:
        """An exchange ended: the connection waits for the next request, or is closed."""
        if not reusable or conn.closed or conn.ended or self.closed:
            conn.close(abort=True)
            return
        conn.idle(time.monotonic() + self.expiry)
        self._hand_back(conn, conn.origin)

    def forget(self, conn: Connection) -> None:
        """A connection closed (ours or the upstream's doing): its slot is free."""
        if conn not in self.live:
            return  # never counted (its connect failed) or already accounted for
        self.live.discard(conn)
        idle = self.idle.get(conn.origin)
        if idle is not None and conn in idle:
            idle.remove(conn)
            self.idle_count -= 1
        self.open -= 1
        self._give_slot()

    def unreserve(self) -> None:
        """A reserved slot not used (the connect failed)."""
        self.open -= 1
        self._give_slot()

    def close_all(self) -> None:
        self.closed = True
        while self.waiters:  # first: no slot freed below goes to one of them
            _, fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(httpx.ConnectError("The transport is closed."))
        for conn in list(self.live):
            conn.close(abort=True)

    # -- inside ------------------------------------------------------------------------------

    def _take_idle(self, origin: Origin) -> Connection | None:
        idle = self.idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            self.idle_count -= 1
            if conn.closed or conn.ended or conn.expires_at < now or _readable(conn):
                conn.close(abort=True)
                continue
            return conn
        return None

    def _drop_other_idle(self, origin: Origin) -> bool:
        for other, idle in self.idle.items():
            if other != origin and idle:
                conn = idle.pop(0)  # the oldest
                self.idle_count -= 1
                self.live.discard(conn)
                self.open -= 1
                conn.close(abort=True)  # its slot taken by the caller, not handed on
                return True
        return False

    def _hand_back(self, conn: Connection | None, origin: Origin) -> None:
        """`conn` (or, when None, a reserved slot) to the first waiter, else to the idle list."""
        if conn is None:
            self.unreserve()
            return
        while self.waiters:
            want, fut = self.waiters[0]
            if fut.done():
                self.waiters.popleft()
                continue
            if want == origin:
                self.waiters.popleft()
                fut.set_result(conn)
                return
            break
        if self.waiters:  # the first waiter wants another origin: it takes this slot
            conn.close(abort=True)  # frees the slot (`forget`), which goes to that waiter
            return
        if self.idle_count >= self.max_idle:
            conn.close()
            return
        self.idle.setdefault(origin, []).append(conn)
        self.idle_count += 1

    def _give_slot(self) -> None:
        while self.waiters and self.open < self.max_connections:
            _, fut = self.waiters.popleft()
            if not fut.done():
                self.open += 1
                fut.set_result(None)


def _pool_timed_out(fut: asyncio.Future[Connection | None]) -> None:
    if not fut.done():
        fut.set_exception(httpx.PoolTimeout("Timed out waiting for a connection."))


def _readable(conn: Connection) -> bool:
    """Whether an idle connection's socket has something to read: only the upstream's close
    (or bytes nobody asked for). httpcore's check before reuse (`is_socket_readable`);
    asyncio usually reported the close already, but not if it came in since the loop last
    polled. poll, not select: select fails on descriptors past 1023, which a busy proxy has."""
    sock = conn.socket
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class ResponseStream(httpx.AsyncByteStream):
    """An answer's body as it arrives; the connection goes back to the pool at its end."""

    def __init__(
        self, conn: Connection, pool: _Pool, timeout: float | None, reusable: bool
    ) -> None:
        self._conn: Connection | None = conn
        self._pool = pool
        self._timeout = timeout
        self._reusable = reusable

    @property
    def buffered(self) -> int:
        """Bytes of the body received and not yet read."""
        return self._conn.buffered if self._conn is not None else 0

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        try:
            data = await conn.receive_body(self._timeout)
        except BaseException:
            self._conn = None
            conn.close(abort=True)
            raise
        if data:
            return data
        self._conn = None
        self._pool.release(conn, reusable=self._reusable and conn.keep_alive)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            done = conn.complete and not conn.buffered
            self._pool.release(conn, reusable=done and self._reusable and conn.keep_alive)


class FastTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to any origin, with httpx's limits and timeouts (see the module's docstring)."""

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        self._ssl = ssl_context
        self._pool = _Pool(limits if limits is not None else httpx.Limits())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.scheme
        port = url.port or _PORTS.get(scheme)
        if port is None:
            raise httpx.UnsupportedProtocol(f"Request URL has an unsupported protocol {scheme!r}.")
        origin = (scheme, url.raw_host.decode("ascii"), port)
        timeouts = request.extensions.get("timeout", {})
        pool = self._pool
        while True:
            conn = await pool.acquire(origin, timeouts.get("pool"))
            if conn is None:
                conn = await self._connect(origin, timeouts.get("connect"))
                break
            if not (conn.closed or conn.ended):
                break
            # Handed over idle, and closed by the upstream before this task ran: another one,
            # as httpcore takes another on ConnectionNotAvailable (nothing was written yet).
            conn.close(abort=True)
        try:
            method = request.method.encode("ascii")
            conn.start(head_request=method == b"HEAD")
            reusable = await _send(conn, method, request, timeouts.get("write"))
            read = timeouts.get("read")
            await conn.receive_head(read)
        except BaseException:
            conn.close(abort=True)
            raise
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=ResponseStream(conn, pool, read, reusable),
            extensions={"http_version": conn.http_version, "reason_phrase": conn.reason},
        )

    async def aclose(self) -> None:
        self._pool.close_all()

    async def _connect(self, origin: Origin, timeout: float | None) -> Connection:
        """A new connection (its slot already reserved: freed again if it fails)."""
        scheme, host, port = origin
        pool = self._pool
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context(trust_env=False)
                self._ssl.set_alpn_protocols(["http/1.1"])
            tls = self._ssl
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(origin, pool.forget),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                )
        except BaseException as exc:
            pool.unreserve()
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(f"Timed out connecting to {host}:{port}.") from None
            if isinstance(exc, OSError):
                raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
            raise
        pool.live.add(conn)
        if pool.closed:
            conn.close(abort=True)
            raise httpx.ConnectError("The transport is closed.")
        return conn


async def _send(
    conn: Connection, method: bytes, request: httpx.Request, timeout: float | None
) -> bool:
    """Write the request: its head and body as given (Content-Length, else chunked when the
    head says so). Whether the connection may serve another request after this one.

    A write the upstream cut short is not an error here, as in httpcore: an upstream may
    answer (413, 401) before it has read the whole body, and the answer is what matters."""
    headers = request.headers.raw
    length: int | None = None
    chunked = False
    reusable = True
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise httpx.LocalProtocolError(f"Invalid Content-Length {value!r}")
            length = int(value)
        elif lowered == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif lowered == b"connection" and b"close" in value.lower():
            reusable = False
    head = encode_head(method, request.url.raw_path, headers)
    stream = request.stream
    try:
        if isinstance(stream, httpx.ByteStream):  # bytes: head and body in one write
            body = b"".join(stream)
            _check_length(len(body), length, chunked)
            if chunked and body:
                conn.write([head, b"%x\r\n" % len(body), body, b"\r\n0\r\n\r\n"])
            else:
                conn.write([head, b"0\r\n\r\n"] if chunked else [head, body] if body else head)
            if conn.write_paused:
                await conn.drain(timeout)
            return reusable
        pending: bytes | None = head
        sent = 0
        assert isinstance(stream, httpx.AsyncByteStream)
        async for chunk in stream:
            if not chunk:
                continue
            sent += len(chunk)
            if not chunked and (length is None or sent > length):
                _check_length(sent, length, chunked)
            parts = [b"%x\r\n" % len(chunk), chunk, b"\r\n"] if chunked else [chunk]
            if pending is not None:
                parts.insert(0, pending)
                pending = None
            conn.write(parts)
            if conn.write_paused:
                await conn.drain(timeout)
        _check_length(sent, length, chunked)
        tail = [b"0\r\n\r\n"] if chunked else []
        if pending is not None:
            tail.insert(0, pending)
        if tail:
            conn.write(tail)
            if conn.write_paused:
                await conn.drain(timeout)
    except httpx.WriteError:
        return False  # read what the upstream answered (or how it failed)
    return reusable


def _check_length(sent: int, length: int | None, chunked: bool) -> None:
    if chunked:
        return
    if sent != (length or 0):
        raise httpx.LocalProtocolError(
            f"The request body has {sent} bytes, its Content-Length says {length or 0}."
        )
