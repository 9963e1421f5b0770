"""The skeleton every route class shares: one request's context, and its errors, once.

    Route.__call__(scope, receive, send)
        call = Call(...)              the app's state, the request's record, headers,
                                      a responder in the route's error shape
        await self.handle(call)       the route's own steps (parse, plan, forward, relay,
                                      finish for a compacting route: compacting.py)
        RecapError        -> answered in the route's API's shape (a body, or the final
                             event of a stream that started), its code on the record
        ClientDisconnected -> noted on the record; nothing is left to answer

Anything else is a bug and goes on to the front (`front.Edge`), which logs it once and
answers a 500 in the same shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from proxy.edge.relay import ClientDisconnected, Receive, Responder, Scope, Send, header_map
from proxy.errors import OPENAI_ERRORS, ErrorShape, RecapError
from proxy.record import RequestRecord, record_of
from proxy.state import AppState


@dataclass
class Call:
    """One request at a route."""

    scope: Scope
    receive: Receive
    send: Send
    state: AppState
    record: RequestRecord
    headers: dict[str, str]
    responder: Responder
    # When the route began (perf_counter): the overhead is measured from here.
    start: float = field(default_factory=time.perf_counter)


class Route:
    """An ASGI app for one route; subclasses write `handle` and may set `errors`."""

    # The shape of Recap's own errors on this route (a compacting route: its dialect's).
    errors: ErrorShape = OPENAI_ERRORS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        call = Call(
            scope,
            receive,
            send,
            scope["state"]["recap"],
            record_of(scope),
            header_map(scope),
            Responder(send, [], self.errors),
            start,
        )
        try:
            await self.handle(call)
        except RecapError as err:
            call.record.error = err.code
            await call.responder.error(err)
        except ClientDisconnected:
            call.record.client_disconnected = True

    async def handle(self, call: Call) -> None:
        raise NotImplementedError
