"""The pre-compaction benchmark's check of what the upstream saw: it must catch a history that
lost, reordered or mixed messages (the newest message itself it cannot know: the proxy's
own tests check that), and pass what Recap may send."""

from __future__ import annotations

from benchmarks.precompact import text, valid

SYSTEM = {"role": "system", "content": "You are a travel agent."}
SUMMARY = {"role": "system", "content": "Earlier: <recap-summary>...</recap-summary>"}


def turns(c: int, first: int, last: int) -> list[dict[str, str]]:
    out = []
    for i in range(first, last + 1):
        out.append({"role": "user", "content": text(c, "u", i, 3)})
        if i < last:
            out.append({"role": "assistant", "content": text(c, "a", i, 3)})
    return out


def test_the_client_history_and_a_summarised_one_are_valid() -> None:
    assert valid([SYSTEM, *turns(1, 0, 5)])
    assert valid([SYSTEM, SUMMARY, *turns(1, 3, 5)])


def test_a_gap_a_lost_newest_message_or_another_conversation_is_caught() -> None:
    history = turns(1, 0, 5)
    assert not valid([SYSTEM, *history[:3], *history[5:]])  # a turn dropped silently
    assert not valid([SYSTEM, *history[:-1]])  # ends with an answer, not a user turn
    assert not valid([SYSTEM, *history[:-1], turns(2, 5, 5)[0]])  # another conversation's
    assert not valid(history)  # no system message
    assert not valid([SYSTEM, SUMMARY, SUMMARY, *turns(1, 3, 5)])
