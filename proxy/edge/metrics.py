"""Prometheus metrics: fed from each request's record, served at `GET /metrics`.

The front (`front.Edge`) observes every request when it ends, so its record
(`proxy/record.py`) is complete: status, classification, overhead, and the typed
outcomes the stages reported (layer, action, trigger, summarizer tokens, ...). One
`Metrics` per app, with its own CollectorRegistry: nothing registers globally, so
tests build as many apps as they like.

Labels are low-cardinality by construction: a route name (not the path), the HTTP
status, the classification, a layer, an outcome, an error code. Never a conversation or
a key; a tenant only on the prompt-cache token counters and the holdout series (configured
names, a bounded set). `/healthz`, `/readyz` and `/metrics` are not counted.

The holdout series (`recap_holdout_*`) are not counted per request: a scrape sets them from
the holdout report of each tenant that runs a holdout (`archive.holdout.holdout_report`,
over the last 7 days, the default of `recap report` and the page), recomputed at most every
HOLDOUT_REFRESH_S, so they show what the report shows: each cohort's size, each measure's
mean per cohort (`measure` is one of a fixed list), and the difference's Welch interval.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from proxy.archive.holdout import DEFAULT_SINCE, HoldoutReport, holdout_report, parse_since
from proxy.planning.outcome import Layer
from proxy.record import RequestRecord
from proxy.stages.ahead import AheadCounts
from proxy.state import AppState
from proxy.store.base import StoreError

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "compactions_of", "route_of"]

# Overhead is milliseconds without compaction, up to the summarizer timeout with it.
_OVERHEAD_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60, 120),
)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_SUMMARIZER_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
# The holdout series are computed from the archive at a scrape, at most this often.
HOLDOUT_REFRESH_S = 300.0


def route_of(record: RequestRecord) -> str:
    """The route's label: its own name (a compacting route's dialect), else by path."""
    if record.route is not None:
        return record.route
    path = record.path
    if path == "/v1/recap" or path.startswith("/v1/recap/"):
        return "operator"
    if path.startswith("/v1/"):
        return "passthrough"
    return "other"


def compactions_of(record: RequestRecord) -> list[tuple[str, str]]:
    """(layer, outcome) of every compaction attempt one request recorded, from its typed
    outcomes; an applied stored summary or a skip is no attempt."""
    out: list[tuple[str, str]] = []
    for o in record.outcomes:
        if o.action not in ("compacted", "failed", "dropped"):
            continue
        layer = o.layer
        if o.layer == Layer.SESSION and o.trigger == "forced":
            layer = Layer.MANUAL  # a forced compaction (x-recap-compaction: force) is audited so
        outcome = {"failed": "failed", "dropped": "dropped"}.get(o.action, "ok")
        out.append((str(layer), outcome))
    if record.manual is not None:  # the operator's compact route
        out.append((Layer.MANUAL.value, record.manual.status))
    return out


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

        # -- cache (prompt-cache reporting) --
        # By tenant: tenant names come from the configuration (a bounded set), never from
        # a request, so the label stays low-cardinality.
        self.upstream_reported_input = Counter(
            "recap_upstream_reported_input_tokens",
            "Input tokens of the forwarded requests, as the upstream's usage reported them.",
            ["tenant", "route"],
            registry=r,
        )
        self.cached_input = Counter(
            "recap_upstream_cached_input_tokens",
            "Of those, the input tokens the upstream's prompt cache served (cache reads).",
            ["tenant", "route"],
            registry=r,
        )
        # -- end cache --

        # -- background pre-compaction (stages/ahead.py) --
        self._ahead = _AheadCollector()
        r.register(self._ahead)

        # -- holdout --
        self.holdout_conversations = Gauge(
            "recap_holdout_conversations",
            "Conversations of each holdout cohort in the report's period (the last 7 days).",
            ["tenant", "cohort"],
            registry=r,
        )
        self.holdout_requests = Gauge(
            "recap_holdout_requests",
            "Requests of each holdout cohort in the report's period.",
            ["tenant", "cohort"],
            registry=r,
        )
        self.holdout_mean = Gauge(
            "recap_holdout_mean",
            "A holdout measure's mean per conversation in each cohort (docs/holdout.md).",
            ["tenant", "cohort", "measure"],
            registry=r,
        )
        self.holdout_difference = Gauge(
            "recap_holdout_difference",
            "Compacted minus holdout mean of a measure, and its Welch 95% interval (bound "
            "low, estimate, high); an interval holding 0 is noise.",
            ["tenant", "measure", "bound"],
            registry=r,
        )
        self._holdout_at: float | None = None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def show_ahead(self, counts: AheadCounts) -> None:
        """Background pre-compaction's jobs (stages/ahead.py), read at a scrape: the counts
        only grow, so they are counters, set from the app's own tally."""
        self._ahead.counts = counts

    async def refresh_holdout(self, state: AppState, now: float) -> None:
        """Set the holdout series from the archive, unless they were set less than
        HOLDOUT_REFRESH_S ago; a store that fails leaves them as they were."""
        tenants = [t for t in state.config.tenants.values() if t.holdout > 0]
        if not tenants:
            return
        if self._holdout_at is not None and now - self._holdout_at < HOLDOUT_REFRESH_S:
            return
        await state.archiver.flush()
        since = parse_since(DEFAULT_SINCE, now)
        try:
            reports = [
                await holdout_report(
                    state.store,
                    t.name,
                    since=since,
                    until=now,
                    prices=t.prices,
                    holdout=t.holdout,
                )
                for t in tenants
            ]
        except StoreError:
            return
        self._holdout_at = now
        for report in reports:
            self.show_holdout(report)

    def show_holdout(self, report: HoldoutReport) -> None:
        tenant, c = report.tenant, report.comparison
        for group, counts in c.counts.items():
            self.holdout_conversations.labels(tenant, group.value).set(counts.conversations)
            self.holdout_requests.labels(tenant, group.value).set(counts.requests)
        for row in c.rows:
            key = row.measure.key
            for cohort, summary in (("compacted", row.compacted), ("holdout", row.holdout)):
                if summary.mean is not None:
                    self.holdout_mean.labels(tenant, cohort, key).set(summary.mean)
                else:
                    with contextlib.suppress(KeyError):
                        self.holdout_mean.remove(tenant, cohort, key)
            i = row.interval
            for bound, value in (
                ("low", i.low if i else None),
                ("estimate", i.difference if i else None),
                ("high", i.high if i else None),
            ):
                if value is not None:
                    self.holdout_difference.labels(tenant, key, bound).set(value)
                else:
                    with contextlib.suppress(KeyError):
                        self.holdout_difference.remove(tenant, key, bound)

    def observe(self, record: RequestRecord) -> None:
        """Count one finished request from its record."""
        route = route_of(record)
        status = str(record.status or 500)
        self.requests.labels(route, status, record.classification or "none").inc()
        if record.total_ms is not None:
            self.duration.labels(route).observe(record.total_ms / 1000)
        if record.overhead_ms is not None:
            self.overhead.labels(route).observe(record.overhead_ms / 1000)
        for layer, outcome in compactions_of(record):
            self.compactions.labels(layer, outcome).inc()
        before, after = record.tokens_before, record.input_tokens
        if after is not None:
            self.input_tokens.inc(after)
            if before is not None and before > after:
                self.tokens_saved.inc(before - after)
        tokens_in = sum(o.summarizer_tokens_in for o in record.outcomes)
        tokens_out = sum(o.summarizer_tokens_out for o in record.outcomes)
        for direction, tokens in (("input", tokens_in), ("output", tokens_out)):
            if tokens:
                self.summarizer_tokens.labels(direction).inc(tokens)
        for o in record.outcomes:
            if o.layer in (Layer.SESSION, Layer.LOOP) and o.duration_ms is not None:
                forced = o.layer == Layer.SESSION and o.trigger == "forced"
                layer = Layer.MANUAL if forced else o.layer
                self.summarizer_duration.labels(str(layer)).observe(o.duration_ms / 1000)
        if record.manual is not None:
            self.summarizer_duration.labels(Layer.MANUAL.value).observe(record.manual.ms / 1000)
        if record.error:
            self.errors.labels(record.error).inc()
        for entry in record.stage_errors:
            self.stage_errors.labels(entry.split(":", 1)[0]).inc()
        if record.upstream_input_tokens is not None:  # -- cache --
            labels = (record.tenant or "", route)
            self.upstream_reported_input.labels(*labels).inc(record.upstream_input_tokens)
            self.cached_input.labels(*labels).inc(record.cached_input_tokens or 0)
        if record.remote is not None:
            reused = record.remote.reused
            self.remote_compactions.labels(
                record.remote.action, "" if reused is None else str(bool(reused)).lower()
            ).inc()


class _AheadCollector(Collector):
    """`recap_background_compactions_total` by outcome, from the app's AheadCounts."""

    OUTCOMES = ("started", "stored", "failed", "cancelled", "busy")

    def __init__(self) -> None:
        self.counts = AheadCounts()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "recap_background_compactions",
            "Background pre-compaction jobs: started, stored a summary, failed, cancelled"
            " (the conversation moved on), skipped because the tenant's bound was reached.",
            labels=["outcome"],
        )
        for outcome in self.OUTCOMES:
            family.add_metric([outcome], getattr(self.counts, outcome))
        yield family
