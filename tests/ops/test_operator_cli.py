"""The operator's `recap` commands, run against the store a live proxy is writing."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.config import load_config
from proxy.ops.cli import main
from proxy.ops.tail import tail
from proxy.store import open_store
from proxy.store.base import ConversationRef, NewSummary
from tests.fakes import FakeUpstream, Reply
from tests.servers import recap_app, serve
from tests.trajectories import DATA, chained, model_calls, sessions

pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")


def write_config(tmp_path: Path, upstream_url: str, **extra: Any) -> Path:
    session = {"recent_turns": 2, "min_recent_ratio": 0.01}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "store": "sqlite:///./recap.db",
                "tenants": {
                    name: {
                        "api_keys": [f"key-{name}"],
                        "upstream": {"base_url": upstream_url + "/v1"},
                        "compaction": {"session": session},
                    }
                    for name in ("a", "b")
                },
                **extra,
            }
        )
    )
    return cfg


@pytest.fixture
def live(tmp_path: Path, upstream_url: str) -> Iterator[tuple[Path, str]]:
    """A config file and a proxy serving it; two conversations, one compacted."""
    cfg = write_config(tmp_path, upstream_url)
    with serve(recap_app(load_config(cfg))) as base:
        url = base + "/v1"
        convo = chained(sessions()[:2])
        i = list(model_calls(convo))[-1]
        for tenant, key, control in (("a", "trip", "force"), ("b", "other", "auto")):
            r = httpx.post(
                f"{url}/chat/completions",
                json={"model": "m", "messages": convo[:i]},
                headers={
                    "authorization": f"Bearer key-{tenant}",
                    "x-conversation-id": key,
                    "x-recap-compaction": control,
                },
                timeout=60,
            )
            assert r.status_code == 200
        # The server stores journaled records in batches; an operator route stores what is
        # queued before it reads, so after it the CLI beside the server sees everything.
        r = httpx.get(f"{url}/recap/conversations", headers={"authorization": "Bearer key-a"})
        assert r.status_code == 200
        yield cfg, url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_conversations_show_and_export(
    live: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, url = live
    code, out, _ = run(capsys, "conversations", "--config", str(cfg))
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["UPDATED", "TENANT", "KEY"]
    assert sorted(r.split()[2:4] for r in rows) == [["a", "trip"], ["b", "other"]]
    code, out, _ = run(capsys, "conversations", "--config", str(cfg), "--tenant", "a", "--json")
    assert [c["key"] for c in json.loads(out)["data"]] == ["trip"]

    code, out, _ = run(capsys, "show", "trip", "--tenant", "a", "--config", str(cfg))
    assert code == 0
    assert "conversation  a / trip" in out
    assert "summary       v1: covers" in out and "## User Goal" in out
    assert "* v1" in out and "manual" in out and "forced" not in out
    # Several tenants and none named: a clear refusal.
    code, _, err = run(capsys, "show", "trip", "--config", str(cfg))
    assert code == 1 and "name one with --tenant (a, b)" in err
    code, _, err = run(capsys, "show", "nope", "--tenant", "a", "--config", str(cfg))
    assert code == 1 and "No conversation 'nope'" in err
    code, _, err = run(capsys, "conversations", "--tenant", "zz", "--config", str(cfg))
    assert code == 1 and err.strip() == "recap: no tenant 'zz' in the config"

    # The export from the CLI is the export the API streams, line for line.
    def api_lines() -> list[str]:
        r = httpx.get(
            f"{url}/recap/conversations/trip/archive", headers={"authorization": "Bearer key-a"}
        )
        return r.text.splitlines()

    code, out, _ = run(
        capsys, "export", "--conversation", "trip", "--tenant", "a", "--config", str(cfg)
    )
    assert code == 0
    lines = out.splitlines()
    assert lines == api_lines()
    kinds = [json.loads(x)["type"] for x in lines]
    assert kinds[0] == "conversation" and kinds[-1] == "end"
    assert {"message", "request", "manual_compact", "summary"} <= set(kinds)
    target = cfg.parent / "out.jsonl"
    code, _, _ = run(
        capsys,
        "export",
        "--conversation",
        "trip",
        "--tenant",
        "a",
        "--config",
        str(cfg),
        "-o",
        str(target),
    )
    assert code == 0 and target.read_text().splitlines() == lines


def test_compact_prints_the_summary_or_fails_loudly(
    live: tuple[Path, str], capsys: pytest.CaptureFixture[str], fake: FakeUpstream
) -> None:
    cfg, url = live
    code, out, err = run(capsys, "compact", "other", "--tenant", "b", "--config", str(cfg))
    assert code == 0, err
    first, *summary = out.splitlines()
    assert first.startswith("compacted b / other: summary v1 covers ")
    assert summary[0] == "## User Goal"
    detail = httpx.get(
        f"{url}/recap/conversations/other", headers={"authorization": "Bearer key-b"}
    ).json()
    assert detail["summary"]["version"] == 1
    assert [c["layer"] for c in detail["compactions"]] == ["manual"]

    fake.summarize = lambda body: Reply(status=500)
    with sqlite3.connect(cfg.parent / "recap.db") as db:
        db.execute("UPDATE conversations SET current_version = NULL WHERE key = 'other'")
    code, out, err = run(capsys, "compact", "other", "--tenant", "b", "--config", str(cfg))
    assert code == 1 and out == ""
    assert err.strip() == "recap: Compaction failed: upstream status 500."
    code, _, err = run(capsys, "compact", "nope", "--tenant", "b", "--config", str(cfg))
    assert code == 1 and "No archived request for conversation 'nope'" in err


def test_prune_deletes_whole_idle_conversations(
    tmp_path: Path, upstream_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, upstream_url, archive={"retention_days": 30})
    old = ConversationRef("a", "old")
    fresh = ConversationRef("a", "fresh")
    now = [time.time() - 40 * 86400]

    async def seed() -> None:
        store = open_store("sqlite:///./recap.db", str(tmp_path), clock=lambda: now[0])
        async with store:
            for conv in (old, fresh):
                await store.archive_messages(conv, [("fp", '{"role":"user","content":"x"}')])
                await store.append_event(conv, "request", {"messages": ["fp"]})
                await store.add_summary_version(conv, NewSummary("s", 1, "h", 1, 1, "m", "forced"))
            # Both were written 40 days ago; `fresh` is touched again today.
            now[0] = time.time()
            await store.append_event(fresh, "response", {})

    asyncio.run(seed())
    code, out, _ = run(capsys, "prune", "--config", str(cfg))
    assert code == 0 and out.strip() == "pruned 1 conversation(s) idle for over 30 day(s)"
    with sqlite3.connect(tmp_path / "recap.db") as db:
        for table in ("conversations", "messages", "events", "summary_versions"):
            keys = {k for (k,) in db.execute(f"SELECT key FROM {table}")}
            assert keys == {"fresh"}, table
    code, out, _ = run(capsys, "prune", "--config", str(cfg), "--older-than-days", "100")
    assert code == 0 and out.strip() == "pruned 0 conversation(s) idle for over 100 day(s)"


@pytest.mark.parametrize("days", ["0", "-1", "nan", "soon"])
def test_prune_refuses_zero_days_with_the_reason(
    tmp_path: Path, upstream_url: str, capsys: pytest.CaptureFixture[str], days: str
) -> None:
    """Zero is not "keep forever" (the config's 0) said on the command line, nor a way to
    delete everything: it would also take conversations in use. Exit 2, bad arguments."""
    cfg = write_config(tmp_path, upstream_url, archive={"retention_days": 30})
    with pytest.raises(SystemExit) as exit_:
        main(["prune", "--config", str(cfg), "--older-than-days", days])
    assert exit_.value.code == 2
    _, err = capsys.readouterr()
    assert "--older-than-days" in err
    assert ("must be more than 0 days" if days != "soon" else "expected a number of days") in err
    assert not (tmp_path / "recap.db").exists()  # refused before the store was opened


def test_prune_with_retention_zero_says_what_to_do(
    tmp_path: Path, upstream_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, upstream_url)  # archive.retention_days: 0 (the default)
    code, out, _ = run(capsys, "prune", "--config", str(cfg))
    assert code == 0
    assert "retention_days is 0 (keep forever): nothing pruned" in out
    assert "--older-than-days N" in out


def test_commands_end_quietly_when_the_reader_leaves(tmp_path: Path, upstream_url: str) -> None:
    """`recap conversations | head -1`: the reader closes the pipe; no traceback."""
    cfg = write_config(tmp_path, upstream_url)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "proxy", "conversations", "--tenant", "a", "--config", str(cfg)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 141  # as a process killed by SIGPIPE (`yes | head -1`)


def test_tail_shows_compactions_inline() -> None:
    record = {
        "ts": "2026-12-01T10:00:00.000Z",
        "level": "info",
        "logger": "recap.access",
        "request_id": "r1",
        "tenant": "acme",
        "conversation": "trip",
        "model": "gpt-4o",
        "status": 200,
        "session_trigger": "context_ratio",
        "session_batches": 1,
        "compacted_messages": 40,
        "summary_version": 3,
        "compaction_ms": 812,
        "loop_trigger": "tool_rounds",
        "loop_failure": "timeout",
        "trimmed_results": 2,
        "trimmed_chars_saved": 9000,
        "tokens_before": 12000,
        "input_tokens": 4000,
    }
    plain = {"ts": 2, "level": "info", "logger": "recap.access", "tenant": "acme", "status": 200}
    out = io.StringIO()
    tail(io.StringIO(json.dumps(record) + "\n" + json.dumps(plain) + "\n"), out)
    day, *lines = out.getvalue().splitlines()
    assert day.startswith("-- 2026-12-01") or day.startswith("-- 2026-11-30")  # the zone's date
    lines = [line for line in lines if not line.startswith("-- ")]  # 1970's, for `plain`
    assert "acme/trip" in lines[0] and "gpt-4o" in lines[0]
    assert "12,000 \u2192 4,000 tok \u221267%" in lines[0]
    assert "session v3+trim+FAILED" in lines[0]
    assert [line.split("\u21b3 ")[1] for line in lines[1:4]] == [
        "session  context near full: 40 messages \u2192 summary v3, 812 ms",
        "loop     FAILED, timeout, sent as it came",
        "trim     2 tool results trimmed, 9,000 chars saved",
    ]
    assert lines[4].split()[1:] == ["200", "acme"] and len(lines) == 5


def test_store_commands_need_no_secret_of_the_server(
    live: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's shell has the store but not the server's upstream and admin keys: the
    commands that only use the store read what they need and leave the rest unresolved."""
    cfg, _ = live
    data = yaml.safe_load(cfg.read_text())
    for tenant in data["tenants"].values():
        tenant["upstream"] = {"base_url": "${RECAP_TEST_UP}/v1", "api_key": "${RECAP_TEST_KEY}"}
    data["admin_keys"] = ["${RECAP_TEST_ADMIN_KEY}"]
    shell = cfg.parent / "shell.yaml"  # beside the server's: the same store file
    shell.write_text(yaml.safe_dump(data))
    assert not {"RECAP_TEST_UP", "RECAP_TEST_KEY", "RECAP_TEST_ADMIN_KEY"} & set(os.environ)
    for argv in (
        ["conversations"],
        ["show", "trip", "--tenant", "a"],
        ["export", "--conversation", "trip", "--tenant", "a"],
        ["prune", "--older-than-days", "3650"],
        ["rollback", "trip", "1", "--tenant", "a"],
    ):
        code, _, err = run(capsys, *argv, "--config", str(shell))
        assert code == 0, (argv, err)
    # A command that calls the summarizer needs its upstream, and says which variable is unset.
    code, _, err = run(capsys, "compact", "trip", "--tenant", "a", "--config", str(shell))
    assert code == 2 and "${RECAP_TEST_KEY} is not set" in err
    # What a store command reads is still checked.
    data["store_pool"] = {"max_size": 0}
    shell.write_text(yaml.safe_dump(data))
    code, _, err = run(capsys, "conversations", "--config", str(shell))
    assert code == 2 and "store_pool.max_size" in err


def test_rollback_from_the_cli_marks_the_later_versions(
    live: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`recap rollback` does what POST .../rollback does; `recap show` then marks the
    versions the rollback discarded, as the JSON detail does (`rolled_back`)."""
    cfg, url = live

    async def second_version() -> None:  # as a later compaction would have made it
        async with open_store("sqlite:///./recap.db", str(cfg.parent)) as store:
            await store.add_summary_version(
                ConversationRef("a", "trip"), NewSummary("later", 2, "h", 1, 1, "m", "manual")
            )

    asyncio.run(second_version())
    code, out, err = run(capsys, "rollback", "trip", "1", "--tenant", "a", "--config", str(cfg))
    assert code == 0, err
    assert out.splitlines()[0] == "rolled back a / trip: summary v2 \u2192 v1"
    detail = httpx.get(
        f"{url}/recap/conversations/trip", headers={"authorization": "Bearer key-a"}
    ).json()
    assert detail["current_version"] == 1
    assert [(v["version"], v["rolled_back"]) for v in detail["versions"]] == [(1, False), (2, True)]
    assert detail["summary"]["version"] == 1

    code, out, _ = run(capsys, "show", "trip", "--tenant", "a", "--config", str(cfg))
    rows = {line[2:4]: line for line in out.splitlines() if line[2:4] in ("v1", "v2")}
    assert rows["v1"].startswith("* v1") and "rolled back" not in rows["v1"]
    assert rows["v2"].startswith("  v2") and rows["v2"].endswith("rolled back")

    # To none, then an unknown version: exit 1 with the API's message.
    code, out, _ = run(capsys, "rollback", "trip", "none", "--tenant", "a", "--config", str(cfg))
    assert code == 0 and out.splitlines()[0] == "rolled back a / trip: summary v1 \u2192 none"
    code, out, _ = run(capsys, "show", "trip", "--tenant", "a", "--config", str(cfg))
    assert "summary       none (rolled back)" in out
    code, _, err = run(capsys, "rollback", "trip", "9", "--tenant", "a", "--config", str(cfg))
    assert code == 1 and "No summary version 9" in err
    with pytest.raises(SystemExit) as exit_:
        main(["rollback", "trip", "soon", "--tenant", "a", "--config", str(cfg)])
    assert exit_.value.code == 2
