"""The HTTP server around the app: uvicorn's h11 protocol, guarded against idle sockets.

Outermost edge of the data path (before any ASGI code runs). uvicorn closes an idle
keep-alive connection only after a response, and any byte received cancels that
timer; before the first request nothing is timed at all. So idle sockets and sockets
trickling header bytes stay open for ever, and once the process runs out of file
descriptors normal requests wait and the accept loop fails on every attempt.

`guarded_protocol` adds, per connection:
- a headers deadline: a connection must deliver a request's complete headers within
  `header_timeout_s` of opening (or of `timeout_keep_alive + header_timeout_s` after a
  response); the deadline is absolute, so trickling bytes do not extend it;
- a bound on open connections: past `max_connections`, the connection that has
  waited longest for request headers is closed to make room (one that is serving a
  request never is), else the new one is refused.

`AcceptErrors` logs accept() failures (out of file descriptors) once per episode
instead of once per attempt.
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


def protocol_for(listen: Listen) -> type[H11Protocol]:
    return guarded_protocol(
        listen.header_timeout_s, listen.max_connections or default_max_connections()
    )


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with the headers deadline and the connection bound."""

    class Guarded(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self.waiting_since = time.monotonic()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(header_timeout_s)
            if len(self.connections) > max_connections:
                self._make_room()

        def _make_room(self) -> None:
            waiting = [
                c for c in self.connections if isinstance(c, Guarded) and c.waiting_for_headers
            ]
            victim = min(waiting, key=lambda c: c.waiting_since)  # self is waiting too
            victim.close_idle()

        @property
        def waiting_for_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE and (
                self.cycle is None or self.cycle.response_complete
            )

        def _arm(self, delay: float) -> None:
            self._disarm()
            self.waiting_since = time.monotonic()
            self._deadline = self.loop.call_later(delay, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.waiting_for_headers:
                self.close_idle()

        def close_idle(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                # No response: the client sent no request (a 408 would be a lie to a
                # client that is about to send one on a reused connection).
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and not self.waiting_for_headers:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(self.timeout_keep_alive + header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Guarded


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
