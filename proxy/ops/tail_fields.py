"""The log line's vocabulary as `recap tail` reads it: field names and codes in words.

Beside `tail.py`: the server writes these fields (`proxy/record.py`, with the stages'
typed outcomes rendered by `planning/outcome.py`); keeping their names in one table
means a renamed field is one edit, and `words` turns the codes a reader meets into plain
language.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


class F:
    """The JSON field names read here, with what each means."""

    ts = "ts"  # ISO-8601 (or, in older logs, epoch seconds)
    level = "level"
    logger = "logger"
    msg = "msg"
    event = "event"  # lifecycle lines (started, stopping, stopped): `msg` says it all
    request_id = "request_id"
    method = "method"
    path = "path"
    status = "status"
    tenant = "tenant"
    conversation = "conversation"
    model = "model"
    classification = "classification"  # turn_start, tool_continuation, other (compacting routes)
    tokens_after = "input_tokens"  # what was sent upstream
    tokens_before = "tokens_before"  # what the client sent (only when Recap changed it)
    layers = "layers"  # the layers that ran, when the log names them (else inferred)
    # One object per layer that ran (the typed outcomes): layer, action (compacted, applied,
    # skipped, failed), trigger, skip_reason, failure, version, tokens_before, tokens_after,
    # duration_ms, count, covers, saved_chars, ... Older logs lack it: the flat fields below.
    compactions = "compactions"
    # The holdout cohort ("holdout" or "compacted") when the tenant runs a holdout.
    cohort = "cohort"
    # -- cache: what the upstream's usage reported, and what its prompt cache served --
    upstream_input_tokens = "upstream_input_tokens"
    cached_input_tokens = "cached_input_tokens"
    # -- end cache --
    overhead_ms = "overhead_ms"
    total_ms = "total_ms"
    upstream_status = "upstream_status"
    error = "error"
    passthrough = "passthrough"  # why the body went up untouched, typed (dialects.PassReason)
    passthrough_reason = "passthrough_reason"  # the same, in words
    client_disconnected = "client_disconnected"
    summary_version = "summary_version"
    session_trigger = "session_trigger"
    session_failure = "session_failure"
    session_skip = "session_skip"
    session_reused = "session_reused"
    session_batches = "session_batches"
    session_messages = "compacted_messages"
    session_ms = "compaction_ms"
    session_tokens_before = "session_tokens_before"
    session_tokens_after = "session_tokens_after"
    loop_trigger = "loop_trigger"
    loop_failure = "loop_failure"
    loop_skip = "loop_skip"
    loop_rounds = "loop_rounds_compacted"
    loop_rounds_in_memory = "loop_rounds_summarised"
    loop_ms = "loop_compaction_ms"
    loop_tokens_before = "loop_tokens_before"
    loop_tokens_after = "loop_tokens_after"
    trimmed_results = "trimmed_results"
    trimmed_chars = "trimmed_chars_saved"
    shortened_messages = "shortened_messages"
    dropped_messages = "dropped_messages"
    manual = "manual_compaction"
    # Codex remote compaction (planning.remote.RemoteAction: compact, trigger, expanded),
    # and the summary version answered.
    remote = "remote_compaction"
    remote_version = "remote_compaction_version"
    manual_ms = "manual_compaction_ms"
    manual_reason = "manual_compaction_reason"
    # Keys inside one `compactions` object.
    c_layer = "layer"
    c_action = "action"
    c_trigger = "trigger"
    c_skip = "skip_reason"
    c_failure = "failure"
    c_version = "version"
    c_before = "tokens_before"
    c_after = "tokens_after"
    c_ms = "duration_ms"
    c_count = "count"
    c_covers = "covers"
    c_saved = "saved_chars"
    c_shortened = "shortened"
    c_reason = "reason"
    c_reused = "reused"


# Codes in the log, in words.
WORDS: Mapping[str, str] = {
    # triggers
    "context_ratio": "context near full",
    "min_new_tokens": "enough new history",
    "over_window": "over the window",
    "forced": "asked for",
    "tool_rounds": "many tool rounds",
    "tokens": "tool loop too large",
    # why a compaction did not run
    "disabled": "disabled",
    "nothing_to_compact": "nothing to compact",
    "below_threshold": "below the trigger",
    "too_few_messages": "too few messages",
    "anti_loop": "too little new since the last summary",
    "saving_below_min": "it would save too little",
    "circuit_open": "the summarizer failed repeatedly (cooling down)",
    "archive_failed": "the archive could not be written",
    # errors
    "upstream_unreachable": "upstream unreachable",
    "upstream_timeout": "upstream timed out",
    "request_too_large": "request too large",
    "invalid_api_key": "invalid proxy key",
    "store_unavailable": "store unavailable",
    "compaction_failed": "compaction failed",
    "conflict": "conflict",
    "not_found": "not found",
}
# Skips worth a line: the others are the normal state of a conversation between compactions.
NOTABLE_SKIPS = frozenset({"circuit_open", "archive_failed"})
_CODE = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b")


def words(value: Any) -> str:
    """A code (or a message holding codes) in words; unknown codes lose their underscores."""
    text = str(value)
    return _CODE.sub(lambda m: WORDS.get(m.group(0), m.group(0).replace("_", " ")), text)
