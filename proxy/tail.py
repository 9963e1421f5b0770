"""`recap tail`: follow Recap's JSON log lines and print them readably.

Reads a file or stdin line by line; lines that are not Recap JSON are printed as
they are, so it can sit behind any log shipper. A request that compacted (or tried
to) gets one indented line per layer under its access line, so compactions stand out.
"""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from proxy.logs import format_fields

NOTE = "         \u21b3 "  # under the time and level columns


def compaction_notes(f: dict[str, Any]) -> list[str]:
    """Readable lines for the compaction fields of one access line (none if it had none)."""
    notes: list[str] = []
    trigger = f.get("session_trigger")
    if f.get("session_failure"):
        notes.append(f"session compaction FAILED ({trigger}): {f['session_failure']}")
    elif trigger is not None:
        notes.append(
            f"session compacted ({trigger}): {f.get('compacted_messages', '?')} messages"
            f" in {f.get('session_batches', '?')} batch(es), summary v{f.get('summary_version')}"
            f", {f.get('compaction_ms', '?')} ms"
        )
    if f.get("loop_failure"):
        notes.append(f"loop compaction FAILED: {f['loop_failure']}")
    elif f.get("loop_trigger") is not None:
        notes.append(
            f"loop compacted ({f['loop_trigger']}): {f.get('loop_rounds_compacted', '?')}"
            f" more tool rounds, {f.get('loop_rounds_summarised', '?')} summarised"
        )
    if f.get("trimmed_results"):
        notes.append(
            f"trimmed {f['trimmed_results']} tool result(s),"
            f" {f.get('trimmed_chars_saved', '?')} chars saved"
        )
    if f.get("dropped_messages"):
        notes.append(f"dropped {f['dropped_messages']} oldest message(s) to fit the window")
    if f.get("manual_compaction"):
        notes.append(
            f"manual compaction {f['manual_compaction']}, {f.get('manual_compaction_ms', '?')} ms"
        )
    if notes and f.get("tokens_before") is not None:
        notes.append(f"tokens {f['tokens_before']} -> {f.get('input_tokens')}")
    return [NOTE + n for n in notes]


def render(record: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(float(record.get("ts", 0) or 0)))
    level = str(record.get("level", "info"))
    fields = {k: v for k, v in record.items() if k not in ("ts", "level", "logger")}
    if record.get("logger") == "recap.access":
        fields.pop("msg", None)
        return "\n".join([f"{stamp} {level:5} {format_fields(fields)}", *compaction_notes(fields)])
    msg = fields.pop("msg", "")
    rest = format_fields(fields)
    return f"{stamp} {level:5} {record.get('logger', '')}: {msg}" + (f" {rest}" if rest else "")


def tail(src: TextIO, out: TextIO, conversation: str | None = None, follow: bool = False) -> None:
    while True:
        line = src.readline()
        if not line:
            if not follow:
                return
            time.sleep(0.2)
            continue
        line = line.rstrip("\n")
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if conversation is None:
                print(line, file=out, flush=True)
            continue
        if conversation is not None and record.get("conversation") != conversation:
            continue
        print(render(record), file=out, flush=True)
