"""The HTTP server around the app: uvicorn's h11 protocol, guarded against slow clients.

Outermost edge of the data path (before any ASGI code runs). uvicorn closes an idle
keep-alive connection only after a response, and any byte received cancels that
timer; before the first request nothing is timed at all; a request's body and a
response's bytes are never timed. So sockets that send nothing, trickle header or body
bytes, or never read what they asked for stay open for ever: once they fill
`max_connections` (or the process's file descriptors, or an upstream's pool), normal
requests wait or are refused.

`guarded_protocol` adds, per connection:
- a headers deadline: a connection must deliver a request's complete headers within
  `header_timeout_s` of opening (or of `timeout_keep_alive + header_timeout_s` after a
  response); the deadline is absolute, so trickling bytes do not extend it;
- a body deadline: once the headers are in, the body must arrive within
  `body_timeout_s` plus a second for every `body_min_rate` bytes received (`BodyClock`;
  time the proxy itself stops reading, its flow control, does not count); else the client
  is answered 408 `request_timeout` in the OpenAI error shape and the connection closed;
- a send deadline: a client that takes none of a response's bytes for `send_timeout_s`
  (the transport's buffer stays over its high-water mark) is cut; the app sees the
  disconnect and closes the upstream stream it was relaying;
- a bound on open connections: past `max_connections`, the connection that has kept
  the proxy waiting on it longest is closed to make room: one waiting for request
  headers (its wait), one whose body is over `SLOW_GRACE_S` behind its minimum rate (how
  far behind; answered 408), or one whose client has taken no response bytes for over
  `SLOW_GRACE_S` (how long). A request in progress at a fair rate never is; when none
  can go, the new connection is closed.

`SlowClients` and `AcceptErrors` log once per episode (a slowloris, running out of file
descriptors) instead of once per connection or attempt.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from proxy.config import Listen
from proxy.errors import OPENAI_ERRORS, RequestTimeout

log = logging.getLogger("recap.server")

# File descriptors kept for the upstream pools, the store and the process itself when
# the connection bound is derived from the fd limit.
FD_SHARE_FOR_CLIENTS = 0.5
# Past the bound, a body this far behind its rate, or a response stalled this long, may
# be closed to make room: less would cut a client whose next segment is on its way (a
# body follows its headers within a round trip). More lets a slowloris that reconnects
# as fast as it is closed keep every slot younger than the grace, so that the newcomer,
# a real client, is the one closed (benchmarks/slowloris.py: with 1 s, 29% of requests).
SLOW_GRACE_S = 0.25


def default_max_connections() -> int:
    """Half the process's file descriptors (the other half: upstreams, store, logs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(8, int((soft - 32) * FD_SHARE_FOR_CLIENTS))


def protocol_for(listen: Listen) -> type[H11Protocol]:
    return guarded_protocol(listen, listen.max_connections or default_max_connections())


class BodyClock:
    """How a request body keeps its pace: due within `timeout_s` of the headers plus
    `1 / min_rate` seconds a byte received; time spent paused (the proxy not reading)
    moves the start on. Pure: times are given."""

    def __init__(self, now: float, timeout_s: float, min_rate: float) -> None:
        self.start = now
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.received = 0
        self.paused_at: float | None = None

    def pause(self, now: float) -> None:
        if self.paused_at is None:
            self.paused_at = now

    def resume(self, now: float) -> None:
        if self.paused_at is not None:
            self.start += now - self.paused_at
            self.paused_at = None

    def due(self) -> float:
        """When the body is late (never while paused)."""
        if self.paused_at is not None:
            return float("inf")
        return self.start + self.timeout_s + self.received / self.min_rate

    def behind(self, now: float) -> float:
        """Seconds the body is behind `min_rate` since its headers (negative: ahead)."""
        at = now if self.paused_at is None else self.paused_at
        return (at - self.start) - self.received / self.min_rate


class SlowClients:
    """Slow clients closed, logged once per episode (an episode ends after `quiet_s`
    with none), with the count of the previous one."""

    def __init__(self, quiet_s: float = 10.0) -> None:
        self.quiet_s = quiet_s
        self.closed = 0
        self.last = float("-inf")

    def report(self, why: str, now: float) -> bool:
        new_episode = now - self.last > self.quiet_s
        self.last = now
        if new_episode:
            before = f" (the last episode: {self.closed} closed)" if self.closed else ""
            log.warning(
                "closing slow client connections (%s); logged once per episode%s", why, before
            )
            self.closed = 0
        self.closed += 1
        return new_episode


def _refusal() -> bytes:
    err = RequestTimeout("The request body arrived too slowly; send it at a steady pace.")
    return OPENAI_ERRORS.body(err)


class _Flow(FlowControl):
    """uvicorn's flow control, telling the protocol when the proxy stops reading."""

    def __init__(self, transport: asyncio.Transport, paused: Callable[[bool], None]) -> None:
        super().__init__(transport)
        self._paused = paused

    def pause_reading(self) -> None:
        if not self.read_paused:
            self._paused(True)
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self._paused(False)
        super().resume_reading()


def guarded_protocol(listen: Listen, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with the deadlines and the connection bound of `listen`."""
    header_timeout_s = listen.header_timeout_s
    slow = SlowClients()

    class Guarded(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._send_deadline: asyncio.TimerHandle | None = None
            self.waiting_since = time.monotonic()
            self.body: BodyClock | None = None
            self.stalled_since: float | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.flow = _Flow(transport, self._reading_paused)
            self._arm(header_timeout_s)
            if len(self.connections) > max_connections:
                self._make_room()

        # -- the bound -------------------------------------------------------------------

        def _make_room(self) -> None:
            now = time.monotonic()
            waiting = [
                (lag, c)
                for c in self.connections
                if isinstance(c, Guarded) and c is not self and (lag := c.lag(now)) is not None
            ]
            if waiting:
                max(waiting, key=lambda pair: pair[0])[1].evict()
            else:
                self.close_idle()

        def lag(self, now: float) -> float | None:
            """How long this connection has kept the proxy waiting on its client, when
            it may be closed to make room (None: it may not)."""
            if self.waiting_for_headers:
                return now - self.waiting_since
            if self.body is not None:
                behind = self.body.behind(now)
                return behind if behind >= SLOW_GRACE_S else None
            if self.stalled_since is not None and now - self.stalled_since >= SLOW_GRACE_S:
                return now - self.stalled_since
            return None

        def evict(self) -> None:
            if self.waiting_for_headers:
                self.close_idle()
            elif self.body is not None:
                self._refuse_slow_body()
            else:
                self._cut("a response not read, past max_connections")

        # -- the headers and body deadlines ---------------------------------------------

        @property
        def waiting_for_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE and (
                self.cycle is None or self.cycle.response_complete
            )

        def _arm(self, delay: float) -> None:
            self._disarm()
            self.waiting_since = time.monotonic()
            self._deadline = self.loop.call_later(delay, self._expired)

        def _arm_body(self, delay: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(max(0.0, delay), self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.waiting_for_headers:
                self.close_idle()
                return
            body = self.body
            if body is None:
                return
            now = time.monotonic()
            if self.cycle is not None and self.cycle.waiting_for_100_continue:
                # The client waits for our 100 Continue: its time does not run yet.
                self.body = BodyClock(now, listen.body_timeout_s, listen.body_min_rate)
                self._arm_body(listen.body_timeout_s)
            elif body.paused_at is not None:
                self._arm_body(listen.body_timeout_s)  # looked at again when reading resumes
            elif now < body.due():
                self._arm_body(body.due() - now)
            else:
                self._refuse_slow_body()

        def _reading_paused(self, paused: bool) -> None:
            if self.body is not None:
                now = time.monotonic()
                if paused:
                    self.body.pause(now)
                else:
                    self.body.resume(now)

        def _refuse_slow_body(self) -> None:
            """408, and the connection closed; the app sees a disconnect."""
            self.body = None
            self._disarm()
            slow.report(f"request bodies under {listen.body_min_rate:g} bytes/s", time.monotonic())
            cycle = self.cycle
            if self.transport.is_closing():
                return
            if (
                cycle is None
                or cycle.response_started
                or self.conn.our_state is not h11.SEND_RESPONSE
            ):
                self.transport.close()
                return
            # The app gets no say any more: its sends are dropped, its receive says
            # the client is gone (it is, once the answer is out).
            cycle.disconnected = True
            cycle.message_event.set()
            body = _refusal()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            try:
                out = self.conn.send(
                    h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
                )
                out = (out or b"") + (self.conn.send(h11.Data(data=body)) or b"")
                out += self.conn.send(h11.EndOfMessage()) or b""
            except h11.LocalProtocolError:
                out = b""
            if out:
                self.transport.write(out)
            self.transport.close()

        def close_idle(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                # No response: the client sent no request (a 408 would be a lie to a
                # client that is about to send one on a reused connection).
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.body is not None:
                self.body.received += len(data)
            super().data_received(data)
            if self.conn.their_state is h11.SEND_BODY:
                if self.body is None:  # the headers are in: the body's clock starts
                    now = time.monotonic()
                    self.body = BodyClock(now, listen.body_timeout_s, listen.body_min_rate)
                    if self.flow.read_paused:
                        self.body.pause(now)
                    self._arm_body(listen.body_timeout_s)
                return
            self.body = None  # none, or all of it is in
            if self._deadline is not None and not self.waiting_for_headers:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(self.timeout_keep_alive + header_timeout_s)

        # -- the send deadline ------------------------------------------------------------

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.stalled_since is None:
                self.stalled_since = time.monotonic()
                self._send_deadline = self.loop.call_later(listen.send_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self.stalled_since = None
            if self._send_deadline is not None:
                self._send_deadline.cancel()
                self._send_deadline = None

        def _stalled(self) -> None:
            self._send_deadline = None
            if self.stalled_since is not None:
                self._cut(f"responses not read for {listen.send_timeout_s:g} s")

        def _cut(self, why: str) -> None:
            """Close at once: what the buffer holds would never be read (a close would
            wait for it to drain)."""
            slow.report(why, time.monotonic())
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._send_deadline is not None:
                self._send_deadline.cancel()
                self._send_deadline = None
            self.body = None
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
