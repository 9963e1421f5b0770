"""The request's record (proxy/record.py): typed fields in, the log's names out.

Everything that reports a request reads the record: its access line keeps the field
names the log has always had, and `recap tail` knows each name the record can write
(the vocabulary is one: `proxy/ops/tail_fields.F`). End to end, the record is what the
log line and the metrics of a real request say (tests/edge/test_metrics.py,
tests/ops/test_logs.py).
"""

from __future__ import annotations

import dataclasses

from proxy.ops.tail_fields import F
from proxy.planning.outcome import CompactionOutcome, Layer
from proxy.record import ManualNote, OverflowRetry, RemoteNote, RequestRecord, record_of

# Written by the record but not shown by `recap tail` (kept for log stores and greps).
NOT_SHOWN = {
    "messages",
    "ttfb_ms",
    "upstream_request_id",
    "stage_errors",
    "archive_error",
    "summary_covers",
    "tool_rounds",
    "summarizer_tokens_in",
    "summarizer_tokens_out",
    "restored_references",
    "summarizer_length_retries",
    "summaries_salvaged",
    "dropped_reason",
    "overflow_retry",
    "overflow_limit",
    "overflow_prompt_tokens",
    "overflow_estimate",
    "overflow_retry_window",
    "remote_compaction_reused",
}


def full_record() -> RequestRecord:
    """A record with every field set, each layer compacted."""
    outcomes = [
        CompactionOutcome(
            Layer.SESSION,
            "compacted",
            "context_ratio",
            failure=None,
            version=2,
            count=10,
            covers=30,
            duration_ms=5,
            calls=1,
            summarizer_tokens_in=100,
            summarizer_tokens_out=20,
            restored_references=1,
            length_retries=1,
            salvaged=1,
            extra={"reused": True},
        ),
        CompactionOutcome(Layer.SESSION, "skipped", skip_reason="anti_loop"),
        CompactionOutcome(Layer.SESSION, "failed", failure="timeout"),
        CompactionOutcome(
            Layer.LOOP, "compacted", "tool_rounds", count=3, covers=6, extra={"tool_rounds": 9}
        ),
        CompactionOutcome(Layer.LOOP, "failed", failure="timeout"),
        CompactionOutcome(Layer.LOOP, "skipped", skip_reason="below_threshold"),
        CompactionOutcome(Layer.TRIM, "compacted", count=2, saved_chars=50, extra={"shortened": 1}),
        CompactionOutcome(Layer.FIT, "dropped", count=2, extra={"reason": "raw_too_large"}),
    ]
    values = {
        f.name: f"v-{f.name}"
        for f in dataclasses.fields(RequestRecord)
        if f.type in ("str", "str | None")
    }
    return dataclasses.replace(
        RequestRecord(),
        **values,
        status=200,
        messages=3,
        overhead_ms=1.0,
        ttfb_ms=2.0,
        total_ms=3.0,
        upstream_status=200,
        client_disconnected=True,
        input_tokens=10,
        tokens_before=20,
        outcomes=outcomes,
        stage_errors=["trim:ValueError"],
        overflow=OverflowRetry(100, 120, 110, 90),
        remote=RemoteNote("compact", 3, False),
        manual=ManualNote("ok", 4.0, "why"),
    )


def test_the_log_keeps_its_field_names() -> None:
    line = full_record().as_log()
    assert line["request_id"] == "v-request_id" and line["status"] == 200
    assert line["compactions"][0] == {
        "layer": "session",
        "action": "compacted",
        "trigger": "context_ratio",
        "version": 2,
        "count": 10,
        "covers": 30,
        "duration_ms": 5,
        "length_retries": 1,
        "salvaged": 1,
        "reused": True,
    }
    assert line["overflow_retry"] is True and line["overflow_retry_window"] == 90
    assert (line["remote_compaction"], line["remote_compaction_version"]) == ("compact", 3)
    assert (line["manual_compaction"], line["manual_compaction_ms"]) == ("ok", 4.0)
    assert line["stage_errors"] == ["trim:ValueError"]
    # Nothing written as a Python object: a line is JSON.
    assert all(isinstance(v, (str, int, float, bool, list, type(None))) for v in line.values())


def test_an_empty_record_writes_nothing_but_its_names() -> None:
    line = RequestRecord(request_id="r1", method="POST", path="/v1/x").as_log()
    assert {k for k, v in line.items() if v is not None} == {"request_id", "method", "path"}


def test_tail_knows_every_name_the_record_writes() -> None:
    known = {v for k, v in vars(F).items() if not k.startswith("_") and isinstance(v, str)}
    written = set(full_record().as_log())
    assert written - known - NOT_SHOWN == set()
    # ...and the list of names tail leaves out holds only names the record writes.
    assert NOT_SHOWN - written == set()


def test_the_layers_are_one_vocabulary() -> None:
    line = full_record().as_log()
    assert {c["layer"] for c in line["compactions"]} <= {layer.value for layer in Layer}
    # A StrEnum: a layer read back from a log or a store row is equal to its member.
    assert Layer("fit_to_window") is Layer.FIT and Layer.FIT == "fit_to_window"


def test_a_scope_has_one_record() -> None:
    scope: dict[str, object] = {}
    first = record_of(scope)
    first.tenant = "acme"
    assert record_of(scope) is first and record_of(scope).tenant == "acme"
