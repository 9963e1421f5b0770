"""Per-connection guards against slow clients, for uvicorn's HTTP/1.1 protocols.

Outermost edge of the data path (before any ASGI code runs). uvicorn closes an idle
keep-alive connection only after a response, and any byte received cancels that
timer; before the first request nothing is timed at all; a request's body and a
response's bytes are never timed. So sockets that send nothing, trickle header or body
bytes, or never read what they asked for stay open for ever: once they fill
`max_connections` (or the process's file descriptors, or an upstream's pool), normal
requests wait or are refused.

`Guards` adds, per connection:
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

`Guards` is a mixin over one of uvicorn's protocols: the protocol says where its parser
is (`headers_pending`, `body_pending`) and writes the 408 (`timeout_answer`); everything
else is the same for both (proxy/edge/serving.py puts them together). `SlowClients` logs
once per episode (a slowloris) instead of once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from uvicorn.protocols.http.flow_control import FlowControl

from proxy.config import Listen
from proxy.errors import OPENAI_ERRORS, RequestTimeout

log = logging.getLogger("recap.server")

# Past the bound, a body this far behind its rate, or a response stalled this long, may
# be closed to make room: less would cut a client whose next segment is on its way (a
# body follows its headers within a round trip). More lets a slowloris that reconnects
# as fast as it is closed keep every slot younger than the grace, so that the newcomer,
# a real client, is the one closed (benchmarks/slowloris.py: with 1 s, 29% of requests).
SLOW_GRACE_S = 0.25


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


def refusal() -> bytes:
    """The 408's body, in the OpenAI error shape."""
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


class Guards(asyncio.Protocol):
    """The deadlines and the connection bound, mixed in before one of uvicorn's protocols
    (which provides `transport`, `loop`, `connections`, `cycle`, `flow`,
    `timeout_keep_alive` and `on_response_complete`). The class attributes are set per
    server by `proxy.edge.serving.guarded_protocol`."""

    listen: ClassVar[Listen]
    max_connections: ClassVar[int]
    slow: ClassVar[SlowClients]

    # What the protocol under the mixin has.
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]
    cycle: Any
    flow: FlowControl
    timeout_keep_alive: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None
        self.waiting_since = time.monotonic()
        self.body: BodyClock | None = None
        self.stalled_since: float | None = None

    # -- where the protocol's parser is (each protocol says) ------------------------------

    def headers_pending(self) -> bool:
        """No complete request headers since the last response (or the connection's start)."""
        raise NotImplementedError

    def body_pending(self) -> bool:
        """A request's headers are in and its body is not all in."""
        raise NotImplementedError

    def timeout_answer(self, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The bytes of a 408 with `headers` and `body` ("" when the protocol cannot send
        one any more)."""
        raise NotImplementedError

    # -- the mixin ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self._reading_paused)
        self._arm(self.listen.header_timeout_s)
        if len(self.connections) > self.max_connections:
            self._make_room()

    # -- the bound -------------------------------------------------------------------

    def _make_room(self) -> None:
        now = time.monotonic()
        waiting = [
            (lag, c)
            for c in self.connections
            if isinstance(c, Guards) and c is not self and (lag := c.lag(now)) is not None
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
        return self.headers_pending() and (self.cycle is None or self.cycle.response_complete)

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
        listen = self.listen
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
        self.slow.report(
            f"request bodies under {self.listen.body_min_rate:g} bytes/s", time.monotonic()
        )
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        body = refusal()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        # The app gets no say any more: its sends are dropped, its receive says
        # the client is gone (it is, once the answer is out).
        cycle.disconnected = True
        cycle.message_event.set()
        out = self.timeout_answer(headers, body)
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
        if self.body_pending():
            if self.body is None:  # the headers are in: the body's clock starts
                now = time.monotonic()
                listen = self.listen
                self.body = BodyClock(now, listen.body_timeout_s, listen.body_min_rate)
                if self.flow.read_paused:
                    self.body.pause(now)
                self._arm_body(listen.body_timeout_s)
            return
        self.body = None  # none, or all of it is in
        if self._deadline is not None and not self.waiting_for_headers:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm(self.timeout_keep_alive + self.listen.header_timeout_s)

    # -- the send deadline ------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stalled_since is None:
            self.stalled_since = time.monotonic()
            self._send_deadline = self.loop.call_later(self.listen.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.stalled_since = None
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _stalled(self) -> None:
        self._send_deadline = None
        if self.stalled_since is not None:
            self._cut(f"responses not read for {self.listen.send_timeout_s:g} s")

    def _cut(self, why: str) -> None:
        """Close at once: what the buffer holds would never be read (a close would
        wait for it to drain)."""
        self.slow.report(why, time.monotonic())
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
        self.body = None
        super().connection_lost(exc)
