"""`json.dumps` for values that hold very long strings, in slices a worker thread can share.

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
) -> str:
    """Exactly `json.dumps(value, ensure_ascii=..., separators=..., sort_keys=...)`."""
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
    nonce = secrets.token_hex(8)
    try:
        skeleton = _swap(value, longs, nonce)
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


def _marker(nonce: str, i: int) -> str:
    return f"\x00recap-long-{nonce}-{i}\x00"


def _swap(value: Any, longs: list[str], nonce: str) -> Any:
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
