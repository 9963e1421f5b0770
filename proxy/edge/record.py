"""The request's log fields: written by the routes and stages, read by the front.

Handlers add fields to `scope["state"]["log"]` (`log_fields`); the front
(`proxy/edge/front.py`) adds status, timings and the request id, then writes one line
to `access_log`, which `proxy/ops/logs.py` formats. Never log keys or message content:
only what the handlers and stages record (ids, counts, timings, reasons).
"""

from __future__ import annotations

import logging
from typing import Any

from proxy.edge.relay import Scope

access_log = logging.getLogger("recap.access")

QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def log_fields(scope: Scope) -> dict[str, Any]:
    """The mutable log fields of this request (set up by the front, `front.py`)."""
    state = scope.setdefault("state", {})
    fields: dict[str, Any] = state.setdefault("log", {})
    return fields
