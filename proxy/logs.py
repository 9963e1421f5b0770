"""Logging: one line per request on stderr, JSON or text, plus the access-log middleware.

The middleware is pure ASGI (Starlette's BaseHTTPMiddleware would hide client
disconnects from the handlers). Handlers add fields to `scope["state"]["log"]`;
the middleware adds status, timings and the request id, then writes one line.
Never log keys or message content: only the fields named in `ACCESS_FIELDS` and
the handlers' counters.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from typing import Any, Literal, TextIO

from proxy.relay import Message, Receive, Scope, Send

access_log = logging.getLogger("recap.access")

QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

# Order of the fields in text lines (anything else follows, sorted).
ACCESS_FIELDS = (
    "request_id",
    "method",
    "path",
    "status",
    "tenant",
    "conversation",
    "classification",
    "messages",
    "input_tokens",
    "upstream_status",
    "ttfb_ms",
    "total_ms",
    "overhead_ms",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        else:
            out["msg"] = record.getMessage()
            rid = getattr(record, "request_id", None)
            if rid:
                out["request_id"] = rid
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", None)
        if fields:
            return f"{stamp} {record.levelname.lower():5} {format_fields(fields)}"
        rid = getattr(record, "request_id", None)
        suffix = f" request_id={rid}" if rid else ""
        return f"{stamp} {record.levelname.lower():5} {record.name}: {record.getMessage()}{suffix}"


def format_fields(fields: dict[str, Any]) -> str:
    keys = [k for k in ACCESS_FIELDS if k in fields] + sorted(
        k for k in fields if k not in ACCESS_FIELDS
    )
    return " ".join(f"{k}={_text(fields[k])}" for k in keys if fields[k] is not None)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    s = str(value)
    return json.dumps(s) if (" " in s or s == "") else s


def configure_logging(
    fmt: Literal["json", "text"] | None = None, level: str = "INFO", stream: TextIO | None = None
) -> None:
    """JSON when not on a terminal (containers), text on a terminal, unless told."""
    stream = stream or sys.stderr
    if fmt is None:
        fmt = "text" if stream.isatty() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("recap")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def log_fields(scope: Scope) -> dict[str, Any]:
    """The mutable log fields of this request (set up by AccessLog)."""
    state = scope.setdefault("state", {})
    fields: dict[str, Any] = state.setdefault("log", {})
    return fields


class AccessLog:
    """Assigns the request id, sets `x-recap-request-id`, and writes the access line."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = uuid.uuid4().hex[:16]
        fields = log_fields(scope)
        fields.update(request_id=request_id, method=scope["method"], path=scope["path"])
        first_byte: list[float] = []

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                fields["status"] = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-recap-request-id", request_id.encode()),
                ]
            elif message["type"] == "http.response.body" and not first_byte and message.get("body"):
                first_byte.append(time.perf_counter())
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if scope["path"] not in QUIET_PATHS:
                end = time.perf_counter()
                if first_byte:
                    # Unless the handler knows better (a compacting stream's first
                    # bytes are progress comments, not the model's).
                    fields.setdefault("ttfb_ms", round((first_byte[0] - start) * 1000, 1))
                fields["total_ms"] = round((end - start) * 1000, 1)
                access_log.info("request", extra={"fields": fields})
