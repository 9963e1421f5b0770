"""The per-conversation fingerprint cache: exact reuse, and bounded in what it holds."""

from __future__ import annotations

import pytest

from proxy.history.fingerprints import PER_MESSAGE_BYTES, FingerprintCache
from proxy.history.messages import chain_hashes, fingerprint, split_pinned
from proxy.store.base import ConversationRef

pytestmark = pytest.mark.quick


def _fresh(messages: list[dict[str, object]]) -> tuple[list[str], list[str]]:
    _, rest = split_pinned(messages)
    return [fingerprint(m) for m in messages], chain_hashes(rest)


def test_reuse_equals_hashing_from_scratch_through_growth_and_edits() -> None:
    cache = FingerprintCache()
    conv = ConversationRef("t", "c")
    history: list[dict[str, object]] = [{"role": "system", "content": "be brief"}]
    versions = []
    for n in range(6):
        history = [*history, {"role": "user", "content": f"q{n}"}]
        versions.append(history)
        history = [*history, {"role": "assistant", "content": f"a{n}"}]
    versions.append([*versions[-1][:3], {"role": "user", "content": "edited"}])
    versions.append([{"role": "developer", "content": "new pin"}, *versions[-1][1:]])
    for version in versions:
        ident = cache.identity(conv, version, "m")
        assert (ident.fingerprints, ident.chain) == _fresh(version)


def test_counts_are_reused_only_for_the_same_model() -> None:
    cache = FingerprintCache()
    conv = ConversationRef("t", "c")
    first = [{"role": "user", "content": "q"}]
    cache.identity(conv, first, "m")
    cache.remember_counts(conv, first, [7])
    longer = [*first, {"role": "assistant", "content": "a"}]
    assert cache.identity(conv, longer, "m").counts == [7]
    assert cache.identity(conv, [*longer], "other").counts == []


def test_conversations_gone_quiet_are_forgotten() -> None:
    """It holds each conversation's whole last request: ended conversations must go (after
    `idle_s`), not stay until its message bound, whatever size their messages are."""
    now = [0.0]
    cache = FingerprintCache(idle_s=120, clock=lambda: now[0])
    big = [{"role": "user", "content": "x" * 100_000}]
    for n in range(50):
        cache.identity(ConversationRef("t", f"ended-{n}"), big, "m")
    assert len(cache) == 50
    now[0] = 100.0
    cache.identity(ConversationRef("t", "active"), big, "m")
    now[0] = 200.0
    again = cache.identity(ConversationRef("t", "active"), [*big, *big], "m")
    assert len(cache) == 1  # only the conversation heard from in the last 120 s
    assert again.fingerprints == [fingerprint(m) for m in [*big, *big]]


def test_the_byte_bound_drops_the_least_recently_used() -> None:
    cache = FingerprintCache(max_bytes=10_000)
    four = [{"role": "user", "content": str(n)} for n in range(4)]
    for key in ("a", "b", "c"):
        cache.identity(ConversationRef("t", key), four, "m", size=4_000)
    assert len(cache) == 2 and cache.held_bytes == 8_000  # "a" went first
    cache.identity(ConversationRef("t", "b"), four, "m", size=4_000)
    cache.identity(ConversationRef("t", "d"), four, "m", size=4_000)
    assert len(cache) == 2  # "c" was the least recently used
    # Small bodies of many messages weigh their messages' overhead.
    cache.identity(ConversationRef("t", "e"), four * 5, "m", size=100)
    assert len(cache) == 2 and cache.held_bytes == 4_000 + 20 * PER_MESSAGE_BYTES


def test_fingerprints_cover_the_whole_message() -> None:
    """Messages that differ in any field the client sent are distinct; key order is not."""
    base = {"role": "assistant", "content": None}
    variants = [
        {**base, "refusal": "I can't do A."},
        {**base, "refusal": "I can't do B."},
        {**base, "audio": {"id": "audio_1"}},
        {**base, "audio": {"id": "audio_2"}},
        {**base, "content": "x", "reasoning_content": "THOUGHT-1"},
        {**base, "content": "x", "reasoning_content": "THOUGHT-2"},
        {**base, "content": "x"},
        {**base, "content": "x", "name": None},
        base,
    ]
    assert len({fingerprint(m) for m in variants}) == len(variants)
    assert fingerprint({"content": "x", "role": "user"}) == fingerprint(
        {"role": "user", "content": "x"}
    )
