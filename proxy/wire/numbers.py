"""JSON numbers as the client wrote them, for a chat body the proxy re-serialises.

When a stage rewrites the messages, the compacting route serialises the whole body again. Python's
json would write `1e400` back as `Infinity` (not JSON: the upstream rejects it),
`0.30` as `0.3`, `1E2` as `100.0`, `-0` as `0`. So the parser keeps, for every
number whose Python value would not write back as the same text, that text
(`Literal`, a float or int with the value and the original spelling), and the
serialiser puts those texts back. Numbers that round-trip (nearly all of them:
SDKs write floats with repr) stay plain floats and ints and cost nothing extra.

`NaN`, `Infinity` and `-Infinity` are not JSON: a body holding them is not parsed
at all (proxy/edge/compacting.py forwards it byte for byte), so the proxy never emits them.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from proxy.wire import longjson


class LiteralFloat(float):
    text: str


class LiteralInt(int):
    text: str


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(raw: bytes | str) -> tuple[Any, bool]:
    """json.loads, keeping each number's text where Python would write it differently;
    and whether it kept any (only then must `dumps` be used to write the value back)."""
    kept = False

    def parse_float(text: str) -> float:
        nonlocal kept
        value = float(text)
        if repr(value) == text:
            return value
        kept = True
        out = LiteralFloat(value)
        out.text = text
        return out

    def parse_int(text: str) -> int:
        nonlocal kept
        value = int(text)
        if text.isdigit() or (text[1:].isdigit() and text != "-0"):
            return value
        kept = True
        out = LiteralInt(value)
        out.text = text
        return out

    # longjson.loads: json.loads with long strings decoded in slices (a GIL-sharing thread).
    hooks: dict[str, Any] = {
        "parse_float": parse_float,
        "parse_int": parse_int,
        "parse_constant": _not_json,
    }
    value = json.loads(raw, **hooks) if isinstance(raw, str) else longjson.loads(raw, **hooks)
    return value, kept


def dumps(value: Any, separators: tuple[str, str] | None = None) -> bytes:
    """UTF-8 JSON with every kept number written as the client wrote it.

    The kept numbers go through json as unique placeholder strings, swapped for their
    text afterwards (the nonce makes a clash with a real string impossible in practice).
    Never writes NaN or Infinity: a value with one raises ValueError.
    """
    nonce = secrets.token_hex(8)
    texts: list[str] = []
    swapped = _walk(value, (nonce, texts))
    out = _json_bytes(swapped, separators)
    for i, text in enumerate(texts):
        out = out.replace(f'"\\u0000{nonce}:{i}"'.encode(), text.encode(), 1)
    return out


def _json_bytes(value: Any, separators: tuple[str, str] | None) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators, allow_nan=False).encode(
            "utf-8"
        )
    except UnicodeEncodeError:
        # A lone surrogate (valid as a JSON escape) is not UTF-8: escape again.
        return json.dumps(value, separators=separators, allow_nan=False).encode("ascii")


def _walk(value: Any, swap: tuple[str, list[str]]) -> Any:
    """`value` with kept numbers replaced by placeholders (copied only where one is)."""
    if isinstance(value, (LiteralFloat, LiteralInt)):
        nonce, texts = swap
        texts.append(value.text)
        return f"\x00{nonce}:{len(texts) - 1}"
    if isinstance(value, dict):
        items = {k: _walk(v, swap) for k, v in value.items()}
        changed = any(items[k] is not v for k, v in value.items())
        return items if changed else value
    if isinstance(value, list):
        elems = [_walk(v, swap) for v in value]
        changed = any(a is not b for a, b in zip(elems, value, strict=True))
        return elems if changed else value
    return value
