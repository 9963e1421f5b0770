"""The last forwarded request per conversation: given back only to a history that holds
the one it was made from, and bounded."""

from __future__ import annotations

import pytest

from proxy.planning.riding import Forwarded
from proxy.stages.forwarded import LastForwarded
from proxy.store.base import ConversationRef

pytestmark = pytest.mark.quick


def conv(key: str) -> ConversationRef:
    return ConversationRef("default", key)


def sent(size: int = 10) -> Forwarded:
    return Forwarded("chat", b"x" * size, (), pinned=0)


def test_a_history_that_extends_the_kept_one_gets_it_and_no_other_does() -> None:
    kept = LastForwarded()
    first = sent()
    kept.keep(conv("c1"), first, ["h1", "h2", "h3"])
    assert kept.get(conv("c1"), ["h1", "h2", "h3", "h4", "h5"]) is first
    assert kept.get(conv("c1"), ["h1", "h2", "h3"]) is first
    assert kept.get(conv("c1"), ["h1", "h2"]) is None  # shorter: it does not hold it
    assert kept.get(conv("c1"), ["h1", "h2", "x3", "h4"]) is None  # edited or forked
    assert kept.get(conv("c2"), ["h1", "h2", "h3"]) is None


def test_it_keeps_at_most_its_entries_and_bytes_the_oldest_dropped_first() -> None:
    kept = LastForwarded(max_entries=2, max_bytes=25)
    for key in ("a", "b", "c"):
        kept.keep(conv(key), sent(10), [key])
    assert len(kept) == 2 and kept.get(conv("a"), ["a"]) is None
    kept.keep(conv("d"), sent(20), ["d"])  # 10 + 20 > 25: "b" and "c" go
    assert len(kept) == 1 and kept.get(conv("d"), ["d"]) is not None
    kept.keep(conv("e"), sent(26), ["e"])  # larger than the bound: not kept at all
    assert kept.get(conv("e"), ["e"]) is None
