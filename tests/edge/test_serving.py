"""Connection hygiene (issue 13 item 6, issue 23 items 4 and 5) with real sockets against
the proxy as served.

Idle sockets and sockets trickling header bytes are closed by the headers deadline; a
body trickled under `body_min_rate` gets a 408 and its connection closed; a client that
stops reading a stream is cut and the upstream stream it held is closed. Past the
connection bound the socket that has kept the proxy waiting longest (for headers, for a
body behind its rate, for a response it does not read) is closed to make room, so a
normal request still gets through. The tests wait for the event itself (the server's
FIN, its 408, the upstream's stream ending), never for a wall-clock bound; where they
sleep, it is only to let a slow client fall behind, which only takes longer on a loaded
machine. The body's clock and the once-per-episode logs are driven with fake times.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import Listen
from proxy.edge.guards import BodyClock, SlowClients
from proxy.edge.serving import AcceptErrors, protocol_for
from tests.conftest import LogCapture, make_config
from tests.fakes import FakeUpstream
from tests.servers import recap_app, serve
from tests.slow import (
    EndlessStreams,
    Trickler,
    chat_head,
    connect,
    read_until_closed,
    stream_request,
)

HANG_GUARD_S = 60  # only so a broken build fails instead of hanging the suite


@pytest.fixture(params=["httptools", "h11"])
def http(request: pytest.FixtureRequest) -> str:
    """Every guard is tested on both of `listen.http`'s parsers."""
    return str(request.param)


@pytest.fixture
def guarded(upstream_url: str, tmp_path: Path, http: str) -> Iterator[str]:
    app = recap_app(make_config(upstream_url, tmp_path))
    listen = Listen(header_timeout_s=0.5, max_connections=8, http=http)  # type: ignore[arg-type]
    with serve(app, http=protocol_for(listen)) as url:
        yield url


def closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes the connection (EOF or reset)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_idle_and_trickling_sockets_are_closed(guarded: str) -> None:
    idle = [connect(guarded) for _ in range(4)]
    trickler = connect(guarded)
    stop = threading.Event()

    def trickle() -> None:
        # Header bytes, one at a time: each is progress, none completes the headers.
        line = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        for byte in line:
            if stop.wait(0.05):
                return
            try:
                trickler.send(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    assert closed_by_server(trickler)
    stop.set()
    thread.join()
    assert all(closed_by_server(s) for s in idle)
    assert httpx.get(f"{guarded}/healthz").status_code == 200


def test_connection_bound_makes_room_for_a_real_request(guarded: str) -> None:
    # Twice the bound of sockets that never send a byte, then a normal request.
    idle = [connect(guarded) for _ in range(16)]
    r = httpx.get(f"{guarded}/healthz", timeout=HANG_GUARD_S)
    assert r.status_code == 200
    # The oldest were closed to make room, at once (before any deadline could matter,
    # they are the ones opened first).
    assert closed_by_server(idle[0])
    assert all(closed_by_server(s) for s in idle[1:])


def test_keep_alive_connection_serves_requests_then_is_closed_when_idle(guarded: str) -> None:
    with httpx.Client(timeout=HANG_GUARD_S) as client:
        for _ in range(3):
            assert client.get(f"{guarded}/healthz").status_code == 200
    sock = connect(guarded)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    # The answer (in as many segments as it comes), then the close: after keep-alive +
    # headers deadline with no new request.
    answer = read_until_closed(sock)
    assert b"200" in answer.split(b"\r\n")[0]


def test_headers_past_16_kib_get_400_and_the_connection_closed(guarded: str) -> None:
    """h11 refuses unfinished headers past 16 KiB; httptools keeps any size, so its
    adapter counts them and refuses the same way (without it, one connection could make
    the proxy hold gigabytes of header until the headers deadline)."""
    sock = connect(guarded)
    # 20 KiB of one header, never finished, then nothing: without the bound the server
    # waits for the rest until the headers deadline closes the socket with no answer.
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20 * 1024)
    answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    # Headers under the bound go through.
    r = httpx.get(f"{guarded}/healthz", headers={"x-big": "a" * 12_000}, timeout=HANG_GUARD_S)
    assert r.status_code == 200


def test_accept_errors_are_logged_once_per_episode(logs: LogCapture) -> None:
    errors = AcceptErrors(quiet_s=10)
    logged = [errors.report(OSError(24, "Too many open files"), t / 1000) for t in range(5000)]
    assert logged.count(True) == 1  # 5000 attempts in 5 s: one episode, one line
    assert errors.report(OSError(24, "Too many open files"), 100.0)  # a new episode
    lines = [r for r in logs.records("recap.server") if r["level"] == "error"]
    assert len(lines) == 2
    assert "5000 failures" in lines[1]["msg"]
    logging.getLogger("recap.server").handlers.clear()


# --- bodies and responses that crawl (issue 23 items 4 and 5) -----------------------------


@pytest.fixture
def endless() -> Iterator[tuple[EndlessStreams, str]]:
    streams = EndlessStreams()
    with serve(streams, lifespan="off") as url:
        yield streams, url


def served(upstream: str, tmp_path: Path, http: str, **listen: Any) -> Any:
    config = make_config(upstream, tmp_path)
    return serve(recap_app(config), http=protocol_for(Listen(http=http, **listen)))  # type: ignore[arg-type]


def test_a_trickled_body_gets_408_and_its_connection_closed(
    upstream_url: str, tmp_path: Path, http: str
) -> None:
    """Complete headers, then a byte every 50 ms (20 B/s, under `body_min_rate`): on
    ce59ff6 the connection stayed open for as long as the client liked."""
    stop = threading.Event()
    with served(upstream_url, tmp_path, http, body_timeout_s=0.5, body_min_rate=1000) as url:
        slow = Trickler(url, 0.05, stop)
        answer = read_until_closed(slow.sock)
        stop.set()
        assert httpx.get(f"{url}/healthz", timeout=HANG_GUARD_S).status_code == 200
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"


def test_a_body_at_a_fair_rate_is_never_cut(
    upstream_url: str, tmp_path: Path, fake: FakeUpstream, http: str
) -> None:
    """A second of credit for every `body_min_rate` bytes: a body sent in pieces over
    longer than `body_timeout_s` goes through whole."""
    payload = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    raw = (payload + " " * 40_000).encode()
    with served(upstream_url, tmp_path, http, body_timeout_s=0.3, body_min_rate=1000) as url:
        sock = connect(url)
        sock.sendall(chat_head(len(raw)) + raw[:2000])
        for i in range(2000, len(raw), 2000):
            time.sleep(0.05)  # 40 KB/s: 2 s of credit a piece
            sock.sendall(raw[i : i + 2000])
        sock.sendall(b"")
        answer = sock.recv(65536)
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    (sent,) = fake.chat_requests()
    assert sent.json["messages"] == [{"role": "user", "content": "hi"}]


def test_past_the_bound_a_slow_body_makes_room_for_a_real_request(
    upstream_url: str, tmp_path: Path, http: str
) -> None:
    """Twice the bound of trickled bodies, each far from its deadline: each newcomer, and
    then the request, gets in by closing the body furthest behind its rate, with a 408."""
    stop = threading.Event()
    with served(
        upstream_url, tmp_path, http, max_connections=8, body_timeout_s=60, body_min_rate=1000
    ) as url:
        first = [Trickler(url, 0.2, stop) for _ in range(8)]
        time.sleep(1.0)  # only so each body is behind its rate by more than SLOW_GRACE_S
        second = [Trickler(url, 0.2, stop) for _ in range(8)]  # each closes one of `first`
        time.sleep(1.0)
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=HANG_GUARD_S,
        )
        assert r.status_code == 200, r.text
        stop.set()
        answers = [read_until_closed(t.sock) for t in first]
        # The request closed one of `second`: wait for its answer.
        ready, _, _ = select.select([t.sock for t in second], [], [], HANG_GUARD_S)
        assert ready, "the request got in without closing a slow body"
        answers.append(read_until_closed(ready[0]))
        for t in second:
            t.sock.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), [a[:20] for a in answers]


def test_a_client_that_stops_reading_is_cut_and_its_upstream_stream_closed(
    endless: tuple[EndlessStreams, str], tmp_path: Path, http: str
) -> None:
    streams, upstream = endless
    with served(upstream, tmp_path, http, send_timeout_s=0.5) as url:
        stuck = connect(url, rcvbuf=4096)
        stuck.sendall(stream_request())
        assert streams.wait(lambda s: s.open == 1, HANG_GUARD_S)
        # Never read: the socket's buffers fill, the proxy's writes wait, and after
        # send_timeout_s the client is cut and the upstream stream let go.
        assert streams.wait(lambda s: s.ended == 1, HANG_GUARD_S), "the stream is still held"
        assert closed_after_reading(stuck)


def test_past_the_bound_a_stalled_response_makes_room_for_a_real_request(
    endless: tuple[EndlessStreams, str], tmp_path: Path, http: str
) -> None:
    streams, upstream = endless
    with served(upstream, tmp_path, http, max_connections=4, send_timeout_s=600) as url:
        stuck = []
        for _ in range(8):
            sock = connect(url, rcvbuf=4096)
            sock.sendall(stream_request())
            stuck.append(sock)
        assert streams.wait(lambda s: s.open + s.ended >= 4, HANG_GUARD_S)
        time.sleep(1.0)  # only so each response is stalled for longer than SLOW_GRACE_S
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=HANG_GUARD_S,
        )
        assert r.status_code == 200, r.text
        assert streams.wait(lambda s: s.ended >= 1, HANG_GUARD_S)
        for sock in stuck:
            sock.close()


def closed_after_reading(sock: socket.socket) -> bool:
    """Reads what the socket holds; True once the server has closed it."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return True


def test_the_body_clock_credits_bytes_and_never_counts_the_proxys_own_pauses() -> None:
    clock = BodyClock(100.0, timeout_s=20, min_rate=1000)
    assert clock.due() == 120.0
    clock.received += 5000  # five seconds of credit
    assert clock.due() == 125.0 and clock.behind(103.0) == -2.0
    clock.pause(104.0)  # the proxy stopped reading (the app is not taking the body)
    assert clock.due() == float("inf") and clock.behind(200.0) == -1.0
    clock.resume(134.0)
    assert clock.due() == 155.0 and clock.behind(137.0) == 2.0  # 7 s in, 5 s of credit


def test_slow_clients_are_logged_once_per_episode(logs: LogCapture) -> None:
    slow = SlowClients(quiet_s=10)
    assert [slow.report("bodies", t / 10) for t in range(300)].count(True) == 1
    assert slow.report("bodies", 100.0)
    lines = [r for r in logs.records("recap.server") if r["level"] == "warning"]
    assert len(lines) == 2 and "300 closed" in lines[1]["msg"]
    logging.getLogger("recap.server").handlers.clear()
