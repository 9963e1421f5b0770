"""`json.dumps` and `json.loads` for very long strings, in slices a worker thread can share.

Sits under the fingerprints, the archive rows and the forwarded body: each serialises the
client's messages with `json.dumps`, which holds the GIL for as long as it runs. For a 30 MB
string that is about 120 ms, and a worker thread does not help: the event loop cannot run
until the C call returns. Here a value's long strings (over `LONG_CHARS`) are swapped for
markers, the small skeleton is dumped as usual, and each long string is escaped in slices of
`SLICE_CHARS` (about 1 ms each) spliced in where its marker was. JSON escapes each code point
on its own, so the text is exactly what `json.dumps` gives with the same options; between
slices the interpreter hands the GIL to the loop when it asks. Values without long strings
(nearly all) go to `json.dumps` directly after one walk over their containers.

Pure, no state. Only the options Recap uses are supported: ensure_ascii, separators,
sort_keys. Long dict keys are not sliced (such a dict is dumped whole, as before).

`loads` is the reverse, for the request body (`proxy.wire.numbers.loads`): `json.loads` of a
30 MB string holds the GIL for about 60 ms; its long literals are decoded in slices.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any

LONG_CHARS = 1 << 20
SLICE_CHARS = 1 << 18


def dumps(
    value: Any,
    *,
    ensure_ascii: bool = True,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    parsed_from: int | None = None,
) -> str:
    """Exactly `json.dumps(value, ensure_ascii=..., separators=..., sort_keys=...)`.

    `parsed_from`: the value was parsed from JSON of at most this many bytes, so no string
    in it is longer; below `LONG_CHARS` it is dumped at once, without the walk."""
    if parsed_from is not None and parsed_from <= LONG_CHARS:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
        )
    return "".join(
        pieces(value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    )


def pieces(
    value: Any,
    *,
    ensure_ascii: bool = True,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> list[str]:
    """The same text as `dumps`, as a list of pieces (to hash or encode one at a time)."""
    options: dict[str, Any] = {
        "ensure_ascii": ensure_ascii,
        "separators": separators,
        "sort_keys": sort_keys,
    }
    longs: list[str] = []
    nonce: list[str] = []  # made only if a long string is found (`_marker`)
    try:
        # A walk that builds nothing first: nearly every value has no long string.
        skeleton = _swap(value, longs, nonce) if _has_long(value) else value
    except RecursionError:
        longs = []
    if not longs:
        return [json.dumps(value, **options)]
    text = json.dumps(skeleton, **options)
    spots: list[tuple[int, int, str]] = []
    for i, long in enumerate(longs):
        marker = _marker(nonce, i)
        quoted = json.dumps(marker, ensure_ascii=ensure_ascii)
        at = text.find(quoted)
        if at < 0 or text.find(quoted, at + 1) >= 0:
            return [json.dumps(value, **options)]  # cannot happen: the nonce is random
        spots.append((at, len(quoted), long))
    out: list[str] = []
    pos = 0
    for at, size, long in sorted(spots, key=lambda s: s[0]):
        out.append(text[pos:at])
        out.append('"')
        out.extend(_escaped(long, ensure_ascii))
        out.append('"')
        pos = at + size
    out.append(text[pos:])
    return out


def _escaped(text: str, ensure_ascii: bool) -> Iterable[str]:
    for i in range(0, len(text), SLICE_CHARS):
        yield json.dumps(text[i : i + SLICE_CHARS], ensure_ascii=ensure_ascii)[1:-1]


def _marker(nonce: list[str], i: int) -> str:
    if not nonce:
        nonce.append(secrets.token_hex(8))
    return f"\x00recap-long-{nonce[0]}-{i}\x00"


def _has_long(value: Any) -> bool:
    """Whether `value` holds a string over LONG_CHARS."""
    if isinstance(value, str):
        return len(value) > LONG_CHARS
    if isinstance(value, dict):
        for v in value.values():
            if _has_long(v):
                return True
    elif isinstance(value, list | tuple):
        for v in value:
            if _has_long(v):
                return True
    return False


def _swap(value: Any, longs: list[str], nonce: list[str]) -> Any:
    """`value` with each long string replaced by a marker (and collected), or value itself."""
    if isinstance(value, str):
        if len(value) > LONG_CHARS:
            longs.append(value)
            return _marker(nonce, len(longs) - 1)
        return value
    if isinstance(value, dict):
        found = len(longs)
        out = {k: _swap(v, longs, nonce) for k, v in value.items()}
        return out if len(longs) > found else value
    if isinstance(value, list | tuple):
        found = len(longs)
        items = [_swap(v, longs, nonce) for v in value]
        return items if len(longs) > found else value
    return value


# -- reading ---------------------------------------------------------------------------------

LONG_BYTES = 1 << 20
SLICE_BYTES = 1 << 18
_HIGH = (b"d8", b"d9", b"da", b"db")
_LOW = (b"dc", b"dd", b"de", b"df")


def loads(raw: bytes, **options: Any) -> Any:
    """Exactly `json.loads(raw, **options)` for UTF-8 JSON (parse_float, parse_int and
    parse_constant only), long string literals decoded in slices.

    `json.loads` of a 30 MB string holds the GIL for about 60 ms in one C call. Here the
    literals over `LONG_BYTES` are found in the bytes (in UTF-8 a `"` or `\\` byte is always
    that character, so the scan needs no decoding), the body without them is parsed as
    usual, and each one is decoded in slices of about `SLICE_BYTES`, cut between escapes
    (never inside one, nor between the two halves of an escaped surrogate pair) and
    between UTF-8 sequences; then the strings go back where their markers are. Invalid
    JSON still raises ValueError (the message may differ). Bodies without long literals,
    and any in another encoding, go to `json.loads` whole.
    """
    if len(raw) <= LONG_BYTES or json.detect_encoding(raw) != "utf-8":
        return json.loads(raw, **options)
    spans = _long_literals(raw)
    if not spans:
        return json.loads(raw, **options)
    nonce = secrets.token_hex(8).encode()
    parts: list[bytes] = []
    pos = 0
    for i, (a, b) in enumerate(spans):
        parts += [raw[pos : a - 1], b'"\\u0000recap-long-%s-%d"' % (nonce, i)]
        pos = b + 1
    parts.append(raw[pos:])
    skeleton = json.loads(b"".join(parts), **options)
    longs = {
        f"\x00recap-long-{nonce.decode()}-{i}": "".join(_decoded(raw, a, b))
        for i, (a, b) in enumerate(spans)
    }
    return _put_back(skeleton, longs)


def _long_literals(raw: bytes) -> list[tuple[int, int]]:
    """(first content byte, closing quote) of each string literal over LONG_BYTES."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while (start := raw.find(b'"', pos)) >= 0:
        end = raw.find(b'"', start + 1)
        while end >= 0 and _run(raw, start + 1, end) % 2:
            end = raw.find(b'"', end + 1)  # an escaped quote: the literal goes on
        if end < 0:
            return []  # unterminated: json.loads says so
        if end - start - 1 > LONG_BYTES:
            spans.append((start + 1, end))
        pos = end + 1
    return spans


def _run(raw: bytes, lo: int, at: int) -> int:
    """How many backslashes stand right before `at` (not before `lo`)."""
    n = 0
    width = 16
    while at > lo:
        part = raw[max(lo, at - width) : at]
        kept = len(part.rstrip(b"\\"))
        n += len(part) - kept
        if kept:
            break
        at -= len(part)
        width *= 2
    return n


def _decoded(raw: bytes, a: int, b: int) -> Iterable[str]:
    """The string literal raw[a:b] (its content, without quotes), slice by slice."""
    while b - a > SLICE_BYTES:
        cut = _cut(raw, a, a + SLICE_BYTES)
        yield json.loads(b'"' + raw[a:cut] + b'"')
        a = cut
    yield json.loads(b'"' + raw[a:b] + b'"')


def _cut(raw: bytes, lo: int, at: int) -> int:
    """A place near `at` (after `lo`) where the literal can be cut: not inside an escape,
    not between an escaped high and low surrogate, not inside a UTF-8 sequence."""
    start = at
    while at > lo and 0x80 <= raw[at] < 0xC0:
        at -= 1  # a continuation byte: back to the sequence's first byte
    if at == lo:
        at = start  # the slice's first character is longer than the slice: past it
        while 0x80 <= raw[at] < 0xC0:
            at += 1
    q = raw.rfind(b"\\", max(lo, at - 6), at)
    if q < 0:
        return at  # no escape reaches `at`
    if _run(raw, lo, q) % 2:
        return at  # q is the escaped half of a `\\`: that escape ends at q + 1 <= at
    # q starts an escape: `\X` or `\uXXXX`.
    end = q + (6 if raw[q + 1 : q + 2] == b"u" else 2)
    pair = raw[q + 1 : q + 2] == b"u" and raw[q + 2 : q + 4].lower() in _HIGH
    joined = pair and raw[end : end + 2] == b"\\u" and raw[end + 2 : end + 4].lower() in _LOW
    if end > at or (end == at and joined):
        at = q  # cut before this escape
        low = raw[q + 1 : q + 2] == b"u" and raw[q + 2 : q + 4].lower() in _LOW
        before = q - 6
        if (
            low
            and before >= lo
            and raw[before : before + 2] == b"\\u"
            and raw[before + 2 : before + 4].lower() in _HIGH
            and not _run(raw, lo, before) % 2
        ):
            at = before  # keep the pair together
    if at > lo:
        return at
    # Nothing to cut before: cut after this escape (and the low half of its pair).
    return end + 6 if joined else end


def _put_back(value: Any, longs: dict[str, str]) -> Any:
    if isinstance(value, str):
        return longs.get(value, value)
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | list | dict):
                value[i] = _put_back(item, longs)
        return value
    if isinstance(value, dict):
        if any(k in longs for k in value):
            return {longs.get(k, k): _put_back(v, longs) for k, v in value.items()}
        for k, v in value.items():
            if isinstance(v, str | list | dict):
                value[k] = _put_back(v, longs)
    return value
