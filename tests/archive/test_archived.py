"""What the archive is known to hold: per conversation, and only for those in use."""

from __future__ import annotations

import pytest

from proxy.archive.archived import ArchivedIndex
from proxy.store.base import ConversationRef

pytestmark = pytest.mark.quick

A, B = ConversationRef("t", "a"), ConversationRef("t", "b")


def test_knowledge_is_per_conversation() -> None:
    index = ArchivedIndex()
    index.learn(A, ["f1", "f2"])
    assert set(index.known(A)) == {"f1", "f2"}
    assert not index.known(B)  # the same message in another conversation is its own row
    index.learn(A, ["f2", "f3"])
    assert len(index) == 3


def test_a_conversation_in_use_keeps_its_knowledge_and_a_quiet_one_loses_it() -> None:
    now = [0.0]
    index = ArchivedIndex(idle_s=300, clock=lambda: now[0])
    index.learn(A, ["old"])
    index.learn(B, ["b"])
    for t in range(100, 1000, 100):  # A asks on every request; B has gone quiet
        now[0] = float(t)
        assert "old" in index.known(A)
    index.learn(A, ["new"])
    assert not index.known(B)
    assert len(index) == 2


def test_knowledge_expires_after_ttl_even_in_use() -> None:
    """A prune by another process must not leave a conversation it deleted unarchived."""
    now = [0.0]
    index = ArchivedIndex(idle_s=300, ttl_s=3600, clock=lambda: now[0])
    index.learn(A, ["f1"])
    for t in range(200, 4000, 200):
        now[0] = float(t)
        index.known(A)
    assert not index.known(A)


def test_at_most_max_entries_least_recently_used_first() -> None:
    index = ArchivedIndex(max_entries=5)
    index.learn(A, ["a1", "a2", "a3"])
    index.learn(B, ["b1", "b2"])
    index.known(A)
    index.learn(ConversationRef("t", "c"), ["c1"])
    assert not index.known(B)  # B was used least recently
    assert set(index.known(A)) == {"a1", "a2", "a3"} and len(index) == 4
