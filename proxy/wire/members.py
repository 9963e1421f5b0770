"""A JSON object's top-level members where they sit in its text, each kept as written.

Used where a body must go out again with one member changed and every other byte as it
came (a cache-riding summarizer call, dialects/riding.py): a provider's prompt cache is
keyed on what it was sent, so the messages are copied from the text, never re-encoded
(`spliced` appends one entry to the history's array and sets the members a call changes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The standard library's own string scanner (json.decoder's, not in its type stubs).
_scanstring: Any = json.decoder.scanstring  # type: ignore[attr-defined]

_WS = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Member:
    """One member: `key`, its value parsed, and `text[start:end]` the whole `"key": value`
    (`text[value_start:end]` the value alone)."""

    key: str
    value: Any
    start: int
    value_start: int
    end: int


def members(text: str) -> list[Member]:
    """The top-level members of the JSON object `text`, in order. Raises ValueError when
    `text` is not one JSON object."""
    decoder = json.JSONDecoder()
    at = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if text[at : at + 1] != "{":
        raise ValueError("not a JSON object")
    at = _WS.match(text, at + 1).end()  # type: ignore[union-attr]
    out: list[Member] = []
    if text[at : at + 1] == "}":
        _end_of(text, at + 1)
        return out
    while True:
        if text[at : at + 1] != '"':
            raise ValueError(f"a key expected at {at}")
        key, after = _scanstring(text, at + 1)
        colon = _WS.match(text, after).end()  # type: ignore[union-attr]
        if text[colon : colon + 1] != ":":
            raise ValueError(f"':' expected at {colon}")
        start = _WS.match(text, colon + 1).end()  # type: ignore[union-attr]
        value, end = decoder.raw_decode(text, start)
        out.append(Member(key, value, at, start, end))
        at = _WS.match(text, end).end()  # type: ignore[union-attr]
        if text[at : at + 1] == ",":
            at = _WS.match(text, at + 1).end()  # type: ignore[union-attr]
            continue
        if text[at : at + 1] == "}":
            _end_of(text, at + 1)
            return out
        raise ValueError(f"',' or '}}' expected at {at}")


def _end_of(text: str, at: int) -> None:
    if _WS.match(text, at).end() != len(text):  # type: ignore[union-attr]
        raise ValueError("text after the object")


def read_members(forwarded: bytes) -> dict[str, Any] | None:
    """The body's top-level members, parsed (None: not one JSON object)."""
    try:
        return {m.key: m.value for m in members(forwarded.decode("utf-8"))}
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def _json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: written as its escape instead
        return json.dumps(value)
    return text


def _value(key: str, value: Any) -> str:
    return _json(key) + ":" + _json(value)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def spliced(
    text: str,
    found: Sequence[Member],
    history: str,
    entry: Any,
    changed: Mapping[str, Any],
    dropped: Collection[str] = (),
) -> bytes:
    """The object `text` (its members `found`) with `entry` appended to its array member
    `history` before the closing bracket, the `changed` members set (in place where the
    body has them and their value differs, else after the rest), the `dropped` ones left
    out; every other byte as written."""
    joined = _json(entry)
    pending = dict(changed)
    parts: list[str] = []
    for m in found:
        if m.key in dropped:
            continue
        if m.key == history:
            joint = "," if m.value else ""
            parts.append(text[m.start : m.end - 1] + joint + joined + "]")
        elif m.key in pending:
            value = pending.pop(m.key)
            parts.append(text[m.start : m.end] if _same(value, m.value) else _value(m.key, value))
        else:
            parts.append(text[m.start : m.end])
    parts += [_value(k, v) for k, v in pending.items()]
    return ("{" + ",".join(parts) + "}").encode("utf-8")
