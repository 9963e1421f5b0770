"""The SQLite store's in-process summary cache: fresh answers, expiry, and a bound."""

from __future__ import annotations

import pytest

from proxy.store.base import ConversationRef
from proxy.store.cache import SummaryCache

pytestmark = pytest.mark.quick


def test_entries_expire_and_ended_conversations_do_not_accumulate() -> None:
    now = [0.0]
    cache = SummaryCache(ttl_s=2.0, clock=lambda: now[0])
    for n in range(100):
        cache.put(ConversationRef("t", f"c{n}"), [(1, 4, "h")], None)
    assert cache.get(ConversationRef("t", "c7")) == (((1, 4, "h"),), None)
    now[0] = 2.5
    assert cache.get(ConversationRef("t", "c7")) is None
    cache.put(ConversationRef("t", "new"), [], None)
    assert len(cache) == 1  # the expired ones went when a new one came


def test_a_refreshed_entry_expires_from_its_new_time() -> None:
    now = [0.0]
    cache = SummaryCache(ttl_s=2.0, clock=lambda: now[0])
    a, b = ConversationRef("t", "a"), ConversationRef("t", "b")
    cache.put(a, [], None)
    now[0] = 1.0
    cache.put(b, [], None)
    cache.put(a, [(2, 6, "x")], None)
    now[0] = 2.5
    assert cache.get(a) == (((2, 6, "x"),), None)
    assert cache.get(b) == ((), None)


def test_at_most_max_entries() -> None:
    cache = SummaryCache(ttl_s=60.0, max_entries=3)
    for n in range(5):
        cache.put(ConversationRef("t", f"c{n}"), [], None)
    assert len(cache) == 3
    assert cache.get(ConversationRef("t", "c0")) is None
    assert cache.get(ConversationRef("t", "c4")) is not None
