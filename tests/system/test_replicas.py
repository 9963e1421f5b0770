"""Two Recap replicas on one PostgreSQL database: one compaction at a time, across processes.

Two real `python -m proxy serve` processes on their own ports share a fresh schema;
the fake upstream runs in this process and answers chat and summarizer calls. A
client replays a long τ-bench conversation, sending every turn to both replicas at
once (which one goes first alternates), so every compaction races a twin request on
the other replica. Then one replica is killed with SIGKILL in the middle of a
compaction while the other waits for the conversation's lock: the lock dies with the
killed process's session, and the survivor carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.config import load_config
from proxy.history.conversation import check_history
from proxy.history.messages import fingerprint
from proxy.store import ConversationRef, Store, open_store
from tests.fakes import FakeUpstream, Reply, extractive_summary
from tests.pg import fresh_schema, postgres_url
from tests.servers import free_port
from tests.trajectories import DATA, chained, model_calls, sessions

pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")

REPO = Path(__file__).resolve().parents[2]
WINDOW = 12000
KEY = "replicated-1"
CONV = ConversationRef("default", KEY)


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None


def write_config(tmp_path: Path, store_url: str, upstream_url: str) -> Path:
    config = {
        "store": store_url,
        "store_pool": {"min_size": 1, "max_size": 4, "lock_max_size": 4},
        "models": {"small": {"context_window": WINDOW}},
        "tenants": {
            "default": {
                "api_keys": [],
                "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 60},
                # The session layer only, so that every summarizer call is one of its batches,
                # on the request path (a background one may still run when the counts are read).
                "compaction": {
                    "session": {"min_saving_tokens": 500, "precompact": False},
                    "loop": {"enabled": False},
                    "trim": {"enabled": False},
                },
                "summarizer": {"timeout_s": 60},
            }
        },
    }
    path = tmp_path / "recap.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@contextlib.contextmanager
def replicas(config: Path, tmp_path: Path, n: int) -> Iterator[list[Replica]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started: list[Replica] = []
    try:
        for i in range(n):
            port = free_port()
            log = tmp_path / f"replica-{i}.log"
            command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [*command, "--port", str(port), "--log-format", "json"],
                    cwd=tmp_path,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            started.append(Replica(f"http://127.0.0.1:{port}", proc, log))
        deadline = time.monotonic() + 120  # a hang guard: starts are slow on a loaded machine
        for r in started:
            while True:
                assert r.alive(), r.log.read_text(errors="replace")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(r.url + "/readyz", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, r.log.read_text(errors="replace")
                time.sleep(0.05)
        yield started
    finally:
        for r in started:
            if r.alive():
                r.proc.send_signal(signal.SIGINT)
        for r in started:
            try:
                r.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""


def post(url: str, messages: list[dict[str, Any]], answer: Answer, timeout: float = 60) -> None:
    try:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "small", "messages": messages},
            headers={"x-conversation-id": KEY},
            timeout=timeout,
        )
        answer.status, answer.headers = r.status_code, dict(r.headers)
    except httpx.TransportError as exc:
        answer.error = type(exc).__name__


def in_thread(url: str, messages: list[dict[str, Any]]) -> tuple[threading.Thread, Answer]:
    answer = Answer()
    thread = threading.Thread(target=post, args=(url, messages, answer), daemon=True)
    thread.start()
    return thread, answer


async def read_store(url: str, what: str) -> Any:
    store: Store = open_store(url, ".")
    async with store:
        if what == "versions":
            return await store.summary_versions(CONV)
        if what == "archived":
            return await store.archived_messages(CONV)
        return [e async for e in store.events(CONV) if e.type == "session_compact"]


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_schema(postgres_url()) as url:
        yield url


@pytest.mark.timeout(600)  # subprocess starts: seconds of CPU each
def test_two_replicas_share_compactions_and_survive_a_kill(
    pg_url: str, fake: FakeUpstream, upstream_url: str, tmp_path: Path
) -> None:
    convo = chained(sessions()[:8])
    steps = [i for i in model_calls(convo) if convo[i - 1]["role"] == "user"]
    kill_steps = steps[-12:]
    # Slow enough that the twin request arrives while the compaction is running.
    fake.summarize = lambda body: Reply(content=extractive_summary(body), delay_s=0.3)
    config = write_config(tmp_path, pg_url, upstream_url)

    with replicas(config, tmp_path, 2) as (a, b):
        compacted_pairs = 0
        for n, i in enumerate(steps[: -len(kill_steps)]):
            first, second = (a, b) if n % 2 == 0 else (b, a)
            made_before = len(fake.chat_requests("summarize"))
            runs = [in_thread(first.url, convo[:i]), in_thread(second.url, convo[:i])]
            for thread, _ in runs:
                thread.join(60)
            answers = [ans for _, ans in runs]
            assert [x.status for x in answers] == [200, 200], answers
            kinds = [x.headers.get("x-recap-compaction") for x in answers]
            # Both twins use the same summary: the one that waited reused the other's
            # (applying a stored summary is reported as the session layer too).
            versions = {x.headers.get("x-recap-summary-version") for x in answers}
            assert len(versions) == 1, (kinds, versions)
            compacted_pairs += len(fake.chat_requests("summarize")) > made_before

        calls = len(fake.chat_requests("summarize"))
        stored = asyncio.run(read_store(pg_url, "versions"))
        audited = asyncio.run(read_store(pg_url, "events"))
        assert compacted_pairs >= 2 and calls >= 2
        # One summarizer call per stored batch, and no range summarised twice.
        assert len(stored) == calls == sum(e.payload["batches"] for e in audited)
        covered = [v.covered for v in stored]
        assert covered == sorted(set(covered)), covered
        assert [v.version for v in stored] == list(range(1, len(stored) + 1))
        for rec in fake.chat_requests():
            assert check_history(rec.json["messages"]) == []
        # Every message the client sent is archived (the writer runs just after responses).
        sent = {fingerprint(m) for m in convo[: steps[-len(kill_steps) - 1]]}
        wait_until(
            lambda: sent <= set(asyncio.run(read_store(pg_url, "archived"))),
            10,
            "archive incomplete",
        )

        # -- a replica dies while it compacts; the other one waits for the lock meanwhile
        slow = threading.Event()

        def summarize(body: dict[str, Any]) -> Reply:
            if not slow.is_set():
                slow.set()
                return Reply(content=extractive_summary(body), delay_s=30)
            return Reply(content=extractive_summary(body))

        fake.summarize = summarize
        before = len(stored)
        victim, survivor = a, b
        for i in kill_steps:
            thread, answer = in_thread(victim.url, convo[:i])
            wait_until(lambda t=thread: slow.is_set() or not t.is_alive(), 30, "no answer")
            if slow.is_set():
                break
            assert answer.status == 200
        assert slow.is_set(), "none of the last turns compacted"
        waiting, result = in_thread(survivor.url, convo[:i])
        time.sleep(0.5)
        assert waiting.is_alive(), "the survivor did not wait for the victim's compaction"
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(5)
        waiting.join(20)
        assert not waiting.is_alive(), "the survivor is stuck: the lock outlived its session"
        assert result.status == 200, result
        assert result.headers.get("x-recap-compaction") == "session"
        thread.join(5)
        assert answer.error or answer.status != 200  # the victim never answered
        after = asyncio.run(read_store(pg_url, "versions"))
        assert len(after) > before
        assert [v.version for v in after] == list(range(1, len(after) + 1))
        # The survivor goes on with the conversation.
        for j in kill_steps[kill_steps.index(i) + 1 :]:
            done = Answer()
            post(survivor.url, convo[:j], done)
            assert done.status == 200
        for rec in fake.chat_requests():
            assert check_history(rec.json["messages"]) == []


def test_the_deployment_example_is_a_valid_config() -> None:
    deploy = REPO / "docs" / "deploy"
    env = {"RECAP_DB_PASSWORD": "pw", "RECAP_ADMIN_KEY": "an-admin-key"}
    config = load_config(deploy / "recap.yaml", env=env)
    assert config.store == "postgresql://recap:pw@postgres:5432/recap"
    assert config.admin_keys == ("an-admin-key",)  # one key for every replica's page
    assert config.store_pool.max_size >= 1 and config.listen.host == "0.0.0.0"
    compose = yaml.safe_load((deploy / "docker-compose.yml").read_text(encoding="utf-8"))
    services = compose["services"]
    assert {"postgres", "recap-1", "recap-2", "nginx"} <= set(services)
    assert services["recap-2"]["build"] == services["recap-1"]["build"]  # the same image
    nginx = (deploy / "nginx.conf").read_text(encoding="utf-8")
    for name in ("recap-1", "recap-2"):
        assert f"server {name}:8080" in nginx
    assert "proxy_buffering off" in nginx
