"""The pre-compaction benchmark's check of what the upstream saw: it must catch a history that
lost, reordered or mixed messages (the newest message itself it cannot know: the proxy's
own tests check that), and pass what Recap may send."""

from __future__ import annotations

from pathlib import Path

from benchmarks.precompact import recap_config, text, valid
from proxy.config import load_config

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


def test_the_real_model_config_is_one_recap_accepts(tmp_path: Path) -> None:
    """`--real-model` points the tenant's summarizer at the model's server, one call at a
    time, with a timeout a minute-long summary fits in."""
    path = recap_config("http://127.0.0.1:1", tmp_path, "ahead", True, "http://127.0.0.1:2")
    summarizer = load_config(path).tenants["default"].summarizer
    assert summarizer.upstream is not None
    assert summarizer.upstream.base_url == "http://127.0.0.1:2/v1"
    assert (summarizer.max_concurrency, summarizer.timeout_s) == (1, 900)
    fake = load_config(recap_config("http://127.0.0.1:1", tmp_path, "sync", False))
    assert fake.tenants["default"].summarizer.upstream is None
