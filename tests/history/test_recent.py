"""The recency map under the per-conversation caches: idle time and weight bound it."""

from __future__ import annotations

import pytest

from proxy.history.recent import RecentlyUsed

pytestmark = pytest.mark.quick


def test_entries_unused_for_idle_s_are_forgotten_and_use_keeps_them() -> None:
    now = [0.0]
    recent: RecentlyUsed[str, int] = RecentlyUsed(1_000, idle_s=60, clock=lambda: now[0])
    recent.put("kept", 1, 10)
    recent.put("quiet", 2, 10)
    for t in (30.0, 60.0, 90.0):
        now[0] = t
        assert recent.get("kept") == 1
    assert recent.get("quiet") is None
    assert len(recent) == 1 and recent.weight == 10


def test_weight_bound_drops_least_recently_used_but_never_the_last() -> None:
    recent: RecentlyUsed[str, str] = RecentlyUsed(100, idle_s=3600)
    recent.put("a", "a", 40)
    recent.put("b", "b", 40)
    recent.get("a")
    recent.put("c", "c", 40)  # 120 > 100: "b" was used least recently
    assert recent.get("b") is None and recent.get("a") == "a" and recent.weight == 80
    recent.put("huge", "huge", 500)
    assert len(recent) == 1 and recent.get("huge") == "huge"


def test_replacing_an_entry_reweighs_it() -> None:
    recent: RecentlyUsed[str, int] = RecentlyUsed(100, idle_s=3600)
    recent.put("a", 1, 30)
    recent.put("a", 2, 50)
    assert recent.weight == 50 and recent.pop("a") == 2 and recent.weight == 0
