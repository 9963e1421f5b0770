"""What a compaction item Codex holds expands to, once the store changed under it.

Real servers (tests/codex_servers.py). Codex keeps its item for good and sends it on every
later turn, so what it expands to must follow what the store holds now: a version rolled
back, a conversation pruned, a store that lost it, another conversation's item. The
reference names (conversation, version, boundary hash); all three are compared.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from proxy.app import create_app
from tests import codex_bodies as codex
from tests.codex_servers import (
    Recaps,
    Upstream,
    compact_v2,
    config,
    forwarded_inputs,
    running_upstream,
    turn,
)
from tests.fakes import Reply
from tests.servers import serve

SECRET = "s" * 40


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    with running_upstream() as running:
        yield running


@pytest.fixture
def recap(upstream: tuple[Upstream, str], tmp_path: Path) -> Iterator[Callable[..., str]]:
    with ExitStack() as stack:
        yield Recaps(upstream[1], tmp_path, stack)


def summaries_by_word(fake: Upstream) -> list[str]:
    """The summarizer answers SUMMARY-ONE, SUMMARY-TWO, ... (words: the guard strikes ids
    the input never held); returns the list of those made so far."""
    words = ("ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX")
    made: list[str] = []

    def summarize(body: dict[str, Any]) -> Reply:
        made.append(f"SUMMARY-{words[len(made)]}")
        return Reply(content=f"<summary>\n## User Goal\n{made[-1]}\n</summary>")

    fake.summarize = summarize
    return made


def reference(item: dict[str, Any]) -> dict[str, Any]:
    """The payload of a compaction item's reference (proxy/planning/reference.py)."""
    payload = item["encrypted_content"].split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def sent_text(fake: Upstream) -> str:
    """The last input forwarded upstream, as JSON text."""
    return json.dumps(forwarded_inputs(fake)[-1])


def test_a_version_of_the_same_number_with_another_boundary_is_not_expanded(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    """The boundary hash is compared: a store that lost the conversation and made a version 1
    of another history in it (same key, same deployment secret) does not answer the old item
    with the new summary."""
    fake, url = upstream
    made = summaries_by_word(fake)
    cfg = config(url, tmp_path, secret=SECRET)
    with serve(create_app(cfg)) as base:
        old = compact_v2(base + "/v1", codex.history())
    (tmp_path / "recap.db").unlink()
    other = codex.history() + codex.tool_round(30, "ls docs", "index.md")
    with serve(create_app(cfg)) as base:
        new = compact_v2(base + "/v1", other)
        assert made == ["SUMMARY-ONE", "SUMMARY-TWO"]
        # Both are version 1 of the same conversation: only the boundary tells them apart.
        assert reference(old) | {"h": ""} == reference(new) | {"h": ""}
        assert reference(old)["v"] == 1 and reference(old)["h"] != reference(new)["h"]
        r = turn(base + "/v1", codex.after_compaction(old, "go on"))
    assert "SUMMARY-TWO" not in json.dumps(forwarded_inputs(fake)), r.text[:300]
    assert fake.problems == []
