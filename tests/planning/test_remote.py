"""The pure part of Codex remote compaction (proxy/planning/remote.py): which bodies ask for
it, what the summary guard reads of a huge message, which conversation an item belongs to,
and Recap's notes in place of a summary it does not show."""

from __future__ import annotations

import json

from proxy.planning.guard import constraint_sentences
from proxy.planning.remote import (
    GUARD_TEXT_CHARS,
    Holder,
    Unavailable,
    belongs,
    fork_parent,
    guard_view,
    may_hold_compaction,
    read_input,
    unavailable_item,
)


def test_the_cheap_look_finds_compaction_however_it_is_spelt() -> None:
    assert may_hold_compaction(b'{"input":[{"type":"compaction_trigger"}]}')
    escaped = b'{"input":[{"type":"c\\u006fmpaction_trigger"}]}'
    assert may_hold_compaction(escaped) and read_input(json.loads(escaped)["input"]).triggered
    # Ordinary bodies, non-ASCII text escaped or not, are not parsed a second time.
    assert not may_hold_compaction('{"input":"caf\\u00e9 – ok"}'.encode())
    assert not may_hold_compaction('{"input":"café"}'.encode())


def test_the_guard_reads_a_huge_texts_head_and_tail_in_whole_sentences() -> None:
    sentence = "Do not touch src/main.py at all. "
    text = "You must keep the tests green. " + sentence * 20_000 + "Never push to main."
    message = {
        "role": "user",
        "content": [{"type": "text", "text": text}],
        "tool_calls": [{"id": "c1", "function": {"name": "run", "arguments": "x. " * 50_000}}],
    }
    view = guard_view(message)
    seen = view["content"][0]["text"]
    assert len(seen) <= GUARD_TEXT_CHARS + 1
    assert seen.startswith("You must keep the tests green.")
    assert seen.endswith("Never push to main.")
    # Cut only where a sentence ends: every sentence the guard could quote is whole.
    whole = {s.strip() for s in constraint_sentences(text)}
    assert {s.strip() for s in constraint_sentences(seen)} <= whole
    assert len(view["tool_calls"][0]["function"]["arguments"]) <= GUARD_TEXT_CHARS + 1
    assert message["content"][0]["text"] == text  # the message itself is left alone
    # One unbroken run has no sentence to keep: nothing of it is read.
    assert guard_view({"role": "user", "content": "a" * 300_000})["content"].strip() == ""
    small = {"role": "user", "content": "Keep it short."}
    assert guard_view(small) == small


def test_an_item_belongs_to_its_conversation_a_codex_fork_of_it_or_no_named_one() -> None:
    assert belongs("s1", Holder("s1", named=True))
    assert not belongs("s1", Holder("s2", named=True))
    assert belongs("s1", Holder("s2", named=True, forked_from="s1"))
    assert not belongs("s1", Holder("s2", named=True, forked_from="s3"))
    assert belongs("auto-abc", Holder("auto-def", named=False))
    assert not belongs("s1", Holder("auto-def", named=False))
    assert not belongs("auto-abc", Holder("s2", named=True))


def test_the_fork_parent_is_read_from_codexs_turn_metadata() -> None:
    metadata = json.dumps({"session_id": "s2", "forked_from_thread_id": "s1"})
    assert fork_parent({"x-codex-turn-metadata": metadata}, {}) == "s1"
    body = {"client_metadata": {"x-codex-turn-metadata": metadata}}
    assert fork_parent({}, body) == "s1"
    assert fork_parent({"x-codex-turn-metadata": "{not json"}, {}) is None
    assert fork_parent({"x-codex-turn-metadata": json.dumps({"session_id": "s2"})}, {}) is None
    assert fork_parent({"x-codex-turn-metadata": json.dumps(["s1"])}, {}) is None


def test_recaps_notes_are_its_own_and_in_the_conversations_language() -> None:
    for why in Unavailable:
        english = unavailable_item(why, "English")
        assert english["role"] == "user" and english["content"][0]["text"].startswith("[Recap:")
        assert "recap-summary" not in json.dumps(english)  # it records no conversation
        chinese = unavailable_item(why, "Chinese")["content"][0]["text"]
        assert chinese.startswith("[Recap：")
