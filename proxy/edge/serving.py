"""The HTTP server around the app: uvicorn's protocol under the connection guards.

`protocol_for` is the protocol `recap serve` gives uvicorn: the guards of
proxy/edge/guards.py (headers, body and send deadlines, a bound on open connections) over
uvicorn's httptools protocol (llhttp, in C: `listen.http: httptools`, the default) or its
h11 one (pure Python: `listen.http: h11`). Each adapter says where its parser is. h11
refuses a request whose headers pass 16 KiB (its incomplete-event bound) with 400;
httptools has no such bound, so its adapter counts the bytes of unfinished headers and
refuses the same way past the same size (counted by whole reads after the last complete
headers: at most one read more is held). `AcceptErrors` logs once per episode (running
out of file descriptors) instead of once per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.config import Listen
from proxy.edge.guards import Guards, SlowClients

log = logging.getLogger("recap.server")

# File descriptors kept for the upstream pools, the store and the process itself when
# the connection bound is derived from the fd limit.
FD_SHARE_FOR_CLIENTS = 0.5
# h11's own bound on unfinished headers (uvicorn's `h11_max_incomplete_event_size` unset).
H11_HEADERS_BOUND = 16 * 1024


def default_max_connections() -> int:
    """Half the process's file descriptors (the other half: upstreams, store, logs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(8, int((soft - 32) * FD_SHARE_FOR_CLIENTS))


def protocol_for(listen: Listen) -> type[Guards]:
    return guarded_protocol(listen, listen.max_connections or default_max_connections())


def _answer(status: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return b"HTTP/1.1 " + status + b"\r\n" + head + b"\r\n" + body


class GuardedH11(Guards, H11Protocol):
    """uvicorn's h11 protocol under the guards: h11's connection states say where the
    request is."""

    conn: h11.Connection

    def headers_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def body_pending(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def timeout_answer(self, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        if self.conn.our_state is not h11.SEND_RESPONSE:
            return b""
        try:
            out = self.conn.send(
                h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
            )
            out = (out or b"") + (self.conn.send(h11.Data(data=body)) or b"")
            return out + (self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            return b""


class GuardedHttpTools(Guards, HttpToolsProtocol):
    """uvicorn's httptools protocol under the guards: its parser's callbacks say where
    the request is (httptools keeps no state one could ask)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open = 0  # requests whose headers are in and whose response is not complete
        self._in_body = False
        self._header_bytes = 0  # read since the last headers were complete (about: see above)

    def headers_pending(self) -> bool:
        return self._open == 0

    def body_pending(self) -> bool:
        return self._in_body

    def timeout_answer(self, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        return _answer(b"408 Request Timeout", headers, body)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._open or self._in_body or self.transport.is_closing():
            return  # headers done with this read (the count starts again), or a body's
        self._header_bytes += len(data)
        if self._header_bytes > (self.config.h11_max_incomplete_event_size or H11_HEADERS_BOUND):
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

    def on_headers_complete(self) -> None:
        self._header_bytes = 0
        self._open += 1
        self._in_body = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._open = max(0, self._open - 1)
        super().on_response_complete()


def guarded_protocol(listen: Listen, max_connections: int, http: str | None = None) -> type[Guards]:
    """A protocol class with the deadlines and the connection bound of `listen`, and its
    own once-per-episode log of slow clients; on `listen.http`'s parser unless `http`
    names the other."""
    base: type[Guards] = GuardedH11 if (http or listen.http) == "h11" else GuardedHttpTools
    attrs = {"listen": listen, "max_connections": max_connections, "slow": SlowClients()}
    return type(f"Guarded{base.__name__.removeprefix('Guarded')}", (base,), attrs)


class AcceptErrors:
    """A loop exception handler: accept() failures logged once per episode.

    asyncio retries accept() after a failure (EMFILE: out of file descriptors) and
    reports every attempt; an episode ends when no failure was reported for
    `quiet_s`, and the next failure starts a new one (logged with the count of the
    previous episode's attempts).
    """

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, quiet_s: float = 10.0) -> None:
        self.quiet_s = quiet_s
        self.attempts = 0
        self.last = float("-inf")

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == self.MESSAGE:
                self.report(context.get("exception"), time.monotonic())
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def report(self, exc: object, now: float) -> bool:
        """Count one failed accept; True when it was logged (the start of an episode)."""
        new_episode = now - self.last > self.quiet_s
        self.last = now
        if new_episode:
            before = f" (the last episode: {self.attempts} failures)" if self.attempts else ""
            log.error(
                "cannot accept connections: %s; retrying, logged once per episode%s",
                exc,
                before,
            )
            self.attempts = 0
        self.attempts += 1
        return new_episode
