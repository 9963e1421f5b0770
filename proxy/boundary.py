"""The app's error boundary: every error a client sees is in the OpenAI error shape.

Sits between the access log and the routes (see `app.create_app`):

    AccessLog -> ErrorBoundary -> Starlette's exception handlers -> routes

- `exception_handlers`: RecapError (the proxy's own), StoreError (a store that is
  down: 503) and Starlette's HTTPException (routing: 404, 405) raised by a route,
  each rendered by `errors.error_json`, the one renderer of the shape.
- `ErrorBoundary`: anything else that escapes a handler is a bug. It is logged once
  with its traceback and the request id, and answered as a 500 in the same shape; if
  the response had already started, a stream gets a final error event and ends (a
  client never waits on a response that will not finish). Nothing is re-raised, so
  the server does not log it a second time or drop the connection.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import (
    InternalError,
    MethodNotAllowed,
    NotFound,
    RecapError,
    StoreUnavailable,
    error_body,
    error_json,
    sse_error_event,
)
from proxy.logs import log_fields
from proxy.relay import Message, Receive, Scope, Send
from proxy.store.base import StoreError

log = logging.getLogger("recap.error")


def render(err: RecapError, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        error_json(err), status_code=err.status, media_type="application/json", headers=headers
    )


def _noted(request: Request, err: RecapError) -> RecapError:
    log_fields(request.scope)["error"] = err.code  # type: ignore[arg-type]  # the ASGI scope
    return err


async def recap_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RecapError)
    return render(_noted(request, exc))


async def store_error(request: Request, exc: Exception) -> Response:
    return render(_noted(request, StoreUnavailable(f"The store is unavailable: {exc}")))


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err: RecapError
    if exc.status_code == 404:
        err = NotFound(f"Unknown path {request.url.path}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}")
    else:  # not raised by Starlette's routing today; still in the shape
        body = error_body(exc.detail, "invalid_request_error")
        return Response(
            json.dumps(body).encode(),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers,
        )
    return render(_noted(request, err), exc.headers)


EXCEPTION_HANDLERS = {
    RecapError: recap_error,
    StoreError: store_error,
    HTTPException: http_error,
}


def describe(exc: BaseException) -> str:
    """`Type: message (at file:line in function)`: the one line an operator greps for.

    In the message itself, since a log line is one line (the formatters drop tracebacks).
    """
    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return text
    last = frames[-1]
    return f"{text} (at {Path(last.filename).name}:{last.lineno} in {last.name})"


class ErrorBoundary:
    """Pure ASGI, so it sees whether (and how) the response started."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started: list[bool] = []  # [is_sse] once the status line is out
        ended = False

        async def watching(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                started.append(ctype.startswith(b"text/event-stream"))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, watching)
        except Exception as exc:
            # The top of a request: the one place a broad except belongs (a bug must not
            # leave the client waiting or the connection dropped without an answer).
            fields = log_fields(scope)
            fields["error"] = InternalError.code
            log.error(
                "unexpected error on %s %s: %s",
                scope.get("method"),
                scope.get("path"),
                describe(exc),
                exc_info=exc,
                extra={"request_id": fields.get("request_id")},
            )
            err = InternalError("The proxy failed on this request; see its log (request id).")
            try:
                if not started:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": err.status,
                            "headers": [(b"content-type", b"application/json")],
                        }
                    )
                    await send({"type": "http.response.body", "body": error_json(err)})
                elif not ended:
                    tail = sse_error_event(err) if started[0] else b""
                    await send({"type": "http.response.body", "body": tail})
            except OSError:
                pass  # the client is gone too: nothing left to tell it
