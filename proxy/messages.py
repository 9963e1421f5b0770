"""Typed view of chat messages: identity, classification, turns and tool rounds.

Sits right after parsing in the data path. Everything here is pure: messages are
the client's own JSON objects (dicts), never copied or re-serialised unless a
later stage rewrites them, so what we do not change is forwarded as it came.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]

PINNED_ROLES = frozenset({"system", "developer"})

# Fields that make up a message's identity; anything else (e.g. vendor extras such
# as `reasoning_content`) does not change what the conversation said.
_IDENTITY_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call")


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
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=separators).encode("ascii")


def fingerprint(message: Message) -> str:
    """A canonical hash of what the message says (stable across key order and spacing)."""
    identity = {k: message[k] for k in _IDENTITY_FIELDS if message.get(k) is not None}
    canonical = json.dumps(identity, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


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
