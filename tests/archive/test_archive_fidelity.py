"""The archive keeps every request exactly: each distinct message once, as sent, and the
request's other fields, so a request is rebuilt from the export as the client sent it.

Through real servers: the proxy and a fake upstream on uvicorn, the `openai` SDK as the
client, the export read from the operator route. Two protections ride along: a failed
archive write means no compaction (seed 002 §5.5), and the client's proxy key never
reaches the upstream when the tenant has a key of its own.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.config import parse_config
from tests.fakes import FakeUpstream
from tests.faults import (
    MODEL,
    SummarizerFake,
    compacting_data,
    history,
    summaries_in,
    wait_until,
)
from tests.pg import fresh_schema, postgres_url
from tests.servers import recap_app, serve

CLIENT_KEY = "client-proxy-key-7f3a"
UPSTREAM_KEY = "upstream-secret-91c2"
ADMIN = "admin-key-fidelity"


def export(url: str, conv: str) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{url}/v1/recap/conversations/{conv}/archive",
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()]


def settled(url: str, conv: str, requests: int) -> list[dict[str, Any]] | None:
    lines = export(url, conv)
    return lines if sum(x["type"] == "request" for x in lines) >= requests else None


def rebuilt(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every request of the export, rebuilt from its event, its params and its messages."""
    messages = {x["fingerprint"]: x["message"] for x in lines if x["type"] == "message"}
    params = {x["fingerprint"]: x["params"] for x in lines if x["type"] == "params"}
    return [
        {
            **params[x["payload"]["params"]],
            "messages": [messages[fp] for fp in x["payload"]["messages"]],
        }
        for x in lines
        if x["type"] == "request"
    ]


@pytest.fixture
def fake() -> FakeUpstream:
    return FakeUpstream()


@pytest.fixture
def proxy(fake: FakeUpstream, tmp_path: Path) -> Iterator[str]:
    with serve(fake.app) as upstream:
        data = {
            "store": f"sqlite:///{tmp_path / 'recap.db'}",
            "admin_keys": [ADMIN],
            "tenants": {
                "default": {
                    "api_keys": [CLIENT_KEY],
                    "upstream": {"base_url": f"{upstream}/v1", "api_key": UPSTREAM_KEY},
                }
            },
        }
        config = parse_config(data, env={}, base_dir=str(tmp_path))
        with serve(recap_app(config)) as url:
            yield url


# Eleven distinct messages that differ only in the fields a partial fingerprint ignored.
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Do A."},
    {"role": "assistant", "content": None, "refusal": "I can't do A."},
    {"role": "user", "content": "Do A."},
    {"role": "assistant", "content": None, "refusal": "I can't do B."},
    {"role": "user", "content": "Say it aloud."},
    {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
    {"role": "assistant", "content": None, "audio": {"id": "audio_2"}},
    {"role": "assistant", "content": "Done.", "reasoning_content": "THOUGHT-1"},
    {"role": "assistant", "content": "Done.", "reasoning_content": "THOUGHT-2"},
    {"role": "user", "content": "Thanks.", "name": None},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_reservation_details",
            "description": "Look a reservation up.",
            "parameters": {
                "type": "object",
                "properties": {"reservation_id": {"type": "string"}},
                "required": ["reservation_id"],
            },
        },
    }
]


def test_distinct_messages_and_request_fields_come_back_exactly_as_sent(
    proxy: str, fake: FakeUpstream
) -> None:
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key=CLIENT_KEY, max_retries=0)
    same = {"temperature": 0.25, "seed": 7, "response_format": {"type": "json_object"}}
    calls: list[dict[str, Any]] = [
        {"messages": HISTORY[:3], **same},
        {"messages": HISTORY[:7], **same},
        {"messages": HISTORY, **same},
        {"messages": HISTORY, **same, "temperature": 0.9, "tools": TOOLS, "top_p": 0.5},
    ]
    for call in calls:
        client.chat.completions.create(
            model=MODEL, extra_headers={"x-conversation-id": "fidelity"}, **call
        )
    sent = [r.json for r in fake.chat_requests()]
    assert len(sent) == len(calls)

    lines = wait_until_settled(proxy, "fidelity", len(calls))
    archived = [x["message"] for x in lines if x["type"] == "message"]
    # Every message once, exactly as sent (the two "Do A." user messages are one message).
    assert archived == [m for i, m in enumerate(HISTORY) if m not in HISTORY[:i]]
    assert len(archived) == 10
    # The request's other fields are archived too: each request rebuilds exactly.
    assert rebuilt(lines) == sent
    # ... and each distinct set of them once, however many requests repeat it.
    params = [x["params"] for x in lines if x["type"] == "params"]
    assert len(params) == 2
    assert params[1]["tools"] == TOOLS and params[0]["response_format"] == {"type": "json_object"}
    # The last-request view shows exactly what went upstream, other fields included.
    r = httpx.get(
        f"{proxy}/v1/recap/conversations/fidelity/view",
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["messages"] == sent[-1]["messages"]


def wait_until_settled(url: str, conv: str, requests: int) -> list[dict[str, Any]]:
    found: list[list[dict[str, Any]]] = []

    def probe() -> bool:
        lines = settled(url, conv, requests)
        if lines:
            found.append(lines)
        return bool(lines)

    assert wait_until(probe, timeout=20, step=0.05)
    return found[-1]


# -- the client's proxy key never reaches the upstream ---------------------------------------


class RawHeaders:
    """ASGI wrapper recording every request's raw header list (a dict would hide a
    duplicated Authorization header behind the last one)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, list[tuple[bytes, bytes]]]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["path"], list(scope["headers"])))
        await self.app(scope, receive, send)


def test_the_clients_proxy_key_never_reaches_the_upstream(tmp_path: Path) -> None:
    fake = SummarizerFake()
    upstream = RawHeaders(fake)
    with serve(upstream) as upstream_url:
        tenant = {
            "api_keys": [CLIENT_KEY],
            "upstream": {"base_url": f"{upstream_url}/v1", "api_key": UPSTREAM_KEY},
            "compaction": {
                "session": {"min_saving_tokens": 500, "failure_threshold": 100},
                "trim": {"enabled": False},
            },
            "summarizer": {"quality_guard": False},
        }
        data = compacting_data(upstream_url, tmp_path, tenants={"default": tenant})
        config = parse_config(data, env={}, base_dir=str(tmp_path))
        with serve(recap_app(config)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=CLIENT_KEY, max_retries=0)
            # A compacting request (its summarizer call too), a streamed one, a pass-through.
            r = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=history(seed=1), extra_headers={"x-conversation-id": "k"}
            )
            assert r.headers["x-recap-compaction"] == "session"
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_headers={"x-conversation-id": "s"},
            )
            assert [c for c in stream]
            assert client.models.list().data
    paths = [path for path, _ in upstream.seen]
    assert paths.count("/v1/chat/completions") >= 3 and "/v1/models" in paths
    assert fake.count() >= 1  # a summarizer call went upstream too
    for path, headers in upstream.seen:
        auth = [v for k, v in headers if k.lower() == b"authorization"]
        assert auth == [f"Bearer {UPSTREAM_KEY}".encode()], (path, auth)
        assert not any(CLIENT_KEY.encode() in v for _, v in headers), path


# -- a failed archive write means no compaction (seed 002 §5.5) -------------------------------

REFUSE_SQLITE = (
    "CREATE TRIGGER refuse_archive BEFORE INSERT ON messages"
    " BEGIN SELECT RAISE(ABORT, 'archive refused'); END"
)
REFUSE_POSTGRES = (
    "CREATE FUNCTION refuse_archive() RETURNS trigger LANGUAGE plpgsql AS"
    " $$ BEGIN RAISE EXCEPTION 'archive refused'; END $$;"
    " CREATE TRIGGER refuse_archive BEFORE INSERT ON messages"
    " FOR EACH ROW EXECUTE FUNCTION refuse_archive()"
)


@contextlib.contextmanager
def backend(name: str, tmp_path: Path) -> Iterator[tuple[str, Any, Any]]:
    """(store URL, run SQL on it, (SQL refusing archive writes, SQL accepting them again))."""
    if name == "sqlite":
        path = tmp_path / "recap.db"

        def run(sql: str) -> Any:
            with contextlib.closing(sqlite3.connect(path)) as db:
                rows = db.execute(sql).fetchall()
                db.commit()
                return rows

        yield f"sqlite:///{path}", run, (REFUSE_SQLITE, "DROP TRIGGER refuse_archive")
        return
    import asyncio

    import asyncpg

    with fresh_schema(postgres_url()) as url:

        def run_pg(sql: str) -> Any:
            async def go() -> Any:
                conn = await asyncpg.connect(url)
                try:
                    if sql.lstrip().upper().startswith("SELECT"):
                        return [tuple(r) for r in await conn.fetch(sql)]
                    await conn.execute(sql)
                    return []
                finally:
                    await conn.close()

            return asyncio.run(go())

        yield url, run_pg, (REFUSE_POSTGRES, "DROP TRIGGER refuse_archive ON messages")


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_failed_archive_write_means_no_compaction(store: str, tmp_path: Path) -> None:
    fake = SummarizerFake()
    with serve(fake) as upstream_url, backend(store, tmp_path) as (store_url, run, (refuse, allow)):
        data = compacting_data(upstream_url, tmp_path, store=store_url)
        config = parse_config(data, env={}, base_dir=str(tmp_path))
        with serve(recap_app(config)) as url:

            def post(key: str, seed: int) -> tuple[httpx.Response, dict[str, Any]]:
                body = {"model": MODEL, "messages": history(seed=seed)}
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"x-conversation-id": key},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                return r, body

            r, _ = post("warm-up", 1)  # the store exists and this request compacts
            assert r.headers["x-recap-compaction"] == "session"
            run(refuse)
            calls = fake.count()
            r, body = post("refused", 2)
            # Forwarded exactly as sent, and no summarizer call was even made.
            assert r.headers["x-recap-compaction"] in ("none", "failed")
            assert fake.fake.chat_requests()[-1].json == body
            assert fake.count() == calls
            versions = run("SELECT COUNT(*) FROM summary_versions WHERE key = 'refused'")
            assert versions == [(0,)]
            # The same request compacts once the archive takes writes again.
            run(allow)
            r, _ = post("refused", 2)
            assert r.headers["x-recap-compaction"] == "session"
            assert summaries_in(fake.fake.chat_requests()[-1].json["messages"]) == [1]
