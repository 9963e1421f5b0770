"""Typed view of chat messages: identity, classification, turns and tool rounds.

Sits right after parsing in the data path. Everything here is pure: messages are
the client's own JSON objects (dicts), never copied or re-serialised unless a
later stage rewrites them, so what we do not change is forwarded as it came.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.wire import longjson

Message = Mapping[str, Any]

PINNED_ROLES = frozenset({"system", "developer"})


class Classification(enum.StrEnum):
    TURN_START = "turn_start"
    TOOL_CONTINUATION = "tool_continuation"
    OTHER = "other"


def has_content(message: Message) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return content.strip() != ""
    if isinstance(content, list):
        return len(content) > 0
    return False


def classify(messages: Sequence[Any]) -> Classification:
    """Tell from the last message whether a new turn starts or a tool loop goes on.

    A user message with no content is what a confirmation resume sends: it
    continues the loop rather than starting a turn (seed 003).
    """
    if not messages or not isinstance(messages[-1], Mapping):
        return Classification.OTHER
    last = messages[-1]
    role = last.get("role")
    if role == "user":
        return Classification.TURN_START if has_content(last) else Classification.TOOL_CONTINUATION
    if role in ("tool", "function"):
        return Classification.TOOL_CONTINUATION
    return Classification.OTHER


def json_bytes(value: Any, separators: tuple[str, str] | None = None) -> bytes:
    """`value` as UTF-8 JSON for the wire.

    A lone surrogate (valid as a JSON escape, as a client may send it) is not UTF-8: such
    a value is written with its non-ASCII escaped again, never as the invalid bytes
    `surrogatepass` would give.
    """
    # longjson: the text of json.dumps, made in slices a worker thread can share.
    try:
        parts = longjson.pieces(value, ensure_ascii=False, separators=separators)
        return b"".join(part.encode("utf-8") for part in parts)
    except UnicodeEncodeError:
        return longjson.dumps(value, separators=separators).encode("ascii")


def fingerprint(message: Message) -> str:
    """A canonical hash of the whole message: every field the client sent (`refusal`,
    `audio`, `reasoning_content`, vendor extras, explicit nulls), keys sorted, no spacing.
    Two messages share it only when they are the same JSON object, so the archive never
    merges distinct messages and a summary never stands for a message it did not see."""
    # The sha256 of json.dumps(message, sort_keys=True, ensure_ascii=False, compact), fed
    # in pieces so that a huge message never holds the GIL for long (proxy.wire.longjson).
    h = hashlib.sha256()
    for part in longjson.pieces(message, sort_keys=True, ensure_ascii=False, separators=(",", ":")):
        h.update(part.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def is_pinned(message: object) -> bool:
    """A system or developer message: an instruction, kept wherever it sits (never
    summarised, trimmed or dropped), whether it leads the history or came later."""
    return _role(message) in PINNED_ROLES


def split_pinned(messages: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """Leading system/developer messages are pinned: never summarised, not in the chain."""
    n = 0
    while n < len(messages) and _role(messages[n]) in PINNED_ROLES:
        n += 1
    return list(messages[:n]), list(messages[n:])


def chain_hashes(messages: Sequence[Message]) -> list[str]:
    """Rolling hash after each message: chain[i] identifies messages[: i + 1] as a whole."""
    return chain_of([fingerprint(m) for m in messages])


def chain_of(fingerprints: Sequence[str], after: str = "") -> list[str]:
    """chain_hashes from fingerprints already computed; `after`: the chain hash of the
    messages before them, to extend a chain."""
    out: list[str] = []
    h = after
    for fp in fingerprints:
        h = hashlib.sha256((h + fp).encode("ascii")).hexdigest()
        out.append(h)
    return out


def _role(message: object) -> str | None:
    role = message.get("role") if isinstance(message, Mapping) else None
    return role if isinstance(role, str) else None
