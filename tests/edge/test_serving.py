"""Connection hygiene (issue 13 item 6) with real sockets against the proxy as served.

Idle sockets and sockets trickling header bytes are closed by the headers deadline;
past the connection bound the socket that has waited longest is closed to make room,
so a normal request still gets through. The tests wait for the close itself (the
server's FIN), never for a wall-clock bound. And accept() failures are logged once
per episode (the handler is driven with a fake clock).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.config import Listen
from proxy.edge.serving import AcceptErrors, protocol_for
from tests.conftest import LogCapture, make_config
from tests.servers import recap_app, serve

HANG_GUARD_S = 60  # only so a broken build fails instead of hanging the suite


@pytest.fixture
def guarded(upstream_url: str, tmp_path: Path) -> Iterator[str]:
    app = recap_app(make_config(upstream_url, tmp_path))
    with serve(app, http=protocol_for(Listen(header_timeout_s=0.5, max_connections=8))) as url:
        yield url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(HANG_GUARD_S)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes the connection (EOF or reset)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (EOF or reset)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return data


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


def test_accept_errors_are_logged_once_per_episode(logs: LogCapture) -> None:
    errors = AcceptErrors(quiet_s=10)
    logged = [errors.report(OSError(24, "Too many open files"), t / 1000) for t in range(5000)]
    assert logged.count(True) == 1  # 5000 attempts in 5 s: one episode, one line
    assert errors.report(OSError(24, "Too many open files"), 100.0)  # a new episode
    lines = [r for r in logs.records("recap.server") if r["level"] == "error"]
    assert len(lines) == 2
    assert "5000 failures" in lines[1]["msg"]
    logging.getLogger("recap.server").handlers.clear()
