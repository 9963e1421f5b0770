"""Claude Code itself, end to end: `claude -p` with Recap as its ANTHROPIC_BASE_URL, in front
of a fake Messages upstream (tests/fake_messages.py) whose prompt limit the task's
uncompacted history exceeds.

Skipped when `claude` (npm `@anthropic-ai/claude-code`, checked with 2.1.332; .ci/run
installs it) is not on PATH. It runs offline: a fresh HOME, an API key the fake takes,
the variables that switch off its telemetry, error reports and updates, and its own
auto-compaction off (`DISABLE_AUTO_COMPACT`), so the history is Recap's to keep in
bounds. The fake answers every turn with the next `Read` of twenty files (its progress
read from the last tool result, which compaction keeps), each answer opening with a
signed thinking block, and answers 400 "prompt is too long" over its limit, as Anthropic
does. The control runs the same task straight at the fake: Claude Code ends with
"Prompt is too long".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from proxy.app import create_app
from proxy.config import parse_config
from proxy.planning.claude_code import OPENING
from proxy.planning.framing import FRAME_OPEN
from tests.conftest import LogCapture
from tests.fake_messages import Answer, FakeMessages, error_body
from tests.servers import serve

CLAUDE = shutil.which("claude")
# Against a hang only; a run takes some seconds.
HANG_S = 300
MODEL = "claude-sonnet-4-5"
FILES = 20
# Claude Code's system prompt and tools weigh about 22,000 of the fake's tokens; twenty
# files of about 1,450 each take the history past the limit.
LIMIT = 40_000


def prompt_tokens(fake: FakeMessages, body: dict[str, Any]) -> int:
    return sum(fake.count(json.dumps(body.get(k))) for k in ("messages", "system", "tools"))


def fake_for(work: Path) -> FakeMessages:
    fake = FakeMessages(strict=False)  # Claude Code itself sends two user messages in a row

    def respond(body: dict[str, Any]) -> Answer:
        n = prompt_tokens(fake, body)
        if n > LIMIT:
            return Answer(
                status=400, error=error_body(f"prompt is too long: {n} tokens > {LIMIT} maximum")
            )
        last = body["messages"][-1]["content"]
        results = (
            [b for b in last if b.get("type") == "tool_result"] if isinstance(last, list) else []
        )
        if not results and "Read every file" not in json.dumps(last):
            return Answer(text="I read the files.")
        read = re.findall(r"file (\d+) line 0:", json.dumps(results))
        done = int(read[-1]) + 1 if read else 0
        if done < FILES:
            path = str(work / f"f{done:02d}.txt")
            return Answer(
                text=f"Reading file {done}.",
                thinking=f"Next: {path}.",
                calls=[("Read", {"file_path": path})],
            )
        return Answer(text=f"DONE: read {done} files.")

    fake.respond = respond
    return fake


def claude(base: str, home: Path, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CLAUDE is not None
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "sk-test",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_AUTO_COMPACT": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4000",
    }
    return subprocess.run(
        [CLAUDE, *args, "--model", MODEL, "--allowedTools", "Read", "--output-format", "text"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )


TASK = f"Read every file f00.txt to f{FILES - 1:02d}.txt here, one at a time, then say DONE."


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path]:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    for k in range(FILES):
        lines = (f"file {k} line {j}: value_{k}_{j}" for j in range(160))
        (work / f"f{k:02d}.txt").write_text("\n".join(lines))
    return work, home


@pytest.mark.skipif(CLAUDE is None, reason="claude (npm @anthropic-ai/claude-code) is not on PATH")
def test_without_recap_the_task_ends_with_prompt_is_too_long(workspace: tuple[Path, Path]) -> None:
    work, home = workspace
    fake = fake_for(work)
    with serve(fake.app) as upstream:
        run = claude(upstream, home, work, "-p", TASK)
    assert run.returncode == 1 and "Prompt is too long" in run.stdout, run.stdout + run.stderr


@pytest.mark.skipif(CLAUDE is None, reason="claude (npm @anthropic-ai/claude-code) is not on PATH")
def test_claude_code_finishes_a_long_task_and_compacts_through_recap(
    workspace: tuple[Path, Path], tmp_path: Path, logs: LogCapture
) -> None:
    work, home = workspace
    fake = fake_for(work)
    with serve(fake.app) as upstream:
        config = parse_config(
            {
                "store": f"sqlite:///{tmp_path / 'recap.db'}",
                "models": {MODEL: {"context_window": LIMIT}},
                "tenants": {"t": {"upstream": {"base_url": upstream + "/v1"}}},
            },
            env={},
            base_dir=str(tmp_path),
        )
        with serve(create_app(config)) as recap:
            task = claude(recap, home, work, "-p", TASK)
            turns = len(fake.message_requests())
            # Then its own /compact, which Recap answers, and a turn after it.
            compact = claude(recap, home, work, "-p", "/compact", "--continue")
            after = claude(recap, home, work, "-p", "What did you read?", "--continue")
    assert task.returncode == 0 and f"DONE: read {FILES} files." in task.stdout, (
        task.stdout + task.stderr
    )
    assert fake.problems == []
    sent = fake.message_requests()
    assert all(prompt_tokens(fake, r.json) <= LIMIT for r in sent[:turns])
    assert fake.message_requests("summarize"), "Recap's summarizer was never asked"
    assert compact.returncode == 0, compact.stdout + compact.stderr
    assert after.returncode == 0 and "I read the files." in after.stdout, (
        after.stdout + after.stderr
    )
    # Claude Code's summarization prompt never reached the upstream: Recap answered it, and
    # the next history starts with Recap's summary, in its frame.
    assert not any(OPENING.encode() in r.body for r in sent)
    assert FRAME_OPEN in json.dumps(sent[-1].json["messages"][0])
    # Nothing was dropped to make a request fit: summaries and placeholders did it all.
    lines = [x for x in logs.access(len(sent)) if x["path"] == "/v1/messages"]
    assert lines and not any(x.get("dropped_messages") for x in lines)
    assert any(x.get("remote_compaction") == "claude_code" for x in lines)
