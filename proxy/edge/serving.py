"""The HTTP server around the app: uvicorn's protocol under the connection guards.

`protocol_for` is the protocol `recap serve` gives uvicorn: the guards of
proxy/edge/guards.py (headers, body and send deadlines, a bound on open connections) over
uvicorn's h11 protocol. `AcceptErrors` logs once per episode (running out of file
descriptors) instead of once per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from proxy.config import Listen
from proxy.edge.guards import Guards, SlowClients

log = logging.getLogger("recap.server")

# File descriptors kept for the upstream pools, the store and the process itself when
# the connection bound is derived from the fd limit.
FD_SHARE_FOR_CLIENTS = 0.5


def default_max_connections() -> int:
    """Half the process's file descriptors (the other half: upstreams, store, logs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(8, int((soft - 32) * FD_SHARE_FOR_CLIENTS))


def protocol_for(listen: Listen) -> type[Guards]:
    return guarded_protocol(listen, listen.max_connections or default_max_connections())


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


def guarded_protocol(listen: Listen, max_connections: int) -> type[Guards]:
    """A protocol class with the deadlines and the connection bound of `listen`, and its
    own once-per-episode log of slow clients."""
    attrs = {"listen": listen, "max_connections": max_connections, "slow": SlowClients()}
    return type("Guarded", (GuardedH11,), attrs)


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
