"""proxy.upstream.transport (and its connection, proxy.upstream.connection) through real
servers on loopback: raw asyncio servers in the test's own loop where a test needs the bytes
on the wire or a step-by-step upstream, uvicorn (tests.servers) where any HTTP server will do.

No wall-clock bound is an assertion: a test waits on events (a server saw a request, a
consumer got a chunk, a server's send side blocked); the timeouts given are generous guards
against a hang, or the tiny timeouts under test themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import resource
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.upstream.client import RequestBody
from proxy.upstream.connection import PAUSE_BYTES
from proxy.upstream.transport import FastTransport, ResponseStream
from tests.servers import read_body, serve

pytestmark = pytest.mark.quick


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
GUARD_S = 10.0  # a hang guard, never the thing tested


@contextlib.asynccontextmanager
async def raw_server(
    handler: Handler, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """A TCP server in this loop; yields its base URL and the connections it accepted."""
    accepted: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        try:
            # A client gone mid-request, or the test over (its loop cancels what is left).
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await handler(reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()  # `wait_closed` then says the handler is done: the client left

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}", accepted
    finally:
        server.close()
        for writer in accepted:
            if not writer.transport.is_closing():  # asyncio's abort() fails once closed
                writer.transport.abort()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head (raw) and body (de-chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lowered = head.lower()
    if b"transfer-encoding: chunked" in lowered:
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return head, body
            body += chunk[:-2]
    length = 0
    for line in lowered.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def answering(*answers: bytes, close: bool = False) -> Handler:
    """A server that answers each request on a connection with the next of `answers`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()  # until the client closes

    return handler


def in_turn(*handlers: Handler) -> Handler:
    """The Nth connection is served by the Nth handler (the last one for all after it)."""
    count = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        count += 1
        await handlers[min(count, len(handlers)) - 1](reader, writer)

    return handler


def request(
    method: str,
    url: str,
    *,
    content: Any = None,
    headers: Any = None,
    timeout: httpx.Timeout | None = None,
) -> httpx.Request:
    t = timeout or httpx.Timeout(GUARD_S)
    return httpx.Request(
        method, url, content=content, headers=headers, extensions={"timeout": t.as_dict()}
    )


async def fetch(transport: FastTransport, req: httpx.Request) -> httpx.Response:
    response = await transport.handle_async_request(req)
    await response.aread()
    return response


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def limits(max_connections: int = 10, expiry: float = 30.0) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=expiry)


# -- keep-alive ------------------------------------------------------------------------------


async def test_a_connection_is_reused_for_the_next_request() -> None:
    async def whoami(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        port = str(scope["client"][1]).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": port})

    with serve(whoami, lifespan="off") as url:
        async with FastTransport(limits=limits()) as transport:
            ports = [
                (await fetch(transport, request("POST", url, content=b"x"))).content
                for _ in range(3)
            ]
    assert len(set(ports)) == 1


async def test_an_idle_connection_the_upstream_closed_is_not_reused() -> None:
    async with (
        raw_server(answering(OK, close=True)) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        first = await fetch(transport, request("GET", url))
        # The upstream closed its end (as uvicorn does with idle connections).
        await accepted[0].wait_closed()
        second = await fetch(transport, request("GET", url))
        assert (first.content, second.content) == (b"ok", b"ok")
        assert len(accepted) == 2


async def test_a_connection_is_reused_when_its_descriptor_is_past_1023() -> None:
    """A busy proxy's sockets have large descriptors: the stale check before reuse must not
    take them for closed ones (select() cannot watch a descriptor past 1023)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip("needs 1,200 file descriptors")
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        async with (
            raw_server(answering(OK, OK)) as (url, accepted),
            FastTransport(limits=limits()) as transport,
        ):
            for _ in range(2):
                assert (await fetch(transport, request("GET", url))).content == b"ok"
            assert len(accepted) == 1
    finally:
        for fd in fillers:
            os.close(fd)


@pytest.mark.parametrize(
    ("answer", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", False),
        (OK, True),
    ],
)
async def test_an_upstream_that_says_close_gets_a_new_connection(
    answer: bytes, reused: bool
) -> None:
    async with (
        raw_server(answering(answer, answer)) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        for _ in range(2):
            assert (await fetch(transport, request("GET", url))).content == b"ok"
        assert len(accepted) == (1 if reused else 2)


async def test_a_request_that_says_close_is_not_reused() -> None:
    async with (
        raw_server(answering(OK, OK)) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        for _ in range(2):
            await fetch(transport, request("GET", url, headers={"connection": "close"}))
        assert len(accepted) == 2


async def test_a_request_the_upstream_dropped_unanswered_is_not_sent_again() -> None:
    """As httpcore: a request written to a reused connection that the upstream then closes
    without a byte of answer fails; resending it could run a billed model call twice."""
    requests = 0

    async def drops_the_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        writer.write(OK)
        await read_request(reader)
        requests += 1
        writer.transport.abort()

    async with (
        raw_server(in_turn(drops_the_second, answering(OK))) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        await fetch(transport, request("POST", url, content=b"{}"))
        with pytest.raises(httpx.RemoteProtocolError):
            await fetch(transport, request("POST", url, content=b"{}"))
        assert (requests, len(accepted)) == (2, 1)


# -- bodies ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world", b"hello world"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            b"hello world",
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
        (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n", b""),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"ok"),
    ],
    ids=["content-length", "chunked", "204", "304", "interim-100"],
)
async def test_a_framed_body_is_read_whole_and_the_connection_reused(
    answer: bytes, body: bytes
) -> None:
    async with (
        raw_server(answering(answer, OK)) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        response = await fetch(transport, request("GET", url))
        assert response.content == body
        assert (await fetch(transport, request("GET", url))).content == b"ok"
        assert len(accepted) == 1


async def test_a_large_answer_arriving_with_its_head_is_read_whole() -> None:
    body = bytes(i % 251 for i in range(4 * 1024 * 1024))
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    async with (
        raw_server(answering(answer, OK)) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        assert (await fetch(transport, request("GET", url))).content == body
        assert (await fetch(transport, request("GET", url))).content == b"ok"
        assert len(accepted) == 1


async def test_a_head_over_its_bound_is_refused() -> None:
    answer = b"HTTP/1.1 200 OK\r\n" + b"x-filler: %s\r\n" % (b"a" * 1000) * 200
    async with (
        raw_server(answering(answer)) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await fetch(transport, request("GET", url))


async def test_a_head_answer_has_no_body_whatever_its_length_says() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"
    async with (
        raw_server(answering(head, OK)) as (url, accepted),
        FastTransport(limits=limits()) as transport,
    ):
        response = await fetch(transport, request("HEAD", url))
        assert (response.content, response.headers["content-length"]) == (b"", "1000")
        assert (await fetch(transport, request("GET", url))).content == b"ok"
        assert len(accepted) == 1


async def test_a_body_delimited_by_the_close_ends_there() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end"
    async with (
        raw_server(answering(answer, close=True)) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        assert (await fetch(transport, request("GET", url))).content == b"until the end"


async def test_status_reason_version_and_headers_come_as_sent() -> None:
    answer = (
        b"HTTP/1.1 201 Made It\r\nSet-Cookie: a=1\r\nX-Z: 9\r\nset-cookie: b=2\r\n"
        b"content-length: 0\r\n\r\n"
    )
    async with (
        raw_server(answering(answer)) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        response = await fetch(transport, request("GET", url))
    assert response.status_code == 201
    assert response.extensions["reason_phrase"] == b"Made It"
    assert response.extensions["http_version"] == b"HTTP/1.1"
    assert response.headers.raw == [
        (b"Set-Cookie", b"a=1"),
        (b"X-Z", b"9"),
        (b"set-cookie", b"b=2"),
        (b"content-length", b"0"),
    ]


async def test_request_headers_go_in_their_order_case_and_duplicates() -> None:
    heads: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(OK)
        await reader.read()

    headers = [(b"X-B", b"1"), (b"x-a", b"\xe9t\xe9"), (b"X-B", b"3")]
    async with (
        raw_server(record) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        await fetch(transport, request("GET", url + "/p?q=1", headers=headers))
    port = url.rsplit(":", 1)[1]
    assert heads == [
        f"GET /p?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
        + b"X-B: 1\r\nx-a: \xe9t\xe9\r\nX-B: 3\r\n\r\n"
    ]


async def test_a_header_that_would_end_the_request_is_refused() -> None:
    async with (
        raw_server(answering(OK)) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        bad = request("GET", url, headers=[(b"x-a", b"1\r\nx-injected: 2")])
        with pytest.raises(httpx.LocalProtocolError):
            await transport.handle_async_request(bad)
        # The slot the request took is free again.
        assert (await fetch(transport, request("GET", url))).content == b"ok"


@pytest.mark.parametrize("kind", ["bytes", "sized-stream", "unsized-stream"])
async def test_a_request_body_goes_with_its_length_else_chunked(kind: str) -> None:
    payload = bytes(i % 251 for i in range(200_000))
    seen: list[tuple[bytes, bytes]] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await reader.read()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 30_000):
            yield payload[i : i + 30_000]

    content: Any = payload
    headers: list[tuple[bytes, bytes]] = []
    if kind == "sized-stream":
        body = RequestBody(payload)
        content, headers = body, body.headers
    elif kind == "unsized-stream":
        content = pieces()
    async with (
        raw_server(record) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        await fetch(transport, request("POST", url, content=content, headers=headers))
    head, body = seen[0]
    assert body == payload
    chunked = b"transfer-encoding: chunked" in head.lower()
    assert chunked == (kind == "unsized-stream")
    assert (b"content-length: 200000" in head.lower()) == (not chunked)


# -- streaming and flow control --------------------------------------------------------------


async def test_an_sse_stream_arrives_event_by_event() -> None:
    first_seen = threading.Event()

    async def events(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        # The second event only once the client has the first: a transport that held the
        # first back would wait forever (and the guard below would fail the test).
        seen = await asyncio.get_running_loop().run_in_executor(None, first_seen.wait, GUARD_S)
        body = b"data: 2\n\n" if seen else b"data: late\n\n"
        await send({"type": "http.response.body", "body": body})

    with serve(events, lifespan="off") as url:
        async with FastTransport(limits=limits()) as transport:
            response = await transport.handle_async_request(request("POST", url, content=b"{}"))
            chunks = response.aiter_raw()
            assert await asyncio.wait_for(chunks.__anext__(), GUARD_S) == b"data: 1\n\n"
            first_seen.set()
            assert [c async for c in chunks] == [b"data: 2\n\n"]


async def test_a_slow_consumer_pauses_the_socket_and_the_buffer_stays_bounded() -> None:
    total = 64 * 1024 * 1024  # far over what loopback's kernel buffers hold
    piece = bytes(64 * 1024)
    blocked = asyncio.Event()
    sent = 0

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        while sent < total:
            writer.write(piece)
            sent += len(piece)
            if writer.transport.get_write_buffer_size() > 0:
                blocked.set()  # the kernel took no more: the client stopped reading
            await writer.drain()

    async with (
        raw_server(flood) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        response = await transport.handle_async_request(request("GET", url))
        stream = response.stream
        assert isinstance(stream, ResponseStream)
        await asyncio.wait_for(blocked.wait(), GUARD_S)
        assert sent < total
        # What the transport holds unread: its bound and at most one read of the socket more.
        assert stream.buffered <= PAUSE_BYTES + 1024 * 1024
        received = 0
        async for chunk in response.aiter_raw():
            received += len(chunk)
        assert received == total


# -- failures --------------------------------------------------------------------------------


def tiny(**kw: float) -> httpx.Timeout:
    return httpx.Timeout(GUARD_S, **kw)


async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()


async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A loopback port whose accept queue is full: SYNs are dropped, connects hang."""
    with contextlib.closing(socket.socket()) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        time.sleep(0.1)  # set-up: the queue fills
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for s in fillers:
                s.close()


async def test_a_read_timeout_is_httpx_read_timeout() -> None:
    async with (
        raw_server(never_answers) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await transport.handle_async_request(request("GET", url, timeout=tiny(read=0.05)))


async def test_a_stalled_body_is_httpx_read_timeout() -> None:
    stalled = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"
    async with (
        raw_server(answering(stalled)) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        response = await transport.handle_async_request(
            request("GET", url, timeout=tiny(read=0.05))
        )
        with pytest.raises(httpx.ReadTimeout):
            await response.aread()


async def test_a_write_timeout_is_httpx_write_timeout() -> None:
    async def endless() -> AsyncIterator[bytes]:
        piece = bytes(1024 * 1024)
        while True:
            yield piece

    async with (
        raw_server(never_reads) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        req = request("POST", url, content=endless(), timeout=tiny(write=0.05))
        with pytest.raises(httpx.WriteTimeout):
            await transport.handle_async_request(req)


async def test_a_connect_timeout_is_httpx_connect_timeout(blackhole: str) -> None:
    async with FastTransport(limits=limits()) as transport:
        with pytest.raises(httpx.ConnectTimeout):
            await transport.handle_async_request(
                request("GET", blackhole, timeout=tiny(connect=0.05))
            )


async def test_a_refused_connection_is_httpx_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connects are refused
        async with FastTransport(limits=limits()) as transport:
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(request("GET", f"http://127.0.0.1:{port}"))


async def test_waiting_past_the_pool_timeout_is_httpx_pool_timeout() -> None:
    async with (
        raw_server(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab")) as (url, _),
        FastTransport(limits=limits(max_connections=1)) as transport,
    ):
        held = await transport.handle_async_request(request("GET", url))
        with pytest.raises(httpx.PoolTimeout):
            await transport.handle_async_request(request("GET", url, timeout=tiny(pool=0.05)))
        await held.aclose()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"", httpx.RemoteProtocolError),  # closed without a word
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", httpx.RemoteProtocolError),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
            httpx.RemoteProtocolError,
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", httpx.RemoteProtocolError),
    ],
    ids=["no-answer", "short-body", "short-chunked", "garbage"],
)
async def test_a_broken_answer_is_httpx_remote_protocol_error(
    answer: bytes, error: type[Exception]
) -> None:
    async with (
        raw_server(answering(answer, close=True)) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        with pytest.raises(error):
            await fetch(transport, request("GET", url))


async def test_a_reset_mid_body_is_httpx_read_error() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()  # RST, not FIN

    async with (
        raw_server(reset) as (url, _),
        FastTransport(limits=limits()) as transport,
    ):
        response = await transport.handle_async_request(request("GET", url))
        with pytest.raises(httpx.ReadError):
            await response.aread()


# -- cancellation and closing ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def stuck_then_ok(
    first_body: bytes | None,
) -> AsyncIterator[tuple[str, list[asyncio.StreamWriter], asyncio.Event]]:
    """The first connection's request gets the head of a chunked answer and `first_body`
    (None: no answer at all), then nothing, kept open; later connections get answers. The
    event is set once the first request has arrived."""
    reached = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if reached.is_set():
            await answering(OK)(reader, writer)
            return
        await read_request(reader)
        reached.set()
        if first_body is not None:
            head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            writer.write(head + b"%x\r\n%s\r\n" % (len(first_body), first_body))
        await reader.read()

    async with raw_server(handler) as (url, accepted):
        yield url, accepted, reached


async def test_a_consumer_cancelled_mid_stream_frees_its_connection() -> None:
    async with (
        stuck_then_ok(b"data: 1\n\n") as (url, accepted, _),
        FastTransport(limits=limits(max_connections=1)) as transport,
    ):
        got_first = asyncio.Event()

        async def consume() -> None:
            response = await transport.handle_async_request(request("GET", url))
            async for _ in response.aiter_raw():
                got_first.set()  # then waits for a next event that never comes

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_first.wait(), GUARD_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # One connection at most: the next request gets the freed slot, not a pool timeout.
        after = await fetch(transport, request("GET", url))
        assert after.content == b"ok"
        await asyncio.wait_for(accepted[0].wait_closed(), GUARD_S)  # the stuck one was closed


async def test_a_request_cancelled_before_its_answer_frees_its_connection() -> None:
    async with (
        stuck_then_ok(None) as (url, accepted, reached),
        FastTransport(limits=limits(max_connections=1)) as transport,
    ):
        task = asyncio.create_task(transport.handle_async_request(request("GET", url)))
        await asyncio.wait_for(reached.wait(), GUARD_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await fetch(transport, request("GET", url))).content == b"ok"
        await asyncio.wait_for(accepted[0].wait_closed(), GUARD_S)


@pytest.mark.parametrize("when", ["queued", "handed-a-connection"])
async def test_a_request_waiting_for_the_pool_hands_the_slot_on_when_cancelled(when: str) -> None:
    async with (
        raw_server(answering(OK, OK, OK)) as (url, accepted),
        FastTransport(limits=limits(max_connections=1)) as transport,
    ):
        held = await transport.handle_async_request(request("GET", url))
        waiting = asyncio.create_task(transport.handle_async_request(request("GET", url)))
        await asyncio.sleep(0)  # it runs up to its wait for the one connection
        if when == "queued":
            waiting.cancel()
            await held.aread()
        else:
            await held.aread()  # the connection goes to the waiting request at once...
            waiting.cancel()  # ...which is cancelled before it could run
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await fetch(transport, request("GET", url))).content == b"ok"
        assert len(accepted) == 1


async def test_closing_an_unfinished_answer_closes_its_connection() -> None:
    partial = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"
    async with (
        raw_server(in_turn(answering(partial), answering(OK))) as (url, accepted),
        FastTransport(limits=limits(max_connections=1)) as transport,
    ):
        response = await transport.handle_async_request(request("GET", url))
        await response.aclose()
        await asyncio.wait_for(accepted[0].wait_closed(), GUARD_S)
        assert (await fetch(transport, request("GET", url))).content == b"ok"


async def test_closing_the_transport_closes_its_connections() -> None:
    async with raw_server(answering(OK, OK)) as (url, accepted):
        transport = FastTransport(limits=limits())
        await fetch(transport, request("GET", url))  # idle in the pool
        await transport.aclose()
        await asyncio.wait_for(accepted[0].wait_closed(), GUARD_S)
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(request("GET", url))


async def test_waiting_requests_are_served_in_turn_by_one_connection() -> None:
    async with (
        raw_server(answering(*[OK] * 8)) as (url, accepted),
        FastTransport(limits=limits(max_connections=1)) as transport,
    ):
        answers = await asyncio.gather(*(fetch(transport, request("GET", url)) for _ in range(8)))
        assert [a.content for a in answers] == [b"ok"] * 8
        assert len(accepted) == 1


# -- TLS -------------------------------------------------------------------------------------


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 (cryptography), and its key."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_tls_verifies_the_upstream_and_sends_its_name(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    names: list[str | None] = []
    server_tls.sni_callback = lambda sock, name, ctx: names.append(name)  # type: ignore[assignment]
    trusting = ssl.create_default_context(cafile=str(cert))
    async with raw_server(answering(OK, OK), tls=server_tls) as (url, accepted):
        port = url.rsplit(":", 1)[1]
        async with FastTransport(ssl_context=trusting, limits=limits()) as transport:
            for _ in range(2):
                answer = await fetch(transport, request("GET", f"https://localhost:{port}"))
                assert answer.content == b"ok"
        assert names == ["localhost"] and len(accepted) == 1
        # A context that does not trust the certificate refuses the upstream.
        async with FastTransport(ssl_context=ssl.create_default_context()) as transport:
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(request("GET", f"https://localhost:{port}"))
