"""Bounded counting (proxy.history.textcount): long runs split, huge texts sampled, counts kept."""

from __future__ import annotations

import pytest

from proxy.history.textcount import CHUNK_CHARS, chunks
from proxy.history.tokens import TokenCounter


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter()


def test_chunks_cover_the_text_in_order_and_cut_before_whitespace() -> None:
    text = ("word " * 1000) + "b" * 5000
    pieces = chunks(text, 0, len(text))
    assert "".join(text[a:b] for a, b in pieces) == text
    assert all(b - a <= CHUNK_CHARS for a, b in pieces)
    assert text[pieces[0][1]] == " "  # cut where the pre-tokenizer splits anyway


def test_pathological_text_costs_what_its_length_says(counter: TokenCounter) -> None:
    """Chunked and sampled counting agree with exact BPE where exact BPE is affordable."""
    exact = counter._resolve("gpt-4o")[1]
    assert exact is not None
    word = "a" * 200_000  # one piece: counted in chunks
    assert counter.count_text(word, "gpt-4o") == len(exact.encode_ordinary(word))
    prose = "Recap forwards every request and keeps what it archives. " * 20_000  # sampled
    true = len(exact.encode_ordinary(prose))
    assert abs(counter.count_text(prose, "gpt-4o") - true) <= true * 0.02
    chinese = "我们今天讨论一下如何压缩长对话的历史记录。" * 30_000
    true = len(exact.encode_ordinary(chinese))
    assert abs(counter.count_text(chinese, "gpt-4o") - true) <= true * 0.02
    assert counter.count_text(word * 150, "gpt-4o") > 3_000_000  # 30 MB: still counted


def test_huge_text_is_counted_the_same_every_time(counter: TokenCounter) -> None:
    """Deterministic, so a cached or re-counted history weighs the same on every request."""
    text = "x1y2 " * 300_000
    assert counter.count_text(text) == counter.count_text(text)
