"""Codex CLI itself, end to end: `codex exec` with Recap as its model provider, in front
of a fake Responses upstream that knows nothing of compaction (tests/fake_responses.py).

Skipped when `codex` (npm `@openai/codex`, checked with 0.171) is not on PATH. Its
home is a temporary CODEX_HOME whose config.toml keeps it off the network (no update
check, no plugins, no analytics) and makes it compact early; the provider is named
"OpenAI", the only name for which Codex 0.171 compacts remotely (docs/codex.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from proxy.config import parse_config
from tests.fake_responses import FakeResponses
from tests.servers import recap_app, serve

CODEX = shutil.which("codex")
# Against a hang only (Codex waits on nothing here); a run takes a few seconds.
HANG_S = 300

CONFIG = """model = "gpt-5.1-codex"
model_provider = "recap"
model_context_window = 6000
model_auto_compact_token_limit = 3000
approval_policy = "never"
check_for_update_on_startup = false

[model_providers.recap]
name = "OpenAI"
base_url = "{base}"
wire_api = "responses"
env_key = "RECAP_TEST_KEY"

[features]
plugins = false

[analytics]
enabled = false
"""


@pytest.mark.skipif(CODEX is None, reason="codex (npm @openai/codex) is not on PATH")
def test_codex_compacts_remotely_through_recap_on_a_non_openai_upstream(tmp_path: Path) -> None:
    assert CODEX is not None
    fake = FakeResponses()
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with serve(fake.app) as upstream:
        config = parse_config(
            {
                "store": f"sqlite:///{tmp_path / 'recap.db'}",
                "tenants": {
                    "a": {"api_keys": ["key-a"], "upstream": {"base_url": upstream + "/v1"}}
                },
            },
            env={},
            base_dir=str(tmp_path),
        )
        with serve(recap_app(config)) as recap:
            (home / "config.toml").write_text(CONFIG.format(base=recap + "/v1"))
            env = {**os.environ, "CODEX_HOME": str(home), "RECAP_TEST_KEY": "key-a"}
            runs = []
            for args in (["say hello"], ["resume", "--last", "and now goodbye"]):
                runs.append(
                    subprocess.run(
                        [CODEX, "exec", "--skip-git-repo-check", "-C", str(work), *args],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=HANG_S,
                        check=False,
                    )
                )
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
    # The second turn began with a remote compaction, which Recap answered.
    assert "context compacted" in runs[1].stdout + runs[1].stderr
    assert "expected exactly one compaction output item" not in runs[1].stdout + runs[1].stderr
    paths = [(r.path, r.purpose) for r in fake.requests]
    assert ("/v1/chat/completions", "summarize") in paths
    assert all(p == "/v1/responses" for p, purpose in paths if purpose != "summarize")
    assert fake.problems == []
    turns = [r.json["input"] for r in fake.requests if r.path == "/v1/responses"]
    assert len(turns) == 2
    text = json.dumps(turns[-1])
    assert "compaction" not in {i.get("type") for i in turns[-1]} and "recap1." not in text
    assert "recap-summary" in text and "and now goodbye" in text
