"""proxy.longjson writes exactly what json.dumps writes, long strings included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import longjson
from proxy.messages import fingerprint

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


def test_fingerprint_of_a_huge_message_is_the_plain_sha256() -> None:
    import hashlib

    message = {"role": "user", "content": "é" * (longjson.LONG_CHARS + 5) + '"'}
    canonical = json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert fingerprint(message) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()
