"""Logging: one line per request on stderr, JSON or text.

The request's record is gathered on the HTTP side (`proxy/record.py`, pure ASGI:
Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers) and
written to `recap.access` by the front; this module formats them. JSON lines carry ISO-8601
timestamps and leave out fields without a value; text lines are rendered by
`tail.render`, as `recap tail` prints them. The server's lifecycle lines (started,
stopping, stopped) are in `proxy/ops/lifecycle.py`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from proxy.ops.ansi import Style
from proxy.ops.tail import Days, render


def iso_time(created: float) -> str:
    """ISO-8601 in UTC with milliseconds: what log stores parse and people read."""
    stamp = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def as_record(record: logging.LogRecord) -> dict[str, Any]:
    """One log record as the JSON object it is written as. Fields without a value
    (None) are left out, so a line carries only what happened."""
    out: dict[str, Any] = {
        "ts": iso_time(record.created),
        "level": record.levelname.lower(),
        "logger": record.name,
    }
    fields = getattr(record, "fields", None)
    if fields:
        out.update((k, v) for k, v in fields.items() if v is not None)
    else:
        out["msg"] = record.getMessage()
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(as_record(record), ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """The lines `recap tail` prints, straight from the server (on a terminal)."""

    def __init__(self, colour: bool = False) -> None:
        super().__init__()
        self.style = Style(colour)
        self.days = Days()  # this handler's own: the date and zone before the first line

    def format(self, record: logging.LogRecord) -> str:
        fields = as_record(record)
        day = self.days.mark(fields)
        line = render(fields, self.style)
        return line if day is None else f"{self.style.dim(day)}\n{line}"


def wants_colour(stream: TextIO) -> bool:
    """Colours only on a terminal, and never with NO_COLOR set (no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def configure_logging(
    fmt: Literal["json", "text"] | None = None, level: str = "INFO", stream: TextIO | None = None
) -> None:
    """JSON when not on a terminal (containers), text on a terminal, unless told."""
    stream = stream or sys.stderr
    if fmt is None:
        fmt = "text" if stream.isatty() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else TextFormatter(colour=wants_colour(stream))
    )
    root = logging.getLogger("recap")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # uvicorn's own errors (a port in use, a failed start) in the same format; its info
    # lines ("Uvicorn running on ...") are replaced by the start-up line.
    server = logging.getLogger("uvicorn.error")
    server.handlers[:] = [handler]
    server.setLevel(logging.WARNING)
    server.propagate = False
