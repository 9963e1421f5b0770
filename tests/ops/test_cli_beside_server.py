"""The `recap` CLI beside a running server on the same SQLite file: a supported use.

A real `python -m proxy serve` on a real config, the official `openai` SDK as its client,
and the CLI (`conversations`, `show`, `export`) run as separate processes on the same
config while the server works. The CLI must see what the server committed, the server
must keep its write-ahead log (the CLI closing its connection must not take it away),
and a `kill -9` of the server afterwards must lose nothing it had committed.

The defect this guards against: any open/close of the database file inside the server
process outside SQLite drops that process's POSIX locks on it; the next process to close
its connection then believes it is the last one, checkpoints and deletes `-wal`/`-shm`,
and the server writes on into an unlinked log that the CLI cannot see and a crash loses.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import REPO
from tests.fakes import FakeUpstream
from tests.faults import wait_until
from tests.servers import free_port, serve

MODEL = "gpt-4o-mini"


class Server:
    """`python -m proxy serve` in its own process (so it can be killed with SIGKILL)."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / f"server-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "proxy", "serve", "--config", str(config)),
                *("--host", "127.0.0.1", "--port", str(self.port), "--log-format", "json"),
            ],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        ok = wait_until(self._healthy, timeout=120, step=0.05)  # a hang guard
        if not ok:
            self.kill()
            raise RuntimeError("server did not start")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            return True  # reported below as not started
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        return False

    def deleted_files(self) -> list[str]:
        """The server's open files that no longer have a name (`/proc/PID/fd`)."""
        out = []
        fd_dir = f"/proc/{self.proc.pid}/fd"
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(os.path.join(fd_dir, fd))
                if target.endswith(" (deleted)"):
                    out.append(target)
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def recap(config: Path, *args: str) -> str:
    """One CLI command in its own process, as an operator runs it; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "proxy", *args, "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def exported(config: Path, key: str) -> list[dict[str, Any]]:
    text = recap(config, "export", "--conversation", key)
    return [json.loads(line) for line in text.splitlines()]


def distinct(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for m in messages:
        seen.setdefault(json.dumps(m, sort_keys=True), m)
    return list(seen.values())


def requests_in(lines: list[dict[str, Any]]) -> list[str]:
    return [line["payload"]["request_id"] for line in lines if line["type"] == "request"]


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    fake = FakeUpstream()
    with serve(fake.app) as upstream:
        data = {
            "store": f"sqlite:///{tmp_path / 'recap.db'}",
            "tenants": {
                "default": {"api_keys": [], "upstream": {"base_url": f"{upstream}/v1"}},
            },
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(data))
        yield path


@pytest.mark.timeout(600)  # subprocess starts: seconds of CPU each
def test_cli_beside_a_running_server_sees_fresh_data_and_a_kill_loses_nothing(
    config: Path, tmp_path: Path
) -> None:
    server = Server(config, tmp_path)
    try:
        history: dict[str, list[dict[str, Any]]] = {}
        answered: dict[str, list[str]] = {}

        def chat(key: str, text: str) -> None:
            messages = history.setdefault(key, [])
            messages.append({"role": "user", "content": text})
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, extra_headers={"x-conversation-id": key}
            )
            answer = raw.parse()
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            answered.setdefault(key, []).append(raw.headers["x-recap-request-id"])

        def committed(key: str) -> bool:
            """The CLI's export holds every request answered so far in `key`."""
            with contextlib.suppress(AssertionError):
                return requests_in(exported(config, key)) == answered[key]
            return False

        for round_ in range(3):
            for key in ("alpha", "beta"):
                chat(key, f"{key} question {round_}")
            # The archive is written just after each answer: the CLI sees it soon after.
            for key in ("alpha", "beta"):
                assert wait_until(lambda key=key: committed(key), timeout=90, step=0.2), key
            listing = json.loads(recap(config, "conversations", "--json"))
            assert {c["key"] for c in listing["data"]} == {"alpha", "beta"}
            show = json.loads(recap(config, "show", "alpha", "--json"))
            assert show["message_count"] == len(distinct(history["alpha"][:-1]))
            # The CLI closing its connection took nothing from the server.
            assert server.deleted_files() == []

        server.kill()
        # Restarted on the same file: everything committed before the kill is there.
        server = Server(config, tmp_path)
        for key, messages in history.items():
            lines = exported(config, key)
            assert requests_in(lines) == answered[key]
            archived = [line["message"] for line in lines if line["type"] == "message"]
            # Every message the client sent (the last answer was never sent back), each
            # once: the fake upstream's answers are all alike.
            assert archived == distinct(messages[:-1])
        chat("alpha", "after the restart")
        assert wait_until(lambda: committed("alpha"), timeout=90, step=0.2)
    finally:
        server.kill()
