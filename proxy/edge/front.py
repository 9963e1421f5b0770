"""The top of every HTTP request: its id, its access line, its metrics, its error boundary.

One pure-ASGI layer with one `send` wrapper, because every chunk of a streamed answer
passes through it (a layer per concern cost a coroutine call per chunk each):

- the request's record (`proxy/record.py`): made here, with the request id, which also
  goes out as the `x-recap-request-id` response header;
- the access line (`recap.access`), written from the record when the response is done,
  with the status, the time to first byte (unless the handler set its own) and the
  total time; quiet paths (`QUIET_PATHS`) write none and are not counted;
- the metrics (`metrics.Metrics.observe`) from the same record;
- the error boundary: anything that escapes the handler is a bug. It is logged once with
  its traceback and the request id, and answered as a 500 in the route's API's error
  shape (OpenAI's unless the route says otherwise); if the response had already started,
  a stream gets a final error event and ends (a client never waits on a response that
  will not finish). Nothing is re-raised, so the server does not log it a second time or
  drop the connection.

The errors a handler raises on purpose (RecapError, StoreError, routing's 404/405) are
rendered by Starlette's exception handlers (`boundary.EXCEPTION_HANDLERS`), inside this.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from proxy.edge.boundary import describe
from proxy.edge.metrics import Metrics
from proxy.edge.relay import Message, Receive, Scope, Send
from proxy.errors import OPENAI_ERRORS, ErrorShape, InternalError
from proxy.record import RequestRecord, record_of

log = logging.getLogger("recap.error")
access_log = logging.getLogger("recap.access")

QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

_REQUEST_ID = b"x-recap-request-id"


class Edge:
    def __init__(self, app: Any, metrics: Metrics, errors: ErrorShape = OPENAI_ERRORS) -> None:
        self.app = app
        self.metrics = metrics
        # The shape of the last resort's 500: the route's API's (OpenAI's by default).
        self.errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = uuid.uuid4().hex[:16]
        record = record_of(scope)
        record.request_id, record.method, record.path = request_id, scope["method"], scope["path"]
        quiet = scope["path"] in QUIET_PATHS
        # [is_sse] once the status line is out; the first body byte's time; the last body.
        started: list[bool] = []
        first_byte = 0.0
        ended = False

        async def edge_send(message: Message) -> None:
            nonlocal first_byte, ended
            if message["type"] == "http.response.body":
                if not first_byte and message.get("body"):
                    first_byte = time.perf_counter()
                if not message.get("more_body"):
                    ended = True
            elif message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [*message.get("headers", []), (_REQUEST_ID, request_id.encode())]
                message["headers"] = headers
                ctype = next((v for k, v in headers if k == b"content-type"), b"")
                started.append(ctype.startswith(b"text/event-stream"))
            await send(message)

        if not quiet:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, edge_send)
        except Exception as exc:
            # The top of a request: the one place a broad except belongs (a bug must not
            # leave the client waiting or the connection dropped without an answer).
            await self._fail(scope, send, record, exc, started, ended)
        finally:
            if not quiet:
                self.metrics.in_flight.dec()
                if first_byte and record.ttfb_ms is None:
                    # Unless the handler knows better (a compacting stream's first
                    # bytes are progress comments, not the model's).
                    record.ttfb_ms = round((first_byte - start) * 1000, 1)
                record.total_ms = round((time.perf_counter() - start) * 1000, 1)
                access_log.info("request", extra={"fields": record.as_log()})
                self.metrics.observe(record)

    async def _fail(
        self,
        scope: Scope,
        send: Send,
        record: RequestRecord,
        exc: Exception,
        started: list[bool],
        ended: bool,
    ) -> None:
        record.error = InternalError.code
        log.error(
            "unexpected error on %s %s: %s",
            scope.get("method"),
            scope.get("path"),
            describe(exc),
            exc_info=exc,
            extra={"request_id": record.request_id},
        )
        err = InternalError("The proxy failed on this request; see its log (request id).")
        try:
            if not started:
                record.status = err.status
                await send(
                    {
                        "type": "http.response.start",
                        "status": err.status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (_REQUEST_ID, record.request_id.encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": self.errors.body(err)})
            elif not ended:
                tail = self.errors.event(err) if started[0] else b""
                await send({"type": "http.response.body", "body": tail})
        except OSError:
            pass  # the client is gone too: nothing left to tell it
