"""What a compaction item Codex holds expands to, once the store changed under it.

Real servers (tests/codex_servers.py). Codex keeps its item for good and sends it on every
later turn, so what it expands to must follow what the store holds now: a version rolled
back, a conversation pruned, a store that lost it, another conversation's item. The
reference names (conversation, version, boundary hash); all three are compared.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.planning.remote import (
    Unavailable,
    earlier_summary_item,
    summary_item,
    unavailable_item,
)
from tests import codex_bodies as codex
from tests.codex_servers import (
    Recaps,
    Upstream,
    compact_v2,
    config,
    config_data,
    forwarded_inputs,
    running_upstream,
    turn,
)
from tests.conftest import REPO
from tests.fakes import Reply
from tests.faults import wait_until
from tests.servers import recap_app, serve

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
    with serve(recap_app(cfg)) as base:
        old = compact_v2(base + "/v1", codex.history())
    (tmp_path / "recap.db").unlink()
    other = codex.history() + codex.tool_round(30, "ls docs", "index.md")
    with serve(recap_app(cfg)) as base:
        new = compact_v2(base + "/v1", other)
        assert made == ["SUMMARY-ONE", "SUMMARY-TWO"]
        # Both are version 1 of the same conversation: only the boundary tells them apart.
        assert reference(old) | {"h": ""} == reference(new) | {"h": ""}
        assert reference(old)["v"] == 1 and reference(old)["h"] != reference(new)["h"]
        r = turn(base + "/v1", codex.after_compaction(old, "go on"))
    assert "SUMMARY-TWO" not in json.dumps(forwarded_inputs(fake)), r.text[:300]
    assert fake.problems == []


def operator(config_file: Path, *args: str) -> str:
    """One `recap` command in its own process, as an operator runs it beside the server."""
    done = subprocess.run(
        [sys.executable, "-m", "proxy", *args, "--config", str(config_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_pruned_conversations_item_expands_to_a_note_before_and_after_a_restart(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    """`recap prune` deleted the conversation: its item is Recap's note that the earlier
    context is gone (not a 400 on every later turn, and not the deleted summary the server
    still had in memory), on the running server and after a restart; the session goes on."""
    fake, url = upstream
    made = summaries_by_word(fake)
    data = config_data(url, tmp_path, secret=SECRET)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(data))
    cfg = config(url, tmp_path, secret=SECRET)
    gone = unavailable_item(Unavailable.GONE, "English")
    item = None
    with serve(recap_app(cfg)) as base:
        item = compact_v2(base + "/v1", codex.history())
        assert turn(base + "/v1", codex.after_compaction(item, "go on")).status_code == 200
        assert "SUMMARY-ONE" in sent_text(fake)
        # Idle for over 0.00003 days (2.6 s)? Then the CLI prunes it, in its own process.
        assert wait_until(
            lambda: operator(config_file, "prune", "--older-than-days", "0.00003").startswith(
                "pruned 1 "
            ),
            timeout=60,
            step=0.5,
        )
        r = turn(base + "/v1", codex.after_compaction(item, "go on"))
        assert r.status_code == 200, r.text[:300]
        assert forwarded_inputs(fake)[-1][4] == gone
        assert "SUMMARY-ONE" not in sent_text(fake)
    with serve(recap_app(cfg)) as base:
        r = turn(base + "/v1", codex.after_compaction(item, "go on"), stream=False)
        assert r.status_code == 200, r.text[:300]
        assert forwarded_inputs(fake)[-1][4] == gone
        # The session compacts again, over the note: a new item, a new summary.
        again = compact_v2(base + "/v1", codex.after_compaction(item, "go on"))
        assert made[-1] == "SUMMARY-TWO"
        transcript = fake.summarizer_calls()[-1]["messages"][1]["content"]
        assert "SUMMARY-ONE" not in transcript
        assert turn(base + "/v1", codex.after_compaction(again, "and on")).status_code == 200
        assert "SUMMARY-TWO" in sent_text(fake)
    assert fake.problems == []


def test_an_item_from_a_store_that_lost_it_expands_to_the_same_note(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    """The store was replaced (same deployment secret): the item is valid, its summary is
    gone, as after a prune."""
    fake, url = upstream
    cfg = config(url, tmp_path, secret=SECRET)
    with serve(recap_app(cfg)) as base:
        item = compact_v2(base + "/v1", codex.history())
    (tmp_path / "recap.db").unlink()
    with serve(recap_app(cfg)) as base:
        r = turn(base + "/v1", codex.after_compaction(item, "go on"))
    assert r.status_code == 200, r.text[:300]
    assert forwarded_inputs(fake)[-1][4] == unavailable_item(Unavailable.GONE, "English")
    assert fake.problems == []


def rollback(base: str, version: int | None) -> None:
    r = httpx.post(
        f"{base}/recap/conversations/{codex.SESSION}/rollback",
        headers={"authorization": "Bearer key-a"},
        json={"version": version},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def stored_summary(base: str, version: int) -> str:
    r = httpx.get(
        f"{base}/recap/conversations/{codex.SESSION}",
        headers={"authorization": "Bearer key-a"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    (found,) = [v for v in r.json()["versions"] if v["version"] == version]
    return str(found["summary"])


def test_a_rolled_back_version_is_never_expanded_again(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    """An operator rolled the conversation back past the item Codex holds: the item brings
    the version the operator kept (with Recap's note that it is an earlier one), or, rolled
    back to none, Recap's note that the summary was withdrawn; never the withdrawn text, in
    a turn or folded into a new compaction. Naming the version again brings it back."""
    fake, _ = upstream
    made = summaries_by_word(fake)
    base = recap()
    first = compact_v2(base, codex.history())
    later = codex.after_compaction(first, "Now also run the linter")
    later += codex.tool_round(21, "ruff check src", "src/parser.py:3:1 F401 unused import")
    second = compact_v2(base, later)
    assert made == ["SUMMARY-ONE", "SUMMARY-TWO"]
    kept = stored_summary(base, 1)

    rollback(base, 1)
    assert turn(base, codex.after_compaction(second, "go on")).status_code == 200
    assert forwarded_inputs(fake)[-1][4] == earlier_summary_item(kept, "English")
    assert "SUMMARY-TWO" not in sent_text(fake)
    # The version kept expands as it always did.
    assert turn(base, codex.after_compaction(first, "go on")).status_code == 200
    assert forwarded_inputs(fake)[-1][4] == summary_item(kept, "English")
    # A compaction over the rolled-back item folds the kept version, not the withdrawn one.
    compact_v2(base, codex.after_compaction(second, "go on"))
    transcript = fake.summarizer_calls()[-1]["messages"][1]["content"]
    assert "SUMMARY-ONE" in transcript and "SUMMARY-TWO" not in transcript

    rollback(base, None)
    withdrawn = unavailable_item(Unavailable.WITHDRAWN, "English")
    for item in (first, second):
        assert turn(base, codex.after_compaction(item, "go on")).status_code == 200
        assert forwarded_inputs(fake)[-1][4] == withdrawn
        assert "SUMMARY-" not in sent_text(fake)

    rollback(base, 2)  # an operator's explicit choice: version 2 is in use again
    assert turn(base, codex.after_compaction(second, "go on")).status_code == 200
    assert forwarded_inputs(fake)[-1][4] == summary_item(stored_summary(base, 2), "English")
    assert fake.problems == []


def forked_from(parent: str) -> dict[str, str]:
    """The turn metadata of a thread made by `codex fork` (as Codex 0.171 sends it)."""
    metadata = {**codex.metadata("turn"), "history_initialization": "cold_fork"}
    return {"x-codex-turn-metadata": json.dumps({**metadata, "forked_from_thread_id": parent})}


def test_an_item_expands_only_in_its_own_conversation_or_a_fork_of_it(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    """The item names its conversation; in another one of the same tenant it is Recap's note
    (its summary is neither forwarded nor folded there), unless that conversation says it is
    a Codex fork of the item's."""
    fake, _ = upstream
    made = summaries_by_word(fake)
    base = recap()
    item = compact_v2(base, codex.history())
    foreign = unavailable_item(Unavailable.FOREIGN, "English")
    other = "01a231c1-ffff-7f53-9237-0ef3b245fc0d"

    assert turn(base, codex.after_compaction(item, "go on"), session=other).status_code == 200
    assert forwarded_inputs(fake)[-1][4] == foreign
    compact_v2(base, codex.after_compaction(item, "go on"), session=other)
    assert made[-1] == "SUMMARY-TWO"
    assert "SUMMARY-ONE" not in fake.summarizer_calls()[-1]["messages"][1]["content"]
    # A fork of another conversation is not a fork of this one.
    r = turn(base, codex.after_compaction(item, "go on"), session=other, extra=forked_from(other))
    assert r.status_code == 200 and forwarded_inputs(fake)[-1][4] == foreign

    # `codex fork`: a new session whose metadata names the item's.
    forked = forked_from(codex.SESSION)
    r = turn(base, codex.after_compaction(item, "go on"), session=other, extra=forked)
    assert r.status_code == 200
    assert "SUMMARY-ONE" in json.dumps(forwarded_inputs(fake)[-1][4])
    # Its own conversation, as always.
    assert turn(base, codex.after_compaction(item, "go on")).status_code == 200
    assert "SUMMARY-ONE" in json.dumps(forwarded_inputs(fake)[-1][4])
    assert fake.problems == []


def test_a_client_naming_no_conversation_keeps_its_items(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    """No session header, no prompt_cache_key: Recap derives the key, and the item expands
    on the next turn (a derived key is the only identity there is); a named conversation
    still does not take it."""
    fake, _ = upstream
    summaries_by_word(fake)
    base = recap()
    item = compact_v2(base, codex.history(), session=None)
    assert turn(base, codex.after_compaction(item, "go on"), session=None).status_code == 200
    assert "SUMMARY-ONE" in json.dumps(forwarded_inputs(fake)[-1][4])
    assert turn(base, codex.after_compaction(item, "go on")).status_code == 200
    assert forwarded_inputs(fake)[-1][4] == unavailable_item(Unavailable.FOREIGN, "English")
