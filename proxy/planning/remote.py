"""Codex remote compaction, the pure part: which requests ask for it, and the items answered.

Codex asks the server to compact (docs/codex.md): `POST /v1/responses/compact`, or a
`{"type": "compaction_trigger"}` item last in a `/v1/responses` input. It expects
exactly one `{"type": "compaction", "encrypted_content": ...}` item back and sends
that item in later inputs. Recap answers with a reference to a summary it stored
(`reference.py`) and, when the item comes back, puts the summary in its place as a
`user` message framed as a quoted record, never as instructions.

Everything here is a function of its arguments: `proxy/stages/remote.py` does the IO.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.planning.framing import defuse, framed_summary, summary_message
from proxy.planning.guard import Earlier
from proxy.planning.transcript import content_text

TRIGGER = "compaction_trigger"
# Codex reads `compaction_summary` as an alias of `compaction` (protocol/src/models.rs).
COMPACTION_TYPES = frozenset({"compaction", "compaction_summary"})


class RemoteAction(enum.StrEnum):
    """What Recap did for remote compaction on a request (the log's `remote_compaction`)."""

    COMPACT = "compact"  # answered POST /v1/responses/compact
    TRIGGER = "trigger"  # answered a compaction_trigger on /v1/responses
    EXPANDED = "expanded"  # replaced compaction items by their summaries, then forwarded


def is_trigger(item: object) -> bool:
    return isinstance(item, Mapping) and item.get("type") == TRIGGER


def is_compaction(item: object) -> bool:
    return isinstance(item, Mapping) and item.get("type") in COMPACTION_TYPES


# A printable ASCII character written as a \u escape: JSON encoders never do that (they
# escape only quotes, backslashes, control and non-ASCII characters), so only a body
# spelling a type oddly has one, and it is parsed to be sure.
_ESCAPED_ASCII = re.compile(rb"\\u00[2-7][0-9a-fA-F]")


def may_hold_compaction(raw: bytes) -> bool:
    """A cheap look at a body's bytes: False means it holds no compaction item nor trigger
    (their type names are in the bytes, literally or with an escaped letter)."""
    return b"compaction" in raw or _ESCAPED_ASCII.search(raw) is not None


@dataclass(frozen=True)
class CompactionRequest:
    """What a `/v1/responses` input asks of remote compaction."""

    # The input without its trigger items: the history to compact.
    history: list[Any]
    triggered: bool
    # Positions in `history` of compaction items (to expand before anything reads it).
    compactions: tuple[int, ...]


def read_input(items: Sequence[Any]) -> CompactionRequest:
    history = [item for item in items if not is_trigger(item)]
    return CompactionRequest(
        history,
        len(history) != len(items),
        tuple(i for i, item in enumerate(history) if is_compaction(item)),
    )


def summary_item(summary: str, language: str) -> dict[str, Any]:
    """The input item a compaction item is replaced by: the summary as user-side data."""
    text = summary_message(summary, "user", language, "session")["content"]
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def recognised(messages: Sequence[Any], stored: Sequence[str]) -> list[Any]:
    """`messages` (to be summarised) with each expanded compaction item, a user message
    that is exactly Recap's frame around one of the `stored` summaries of the
    conversation, as the `Earlier` summary it stands for: the guard knows Recap's own
    lines by where they come from, never by their shape."""
    framed = {defuse(s.strip()): s for s in stored}
    out: list[Any] = []
    for m in messages:
        summary = None
        if isinstance(m, Mapping) and m.get("role") == "user":
            body = framed_summary(content_text(m.get("content")))
            summary = framed.get(body) if body is not None else None
        out.append(Earlier(summary) if summary is not None else m)
    return out


def compaction_item(token: str) -> dict[str, Any]:
    # A stable id: retries of one compaction give the same item.
    item_id = "cmp_" + hashlib.sha256(token.encode("ascii")).hexdigest()[:32]
    return {"type": "compaction", "id": item_id, "encrypted_content": token}


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int

    def as_json(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def response_object(
    response_id: str,
    model: str | None,
    created_at: int,
    item: Mapping[str, Any] | None,
    usage: Usage | None,
) -> dict[str, Any]:
    """A Responses API response object: in progress (no item yet) or completed."""
    done = item is not None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "completed" if done else "in_progress",
        "model": model or "",
        "output": [dict(item)] if item is not None else [],
        "usage": usage.as_json() if usage is not None else None,
        "error": None,
        "incomplete_details": None,
    }


def compact_object(
    response_id: str, created_at: int, item: Mapping[str, Any], usage: Usage
) -> dict[str, Any]:
    """The answer of `POST /v1/responses/compact`; Codex reads its `output`."""
    return {
        "id": response_id,
        "object": "response.compaction",
        "created_at": created_at,
        "output": [dict(item)],
        "usage": usage.as_json(),
    }


def stream_events(
    response_id: str, model: str | None, created_at: int, item: Mapping[str, Any], usage: Usage
) -> list[dict[str, Any]]:
    """The SSE events of a streamed answer holding the one compaction item."""
    started = response_object(response_id, model, created_at, None, None)
    done = response_object(response_id, model, created_at, item, usage)
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": dict(item)},
        {"type": "response.output_item.done", "output_index": 0, "item": dict(item)},
        {"type": "response.completed", "response": done},
    ]
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]
