"""Codex remote compaction, the pure part: which requests ask for it, and the items answered.

Codex asks the server to compact (docs/codex.md): `POST /v1/responses/compact`, or a
`{"type": "compaction_trigger"}` item last in a `/v1/responses` input. It expects
exactly one `{"type": "compaction", "encrypted_content": ...}` item back and sends
that item in later inputs. Recap answers with a reference to a summary it stored
(`reference.py`) and, when the item comes back, puts the summary in its place as a
`user` message framed as a quoted record, never as instructions.

Everything here is a function of its arguments: `proxy/stages/remote.py` and
`proxy/stages/expansion.py` do the IO.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxy.history.identity import DERIVED_PREFIX
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


@dataclass(frozen=True)
class Holder:
    """The conversation a request presents compaction items in: its key, whether the client
    named it (else Recap derives one from the history), and the conversation it declares
    itself forked from (Codex's `forked_from_thread_id`), if any."""

    key: str
    named: bool
    forked_from: str | None = None


def belongs(item_key: str, holder: Holder) -> bool:
    """Whether an item issued in conversation `item_key` expands in `holder`'s: its own, a
    Codex fork of it (`codex fork` copies the history, item included, into a new session
    that names its parent), or, when the client named no conversation either time, any
    (derived keys are shared by every client sending the same first messages anyway)."""
    if item_key == holder.key or holder.forked_from == item_key:
        return True
    return not holder.named and item_key.startswith(DERIVED_PREFIX)


# The turn metadata Codex sends (a header, and a copy in the body's `client_metadata`) is a
# few hundred bytes; anything far longer is not Codex's and is not read.
_MAX_METADATA_CHARS = 16 * 1024


def fork_parent(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The session a Codex request says its thread was forked from (`forked_from_thread_id`
    in `x-codex-turn-metadata`, the header or `client_metadata`'s copy), else None."""
    copies: list[object] = [headers.get("x-codex-turn-metadata")]
    client = body.get("client_metadata")
    if isinstance(client, Mapping):
        copies.append(client.get("x-codex-turn-metadata"))
    for text in copies:
        if not isinstance(text, str) or len(text) > _MAX_METADATA_CHARS:
            continue
        try:
            metadata = json.loads(text)
        except ValueError:
            continue
        parent = metadata.get("forked_from_thread_id") if isinstance(metadata, dict) else None
        if isinstance(parent, str) and parent:
            return parent
    return None


class Unavailable(enum.StrEnum):
    """Why a valid compaction item's summary is not what it expands to (docs/codex.md)."""

    GONE = "gone"  # the store no longer has it: pruned, or the store was replaced
    WITHDRAWN = "withdrawn"  # an operator rolled the conversation back past it, to none
    FOREIGN = "foreign"  # issued in another conversation (not one this request forks)


# Recap's own notes, in place of a summary it will not or cannot show. Said as Recap's
# (never as the user's), and not in a summary frame: they record no conversation.
_NOTES = MappingProxyType(
    {
        ("English", Unavailable.GONE): (
            "[Recap: an earlier part of this conversation was compacted here, and its summary"
            " is no longer kept: it was deleted from Recap's store (by retention or an"
            " operator's prune). That earlier context is gone; the messages around this note"
            " are all that remain of it. Carry on from them, and ask the user for anything"
            " needed from before.]"
        ),
        ("English", Unavailable.WITHDRAWN): (
            "[Recap: an earlier part of this conversation was compacted here, and an operator"
            " withdrew its summary (a rollback). That earlier context is not shown; the"
            " messages around this note are all that remain of it. Carry on from them, and ask"
            " the user for anything needed from before.]"
        ),
        ("English", Unavailable.FOREIGN): (
            "[Recap: a compaction record of another conversation was sent here; its summary is"
            " not carried into this conversation. Carry on from the messages around this note,"
            " and ask the user for anything needed from before.]"
        ),
        ("English", "earlier"): (
            "[Recap: an operator withdrew the latest summary of the earlier part of this"
            " conversation (a rollback). The record below is the earlier one the operator kept;"
            " what happened after it, up to the messages that follow, is not shown.]"
        ),
        ("Chinese", Unavailable.GONE): (
            "[Recap：此处原有一段已压缩的较早对话，其摘要已不再保存：它已从 Recap 的存储中删除"
            "（保留期清理或运维人员的清理）。那段较早的上下文已丢失，本说明前后的消息就是仅存的内容。"
            "请据此继续，如需之前的信息请询问用户。]"
        ),
        ("Chinese", Unavailable.WITHDRAWN): (
            "[Recap：此处原有一段已压缩的较早对话，运维人员已撤回其摘要（回滚）。那段较早的上下文"
            "不再显示，本说明前后的消息就是仅存的内容。请据此继续，如需之前的信息请询问用户。]"
        ),
        ("Chinese", Unavailable.FOREIGN): (
            "[Recap：此处收到的是另一段对话的压缩记录，其摘要不会带入本对话。"
            "请根据本说明前后的消息继续，如需之前的信息请询问用户。]"
        ),
        ("Chinese", "earlier"): (
            "[Recap：运维人员已撤回这段较早对话的最新摘要（回滚）。下面是运维人员保留的较早记录；"
            "其后直到后续消息之间发生的事情不再显示。]"
        ),
    }
)


def _note_language(language: str) -> str:
    lang = language.strip().lower()
    return "Chinese" if "chinese" in lang or lang.startswith("zh") else "English"


def _user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def summary_item(summary: str, language: str) -> dict[str, Any]:
    """The input item a compaction item is replaced by: the summary as user-side data."""
    return _user_item(summary_message(summary, "user", language, "session")["content"])


def earlier_summary_item(summary: str, language: str) -> dict[str, Any]:
    """In place of an item whose version was rolled back: the version the operator kept
    (`summary`), framed as any summary, after Recap's note that it is an earlier one."""
    note = _NOTES[(_note_language(language), "earlier")]
    framed = summary_message(summary, "user", language, "session")["content"]
    return _user_item(f"{note}\n\n{framed}")


def unavailable_item(why: Unavailable, language: str) -> dict[str, Any]:
    """In place of an item whose summary is not shown: Recap's note saying so and why."""
    return _user_item(_NOTES[(_note_language(language), why)])


# What the summary guard (proxy/planning/guard.py) reads of one text of a compacted message:
# its head and tail. The guard scans text at about 2 s a megabyte in calls that hold the
# GIL, so a 30 MB message would stall the event loop even from a worker thread; the
# summarizer itself was shown far less of it (`max_item_chars`).
GUARD_TEXT_CHARS = 64 * 1024
# Where a text may be cut without leaving half a sentence: after a sentence's end, as the
# guard splits sentences (a full stop only before whitespace: not the dot of `main.py`).
_SENTENCE_END = re.compile(r"[。！？!?；;\n]|\.(?=\s)")


def guard_view(message: Any, max_chars: int = GUARD_TEXT_CHARS) -> Any:
    """`message` as the guard reads it: each text (content, its parts, tool-call arguments)
    of over `max_chars` characters cut to its head and tail, each ending or starting on a
    sentence boundary, so that no sentence is fused or cut short (the guard quotes whole
    sentences back)."""
    if not isinstance(message, Mapping):
        return message
    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = _cut(content, max_chars)
    elif isinstance(content, list):
        out["content"] = [
            {**p, "text": _cut(p["text"], max_chars)}
            if isinstance(p, Mapping) and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_cut_call(call, max_chars) for call in calls]
    return out


def _cut_call(call: Any, max_chars: int) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": _cut(function["arguments"], max_chars)}}


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    head, tail = text[:half], text[-half:]
    ends = [m.end() for m in _SENTENCE_END.finditer(head)]
    head = head[: ends[-1]] if ends else ""
    start = _SENTENCE_END.search(tail)
    tail = tail[start.end() :] if start else ""
    return f"{head}\n{tail}"


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
