"""The app's error boundary: every error a client sees is in its API's error shape.

Sits between the edge and the routes (see `app.create_app`):

    Edge (request id, access line, metrics, the last resort) -> Starlette's exception
    handlers -> routes

- `exception_handlers`: RecapError (the proxy's own), StoreError (a store that is
  down: 503) and Starlette's HTTPException (routing: 404, 405) raised by a route,
  each rendered in OpenAI's shape (`errors.OPENAI_ERRORS`): the operator routes, the page
  and the pass-through are OpenAI-shaped.
- `Rendered`: the same for a route served outside Starlette's stack, in the shape of the
  route's own API (`Dialect.errors`).
- `front.Edge`: anything else that escapes a handler is a bug, logged once (`describe`)
  and answered as a 500 in the same shape.
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

from proxy.edge.relay import Receive, Scope, Send
from proxy.errors import (
    OPENAI_ERRORS,
    ErrorShape,
    MethodNotAllowed,
    NotFound,
    RecapError,
    StoreUnavailable,
    error_body,
)
from proxy.record import record_of
from proxy.store.base import StoreError

log = logging.getLogger("recap.error")


def render(
    err: RecapError,
    headers: Mapping[str, str] | None = None,
    errors: ErrorShape = OPENAI_ERRORS,
) -> Response:
    return Response(
        errors.body(err), status_code=err.status, media_type="application/json", headers=headers
    )


def _noted(request: Request, err: RecapError) -> RecapError:
    record_of(request.scope).error = err.code
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


class Rendered:
    """`app` with the errors it raises on purpose (RecapError, StoreError) rendered as
    `EXCEPTION_HANDLERS` render them, in `errors`' shape: for a route served outside
    Starlette's stack (`app.RecapApp`). One that escapes after the response started goes
    on to the edge."""

    def __init__(self, app: Any, errors: ErrorShape = OPENAI_ERRORS) -> None:
        self.app = app
        self.errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except RecapError as exc:
            await self._answer(exc, scope, receive, send)
        except StoreError as exc:
            await self._answer(
                StoreUnavailable(f"The store is unavailable: {exc}"), scope, receive, send
            )

    async def _answer(self, err: RecapError, scope: Scope, receive: Receive, send: Send) -> None:
        record_of(scope).error = err.code
        await render(err, errors=self.errors)(scope, receive, send)  # type: ignore[arg-type]  # the ASGI callables
