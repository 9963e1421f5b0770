"""The proxy's own errors, and the one place that renders them.

    RecapError                    status, OpenAI error type, code
    ├── BadRequest        400     invalid_request_error (e.g. a malformed conversation key)
    ├── Unauthorized      401     invalid_request_error / invalid_api_key
    ├── NotFound          404     invalid_request_error / not_found
    ├── MethodNotAllowed  405     invalid_request_error / method_not_allowed
    ├── Conflict          409     invalid_request_error / nothing_to_compact, ...
    ├── PayloadTooLarge   413     invalid_request_error / request_too_large
    ├── InternalError     500     server_error / internal_error (anything unexpected)
    ├── CompactionFailed  502     upstream_error / compaction_failed (manual compaction)
    ├── UpstreamUnreachable 502   upstream_error / upstream_unreachable
    ├── UpstreamBadResponse 502   upstream_error / upstream_bad_response
    ├── StoreUnavailable  503     server_error / store_unavailable (operator routes)
    └── UpstreamTimeout   504     upstream_error / upstream_timeout

Upstream errors are never wrapped: their status and body pass through untouched. Each API
writes Recap's own errors in its own shape (`ErrorShape`, one per dialect:
`Dialect.errors`): OpenAI's is `OPENAI_ERRORS`, the default of every route. Foreign
exceptions are translated at one boundary each: httpx in `upstream.mapped_errors`, the
store's in `store.base`, Starlette's routing errors and anything unexpected in
`proxy/edge/boundary.py`. This module knows no IO; `error_json` is the one renderer of
OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import ClassVar, Protocol


class RecapError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.message, self.type, self.code, self.param)


class BadRequest(RecapError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class RequestTimeout(RecapError):
    """The request's body came too slowly (proxy/edge/serving.py's body deadline)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Unauthorized(RecapError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(RecapError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(RecapError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(RecapError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(RecapError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UpstreamUnreachable(RecapError):
    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamBadResponse(RecapError):
    status = 502
    type = "upstream_error"
    code = "upstream_bad_response"


class InternalError(RecapError):
    status = 500
    type = "server_error"
    code = "internal_error"


class StoreUnavailable(RecapError):
    status = 503
    type = "server_error"
    code = "store_unavailable"


class CompactionFailed(RecapError):
    status = 502
    type = "upstream_error"
    code = "compaction_failed"


class UpstreamTimeout(RecapError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(err: RecapError) -> bytes:
    return json.dumps(err.body()).encode()


def sse_error_event(err: RecapError) -> bytes:
    """The final event of a stream that broke after it started (headers already sent)."""
    return b"data: " + error_json(err) + b"\n\n"


class ErrorShape(Protocol):
    """How one API writes Recap's own errors: the body of an error answer, and the final
    event of a stream that broke after it started (its headers already sent)."""

    def body(self, err: RecapError) -> bytes: ...

    def event(self, err: RecapError) -> bytes: ...


class OpenAIErrors:
    """`{"error": {"message", "type", "param", "code"}}`, as a body and as `data:`."""

    def body(self, err: RecapError) -> bytes:
        return error_json(err)

    def event(self, err: RecapError) -> bytes:
        return sse_error_event(err)


OPENAI_ERRORS: ErrorShape = OpenAIErrors()
