"""Prometheus metrics: fed from each request's log fields, served at `GET /metrics`.

Sits around the whole app as a pure-ASGI middleware (outside the access log), so
when a request ends its log fields are complete: status, classification, overhead,
and whatever the stages recorded (session_trigger, loop_failure, trimmed_results,
summarizer tokens, ...). One `Metrics` per app, with its own CollectorRegistry:
nothing registers globally, so tests build as many apps as they like.

Labels are low-cardinality by construction: a route name (not the path), the HTTP
status, the classification, a layer, an outcome, an error code. Never a tenant,
a conversation or a key. `/healthz`, `/readyz` and `/metrics` are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "compactions_of", "route_of"]

# Overhead is milliseconds without compaction, up to the summarizer timeout with it.
_OVERHEAD_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60, 120),
)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_SUMMARIZER_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)


def route_of(path: str) -> str:
    if path == "/v1/chat/completions":
        return "chat"
    if path == "/v1/responses":
        return "responses"
    if path == "/v1/recap" or path.startswith("/v1/recap/"):
        return "operator"
    if path.startswith("/v1/"):
        return "passthrough"
    return "other"


def compactions_of(fields: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(layer, outcome) of every compaction attempt one request recorded.

    Read from the request's typed outcomes (`compactions` in the log fields, see
    proxy/planning/outcome.py); an applied stored summary or a skip is no attempt.
    """
    out: list[tuple[str, str]] = []
    for o in _outcomes(fields):
        if o.get("action") not in ("compacted", "failed"):
            continue
        layer = str(o.get("layer"))
        if layer == "session" and o.get("trigger") == "forced":
            layer = "manual"  # a forced compaction (x-recap-compaction: force) is audited so
        out.append((layer, "failed" if o.get("action") == "failed" else "ok"))
    manual = fields.get("manual_compaction")  # the operator's compact route
    if manual:
        out.append(("manual", str(manual)))
    return out


def _outcomes(fields: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = fields.get("compactions")
    return [o for o in found if isinstance(o, Mapping)] if isinstance(found, list) else []


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "recap_requests",
            "Requests by route, HTTP status and classification (chat only).",
            ["route", "status", "classification"],
            registry=r,
        )
        self.in_flight = Gauge(
            "recap_requests_in_flight", "Requests being served right now.", registry=r
        )
        self.duration = Histogram(
            "recap_request_duration_seconds",
            "Whole request time, to the end of the response stream.",
            ["route"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "recap_overhead_seconds",
            "Time spent in the proxy before the upstream call (compaction included).",
            ["route"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.compactions = Counter(
            "recap_compactions",
            "Compaction attempts by layer and outcome.",
            ["layer", "outcome"],
            registry=r,
        )
        self.tokens_saved = Counter(
            "recap_tokens_saved",
            "Estimated input tokens not sent upstream thanks to compaction (all layers).",
            registry=r,
        )
        self.input_tokens = Counter(
            "recap_upstream_input_tokens",
            "Estimated input tokens of the chat requests sent upstream.",
            registry=r,
        )
        self.summarizer_tokens = Counter(
            "recap_summarizer_tokens",
            "Tokens of the summarizer calls, as the upstream reported them.",
            ["direction"],
            registry=r,
        )
        self.summarizer_duration = Histogram(
            "recap_summarizer_duration_seconds",
            "Time spent summarising in one request (all batches).",
            ["layer"],
            buckets=_SUMMARIZER_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "recap_proxy_errors", "The proxy's own error responses, by code.", ["code"], registry=r
        )
        self.stage_errors = Counter(
            "recap_stage_errors", "Stages that raised and were skipped.", ["stage"], registry=r
        )
        self.remote_compactions = Counter(
            "recap_remote_compactions",
            "Codex remote compaction answered by Recap, by action (compact, trigger, expanded)"
            " and whether a stored summary was reused.",
            ["action", "reused"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, path: str, fields: Mapping[str, Any]) -> None:
        """Count one finished request from its log fields."""
        route = route_of(path)
        status = str(fields.get("status") or 500)
        self.requests.labels(route, status, str(fields.get("classification") or "none")).inc()
        if (total := _number(fields.get("total_ms"))) is not None:
            self.duration.labels(route).observe(total / 1000)
        if (overhead := _number(fields.get("overhead_ms"))) is not None:
            self.overhead.labels(route).observe(overhead / 1000)
        for layer, outcome in compactions_of(fields):
            self.compactions.labels(layer, outcome).inc()
        before, after = _number(fields.get("tokens_before")), _number(fields.get("input_tokens"))
        if after is not None:
            self.input_tokens.inc(after)
            if before is not None and before > after:
                self.tokens_saved.inc(before - after)
        for direction, key in (
            ("input", "summarizer_tokens_in"),
            ("output", "summarizer_tokens_out"),
        ):
            if tokens := _number(fields.get(key)):
                self.summarizer_tokens.labels(direction).inc(tokens)
        for o in _outcomes(fields):
            ms = _number(o.get("duration_ms"))
            if o.get("layer") in ("session", "loop") and ms is not None:
                forced = o.get("layer") == "session" and o.get("trigger") == "forced"
                layer = "manual" if forced else str(o.get("layer"))
                self.summarizer_duration.labels(layer).observe(ms / 1000)
        if (ms := _number(fields.get("manual_compaction_ms"))) is not None:
            self.summarizer_duration.labels("manual").observe(ms / 1000)
        if code := fields.get("error"):
            self.errors.labels(str(code)).inc()
        for entry in fields.get("stage_errors") or ():
            self.stage_errors.labels(str(entry).split(":", 1)[0]).inc()
        if action := fields.get("remote_compaction"):
            reused = fields.get("remote_compaction_reused")
            self.remote_compactions.labels(
                str(action), "" if reused is None else str(bool(reused)).lower()
            ).inc()
