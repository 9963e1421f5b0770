"""Conversation listings page by (updated_at, tenant, key): small pages skip nothing.

The archive writer stamps every conversation of one batch with one time, so many
conversations share `updated_at`. Through a real server: the operator route's `cursor`,
and the `recap conversations --cursor` CLI beside it on the same file.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import REPO
from tests.faults import wait_until

ADMIN = "admin-key-pages"
KEYS = [f"conv-{i}" for i in range(7)]


def test_small_pages_skip_no_conversation_sharing_updated_at(
    proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path
) -> None:
    url = proxy_factory(admin_keys=[ADMIN])
    for key in KEYS:
        r = httpx.post(
            f"{url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": key}]},
            headers={"x-conversation-id": key},
            timeout=30,
        )
        assert r.status_code == 200
    db = tmp_path / "recap.db"
    admin = {"authorization": f"Bearer {ADMIN}"}

    def listed(**params: str) -> dict[str, Any]:
        r = httpx.get(f"{url}/recap/conversations", headers=admin, params=params)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def all_archived() -> bool:
        # Each answer's response event is the conversation's last write (it may wait a
        # moment for a next request to share its transaction): after it, nothing moves.
        with contextlib.closing(sqlite3.connect(db)) as conn:
            (n,) = conn.execute("SELECT count(*) FROM events WHERE type = 'response'").fetchone()
        return bool(n == len(KEYS))

    assert wait_until(all_archived, timeout=10)
    # As one archive batch leaves them: five of seven share one time.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("UPDATE conversations SET updated_at = 1000.0 WHERE key < 'conv-5'")
        conn.commit()
    everything = [c["key"] for c in listed(limit="100")["data"]]
    assert sorted(everything[2:]) == everything[2:] == KEYS[:5]

    for size in ("1", "2", "3"):
        seen, cursor = [], None
        while True:
            page = listed(limit=size, **({"cursor": cursor} if cursor else {}))
            seen += [c["key"] for c in page["data"]]
            if not page["has_more"]:
                break
            cursor = page["next_cursor"]
        assert seen == everything, size

    r = httpx.get(f"{url}/recap/conversations", headers=admin, params={"cursor": "garbage!"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cursor"

    # The CLI pages the same way, beside the running server.
    config = tmp_path / "cli.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{db}",
                "tenants": {"default": {"upstream": {"base_url": f"{upstream_url}/v1"}}},
            }
        )
    )
    seen, args = [], ["--limit", "2"]
    while True:
        page = cli(config, "conversations", "--json", *args)
        seen += [c["key"] for c in page["data"]]
        if not page["has_more"]:
            break
        args = ["--limit", "2", "--cursor", page["next_cursor"]]
    assert seen == everything


def cli(config: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", *args, "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))
