"""Tests for proxy.planning.budget: a summary's max_tokens and one call's transcript budget."""

from __future__ import annotations

import pytest

from proxy.planning.budget import (
    prompt_tokens,
    summary_max_tokens,
    summary_tokens,
    transcript_budget,
)

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(
    ("chars", "language", "scene", "window", "expected"),
    [
        (1200, "English", 2048, 16384, 544),  # 1200 / 3 x 1.2 + 64
        (1200, "Chinese", 2048, 16384, 1504),  # a character a token
        (1200, "Japanese", None, 16384, 1504),
        (6000, "English", 2048, 16384, 2048),  # the scene caps it
        (6000, "English", None, 16384, 2464),
        (6000, "English", None, 3000, 1500),  # half the window caps it
        (1, "English", None, 16384, 66),
    ],
)
def test_summary_max_tokens(
    chars: int, language: str, scene: int | None, window: int, expected: int
) -> None:
    assert summary_max_tokens(chars, language, scene, window) == expected


def test_a_summary_within_its_cap_is_never_cut_by_its_tokens() -> None:
    # English at 4 characters a token, the densest Chinese at one: both fit with room.
    for chars in (100, 1200, 6000):
        assert summary_max_tokens(chars, "English", None, 10**6) > chars / 4 * 1.2
        assert summary_max_tokens(chars, "Chinese", None, 10**6) > chars * 1.1
    assert summary_tokens(6000, "Korean") == 6000 and summary_tokens(6000, "") == 2000


def test_transcript_budget_leaves_room_for_everything_else() -> None:
    def weight(i: int) -> int:
        return 1

    budget = transcript_budget(16384, 2048, 900, 300, 2000, weight)
    room = 16384 - 2048 - 1639 - 900  # the window less output, margin and scene
    assert prompt_tokens(16384, 2048) == 16384 - 2048 - 1639
    assert (budget.first, budget.later) == (room - 300, room - 2000)
    assert (budget.limit(0), budget.limit(1), budget.limit(7)) == (room - 300,) + (room - 2000,) * 2
    # A summary so far larger than the most a new one can take is reserved as it is.
    assert transcript_budget(16384, 2048, 900, 2500, 2000, weight).later == room - 2500
    # Never below zero, however small the window.
    assert transcript_budget(2048, 1024, 5000, 0, 0, weight).first == 0
