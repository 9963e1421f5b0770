"""The holdout report: a tenant's two cohorts compared on what its archive recorded.

Off the data path: read by `recap report` (proxy/ops/report.py), the web page's report
(proxy/web/holdout.py) and the `/metrics` holdout series (proxy/edge/metrics.py), the three
through `holdout_report`, so they show the same numbers. This module reads the store (the
conversations updated since the start of the period, their request and response events,
the new user message of each turn); the measures and the comparison are pure
(`proxy/planning/measures.py`, `proxy/planning/compare.py`). docs/holdout.md says what each
measure can and cannot tell.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy.config import Prices
from proxy.dialects.base import cache_usage
from proxy.errors import BadRequest
from proxy.planning.cohort import Cohort
from proxy.planning.compare import Comparison, compare
from proxy.planning.measures import (
    Answer,
    ArchivedRequest,
    ConversationMeasures,
    error_kind,
    finish_of,
    measure,
    tool_call,
)
from proxy.planning.transcript import content_text
from proxy.store.base import ConversationRef, Event, ListPosition, Store

# The period a report covers when none is named: the last 7 days.
DEFAULT_SINCE = "7d"
_PAGE = 500
_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float) -> float:
    """The start of a report's period: an age (`90m`, `24h`, `7d`) or a UTC date or time
    (`2026-12-01`, `2026-12-01T08:00`), as epoch seconds."""
    text = text.strip()
    ago = _AGO.match(text)
    if ago:
        return now - float(ago.group(1)) * _UNIT_S[ago.group(2)]
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise BadRequest(
            f"since must be an age such as 7d, 24h or 90m, or a date such as 2026-12-01; "
            f"got {text!r}",
            "since",
        ) from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


@dataclass(frozen=True)
class HoldoutReport:
    tenant: str
    holdout: float  # the share configured now
    since: float
    until: float
    priced: bool
    comparison: Comparison

    def as_json(self) -> dict[str, Any]:
        c = self.comparison
        return {
            "object": "recap.holdout_report",
            "tenant": self.tenant,
            "holdout": self.holdout,
            "since": self.since,
            "until": self.until,
            "interval": "welch_95",
            "mixed_conversations": c.mixed,
            "cohorts": {
                cohort.value: {
                    "conversations": n.conversations,
                    "requests": n.requests,
                    "finish_reasons": {str(k): v for k, v in sorted(n.finishes.items())},
                    "errors": {str(k): v for k, v in sorted(n.errors.items())},
                }
                for cohort, n in c.counts.items()
            },
            "measures": [
                {
                    "measure": row.measure.key,
                    "label": row.measure.label,
                    "unit": row.measure.unit,
                    **{
                        cohort: {"n": s.n, "mean": s.mean}
                        for cohort, s in (("compacted", row.compacted), ("holdout", row.holdout))
                    },
                    "difference": row.interval.difference if row.interval else None,
                    "low": row.interval.low if row.interval else None,
                    "high": row.interval.high if row.interval else None,
                    "noise": row.interval.noise if row.interval else None,
                }
                for row in c.rows
            ],
        }


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _output_tokens(usage: Any) -> int | None:
    if not isinstance(usage, Mapping):
        return None
    return _int(usage.get("completion_tokens")) or _int(usage.get("output_tokens"))


def read_answer(payload: Mapping[str, Any]) -> Answer:
    """A `response` event's payload, read (any of the three APIs' recorders wrote it)."""
    status = _int(payload.get("status"))
    error = error_kind(status, payload.get("error"))
    message = payload.get("message")
    calls = []
    if isinstance(message, Mapping):
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                calls.append(tool_call(str(function.get("name") or ""), function.get("arguments")))
    usage = payload.get("usage")
    cache = cache_usage(usage)
    overhead = payload.get("overhead_ms")
    return Answer(
        status=status,
        error=error,
        finish=finish_of(payload.get("finish_reason"), calls, error),
        tool_calls=tuple(calls),
        input_tokens=cache.input_tokens if cache else None,
        cached_tokens=cache.cached_tokens if cache else None,
        output_tokens=_output_tokens(usage),
        overhead_ms=float(overhead) if isinstance(overhead, int | float) else None,
    )


def _cohort(value: Any) -> Cohort | None:
    try:
        return Cohort(value)
    except ValueError:
        return None


async def read_requests(
    store: Store, conv: ConversationRef, since: float, until: float
) -> list[ArchivedRequest]:
    """The conversation's requests archived in the period, in order, with their answers and
    each turn's new user message."""
    requests: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[Answer]] = {}
    async for event in store.events(conv):
        if not since <= event.created_at <= until:
            continue
        _take(event, requests, answers)
    last = {rid: r["last"] for rid, r in requests.items() if r["last"] is not None}
    bodies = await store.archived_messages(conv, sorted(set(last.values()))) if last else {}
    out = []
    for rid, r in requests.items():
        text = None
        if rid in last and last[rid] in bodies:
            message = json.loads(bodies[last[rid]])
            if isinstance(message, Mapping) and message.get("role") == "user":
                text = content_text(message.get("content"))
        out.append(
            ArchivedRequest(
                request_id=rid,
                at=r["at"],
                classification=r["classification"],
                cohort=r["cohort"],
                user_text=text,
                answers=tuple(answers.get(rid, ())),
                summarizer_input_tokens=r["summarizer"][0],
                summarizer_output_tokens=r["summarizer"][1],
            )
        )
    return out


def _take(
    event: Event, requests: dict[str, dict[str, Any]], answers: dict[str, list[Answer]]
) -> None:
    payload = event.payload
    rid = str(payload.get("request_id") or f"event-{event.id}")
    if event.type == "request":
        spent = [_int(payload.get(f"summarizer_{d}_tokens")) or 0 for d in ("input", "output")]
        if rid in requests:
            # An overflow's retry is a second request event of the same id: one request.
            requests[rid]["summarizer"] = [
                a + b for a, b in zip(requests[rid]["summarizer"], spent, strict=True)
            ]
            return
        classification = str(payload.get("classification") or "other")
        messages = payload.get("messages") or []
        turn = classification == "turn_start" and messages
        requests[rid] = {
            "at": event.created_at,
            "classification": classification,
            "cohort": _cohort(payload.get("cohort")),
            "last": messages[-1] if turn else None,
            "summarizer": spent,
        }
    elif event.type == "response" and rid in requests:
        answers.setdefault(rid, []).append(read_answer(payload))


async def conversations_since(store: Store, tenant: str, since: float) -> list[ConversationRef]:
    """The tenant's conversations updated since `since` (the listing is newest first)."""
    out: list[ConversationRef] = []
    after: ListPosition | None = None
    while True:
        page = await store.list_conversations(tenant, _PAGE, after=after)
        for info in page:
            if info.updated_at < since:
                return out
            out.append(ConversationRef(info.tenant, info.key))
        if len(page) < _PAGE:
            return out
        last = page[-1]
        after = ListPosition(last.updated_at, last.tenant, last.key)


async def holdout_report(
    store: Store,
    tenant: str,
    *,
    since: float,
    prices: Prices | None,
    holdout: float,
    until: float | None = None,
) -> HoldoutReport:
    """The report of `tenant` over [since, until] (until: now)."""
    until = time.time() if until is None else until
    measured: list[ConversationMeasures] = []
    for conv in await conversations_since(store, tenant, since):
        requests = await read_requests(store, conv, since, until)
        if requests:
            measured.append(measure(requests, prices))
    return HoldoutReport(
        tenant, holdout, since, until, prices is not None, compare(measured, prices is not None)
    )


def figure(value: float | None) -> str:
    """A measure's value as every surface prints it (the CLI, the page)."""
    if value is None:
        return "—"
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3g}"


def stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(epoch)) + " UTC"


def verdict(noise: bool | None) -> str:
    """What an interval says: "noise" (it holds 0), "differs", or "too few" (no interval:
    a cohort has fewer than 2 conversations with the measure)."""
    if noise is None:
        return "too few"
    return "noise" if noise else "differs"
