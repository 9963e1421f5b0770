"""proxy.wire.longjson writes exactly what json.dumps writes, long strings included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.history.messages import fingerprint
from proxy.wire import longjson
from proxy.wire.longjson import LONG_CHARS

TEXT = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from('"\\\n\x01\ud800'))
VALUES: Any = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def tiny_slices() -> Iterator[None]:
    # Small limits so that generated values have "long" strings cut in many slices.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(longjson, "LONG_CHARS", 3)
        mp.setattr(longjson, "SLICE_CHARS", 2)
        yield


@settings(max_examples=300, deadline=None)
@given(value=VALUES, ensure_ascii=st.booleans(), sort_keys=st.booleans(), compact=st.booleans())
def test_same_text_as_json_dumps(
    tiny_slices: None, value: Any, ensure_ascii: bool, sort_keys: bool, compact: bool
) -> None:
    separators = (",", ":") if compact else None
    options: dict[str, Any] = {
        "ensure_ascii": ensure_ascii,
        "sort_keys": sort_keys,
        "separators": separators,
    }
    assert longjson.dumps(value, **options) == json.dumps(value, **options)


@pytest.mark.quick
def test_fingerprint_of_a_huge_message_is_the_plain_sha256() -> None:
    import hashlib

    message = {"role": "user", "content": "é" * (longjson.LONG_CHARS + 5) + '"'}
    canonical = json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert fingerprint(message) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# -- loads -------------------------------------------------------------------------------------

# Characters that make cutting hard: escapes of every length, surrogate pairs (escaped as
# two \u escapes), lone surrogates, and multi-byte UTF-8.
HARD = st.text(
    alphabet=st.sampled_from(
        ["a", "é", "中", "😀", '"', "\\", "\n", "\x01", "\ud800", "\udc00", " "]
    )
)
LOADABLE: Any = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | HARD,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(HARD, inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def tiny_reads() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(longjson, "LONG_BYTES", 4)
        mp.setattr(longjson, "SLICE_BYTES", 3)
        yield


@settings(max_examples=500, deadline=None)
@given(value=LOADABLE, ensure_ascii=st.booleans())
def test_loads_gives_what_json_loads_gives(
    tiny_reads: None, value: Any, ensure_ascii: bool
) -> None:
    raw = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    expected = json.loads(raw)
    got = longjson.loads(raw)
    # Compared as text too: == would not tell a surrogate pair from the character it encodes.
    assert got == expected
    assert json.dumps(got) == json.dumps(expected)


@pytest.mark.quick
def test_loads_passes_the_number_hooks_on(tiny_reads: None) -> None:
    raw = b'{"t": 0.30, "n": 7, "s": "' + b"x" * 20 + b'"}'
    got = longjson.loads(raw, parse_float=lambda t: ("float", t), parse_int=lambda t: ("int", t))
    assert got == {"t": ("float", "0.30"), "n": ("int", "7"), "s": "x" * 20}


@pytest.mark.quick
@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "' + b"x" * 20 + b'\\q"}',  # an invalid escape inside a long literal
        b'{"a": "' + b"x" * 20,  # unterminated
        b'{"a": "' + b"x" * 20 + b'\x01"}',  # a raw control character
        b'{"a": "' + b"x" * 20 + b'\xff"}',  # not UTF-8
        b'{"a": "' + b"x" * 20 + b'" "b": 1}',  # invalid outside the literal
    ],
)
def test_loads_rejects_what_json_loads_rejects(tiny_reads: None, raw: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(ValueError):
        longjson.loads(raw)


@pytest.mark.quick
def test_a_huge_literal_is_decoded_in_slices() -> None:
    # The real limits: a 3 MB literal of escaped pairs and multi-byte text comes back whole.
    text = ('😀中\n"a' * (3 * longjson.LONG_BYTES // 12))[: 3 * longjson.LONG_BYTES // 4]
    for ensure_ascii in (True, False):
        raw = json.dumps({"messages": [{"content": text}]}, ensure_ascii=ensure_ascii).encode()
        assert longjson._long_literals(raw), "the literal counts as long"
        assert longjson.loads(raw) == {"messages": [{"content": text}]}


@pytest.mark.quick
def test_parsed_from_gives_the_same_text_with_or_without_the_walk() -> None:
    value = {"b": ["x" * 100, {"c": 1.5, "d": None}], "a": "\u4e2d\u6587"}
    expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for size in (None, 10, LONG_CHARS, LONG_CHARS + 1):
        out = longjson.dumps(value, ensure_ascii=False, separators=(",", ":"), parsed_from=size)
        assert out == expected
