"""benchmarks/roundtrips.py counts what a compacting turn awaits before it is forwarded."""

from __future__ import annotations

from pathlib import Path

from benchmarks.roundtrips import one_turn


def test_the_audit_writes_are_awaited_only_inline(tmp_path: Path) -> None:
    (tmp_path / "inline").mkdir()
    (tmp_path / "background").mkdir()
    inline = one_turn(tmp_path / "inline", True, "inline")
    background = one_turn(tmp_path / "background", False, "background")
    assert inline == [*background, "record_compaction", "append_event"]
    assert {"archive_messages", "conversation_lock", "add_summary_version"} <= set(background)
