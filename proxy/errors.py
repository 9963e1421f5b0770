"""The proxy's own errors, and the one place that renders them.

    RecapError                    status, OpenAI error type, code
    ├── BadRequest        400     invalid_request_error (e.g. a malformed conversation key)
    ├── Unauthorized      401     invalid_request_error / invalid_api_key
    ├── NotFound          404     invalid_request_error / not_found
    ├── Conflict          409     invalid_request_error / nothing_to_compact, ...
    ├── PayloadTooLarge   413     invalid_request_error / request_too_large
    ├── CompactionFailed  502     upstream_error / compaction_failed (manual compaction)
    ├── UpstreamUnreachable 502   upstream_error / upstream_unreachable
    └── UpstreamTimeout   504     upstream_error / upstream_timeout

Upstream errors are never wrapped: their status and body pass through untouched.
Foreign exceptions (httpx) are translated in `upstream.py`; this module knows no IO.
"""

from __future__ import annotations

import json
from typing import ClassVar


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


class Unauthorized(RecapError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(RecapError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


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
