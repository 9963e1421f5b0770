"""The request's record: what every layer notes about one request, as typed fields.

Made by the front (`proxy/edge/front.py`) when a request arrives and kept in its scope
(`record_of`); the route, the stages and the archive fill it in as they go, and it is
read where the request is reported: the access line (`as_log`, the JSON line whose field
names `recap tail` reads, see `proxy/ops/tail_fields.py`), the metrics
(`proxy/edge/metrics.py`) and the calibration of the window from usage. Nothing writes a
free-form key: a new fact about a request is a new field here.

Never a key or message content: ids, counts, timings, reasons.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from proxy.planning.outcome import CompactionOutcome, log_fields

# Where the record lives in an ASGI scope (`scope["state"]`, which uvicorn and Starlette
# give every request).
SCOPE_KEY = "recap.record"


@dataclass
class OverflowRetry:
    """The upstream said the prompt was too long: what it said, and the retry's window."""

    limit: int | None
    prompt_tokens: int | None
    estimate: int
    window: int


@dataclass
class RemoteNote:
    """Codex remote compaction answered by Recap (`planning.remote.RemoteAction`)."""

    action: str
    version: int | None = None
    reused: bool | None = None


@dataclass
class ManualNote:
    """The operator's compaction route: ok, failed or skipped, and why."""

    status: str
    ms: float
    reason: str | None = None


@dataclass
class RequestRecord:
    request_id: str = ""
    method: str = ""
    path: str = ""
    # The route's name for metrics ("chat", "responses", ...: its dialect's); None for
    # the routes named by their path (operator, pass-through, other).
    route: str | None = None
    status: int | None = None
    tenant: str | None = None
    conversation: str | None = None
    model: str | None = None
    classification: str | None = None
    messages: int | None = None
    # Why a compacting route forwarded the body untouched (dialects.PassReason), in words.
    passthrough: str | None = None
    passthrough_reason: str | None = None
    overhead_ms: float | None = None
    ttfb_ms: float | None = None
    total_ms: float | None = None
    upstream_status: int | None = None
    upstream_request_id: str | None = None
    error: str | None = None
    client_disconnected: bool | None = None
    # Estimated input tokens sent, and of the client's history when the view changed.
    input_tokens: int | None = None
    tokens_before: int | None = None
    # What each compaction layer did (the exchange's, once its pipeline ran).
    outcomes: list[CompactionOutcome] = field(default_factory=list)
    # Stages that raised and were skipped, as "stage:ExceptionType".
    stage_errors: list[str] = field(default_factory=list)
    archive_error: str | None = None
    overflow: OverflowRetry | None = None
    remote: RemoteNote | None = None
    manual: ManualNote | None = None
    # -- cache (prompt-cache reporting) --
    # What the upstream's usage said of the forwarded request's input: all its input
    # tokens, and those its prompt cache served (`dialects.base.CacheUsage`).
    upstream_input_tokens: int | None = None
    cached_input_tokens: int | None = None
    # -- end cache --
    # The conversation's cohort when its tenant runs a holdout (planning.cohort.Cohort's
    # value: "holdout" is never compacted, "compacted" is); None without a holdout.
    cohort: str | None = None

    def as_log(self) -> dict[str, Any]:
        """The access line's fields, by the names the log has always used (None: left
        out by the formatter)."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "tenant": self.tenant,
            "conversation": self.conversation,
            "model": self.model,
            "classification": self.classification,
            "messages": self.messages,
            "passthrough": self.passthrough,
            "passthrough_reason": self.passthrough_reason,
            "overhead_ms": self.overhead_ms,
            "ttfb_ms": self.ttfb_ms,
            "total_ms": self.total_ms,
            "upstream_status": self.upstream_status,
            "upstream_request_id": self.upstream_request_id,
            "error": self.error,
            "client_disconnected": self.client_disconnected,
            "input_tokens": self.input_tokens,
            "tokens_before": self.tokens_before,
            "stage_errors": self.stage_errors or None,
            "archive_error": self.archive_error,
            # -- cache --
            "upstream_input_tokens": self.upstream_input_tokens,
            "cached_input_tokens": self.cached_input_tokens,
            # -- end cache --
            "cohort": self.cohort,
        }
        out.update(log_fields(self.outcomes))
        if self.overflow is not None:
            out.update(
                overflow_retry=True,
                overflow_limit=self.overflow.limit,
                overflow_prompt_tokens=self.overflow.prompt_tokens,
                overflow_estimate=self.overflow.estimate,
                overflow_retry_window=self.overflow.window,
            )
        if self.remote is not None:
            out.update(
                remote_compaction=self.remote.action,
                remote_compaction_version=self.remote.version,
                remote_compaction_reused=self.remote.reused,
            )
        if self.manual is not None:
            out.update(
                manual_compaction=self.manual.status,
                manual_compaction_ms=self.manual.ms,
                manual_compaction_reason=self.manual.reason,
            )
        return out


def record_of(scope: MutableMapping[str, Any]) -> RequestRecord:
    """This request's record (made by the front; made here for a scope that has none,
    as in a test that calls a route directly)."""
    state = scope.setdefault("state", {})
    record = state.get(SCOPE_KEY)
    if record is None:
        record = state[SCOPE_KEY] = RequestRecord()
    assert isinstance(record, RequestRecord)
    return record
