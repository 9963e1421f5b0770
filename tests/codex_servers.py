"""The servers and client calls of the Codex remote compaction tests (tests/edge/test_codex*.py).

A fake Responses upstream that also records `/v1/responses/compact` calls (it must never
get one from Recap), the proxy's config with two tenants, and Codex's calls as
tests/codex_bodies.py writes them: a compaction (v2, a trigger on `/v1/responses`, read
as Codex's `collect_compaction_output` reads it) and a turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.config import Config, parse_config
from tests import codex_bodies as codex
from tests.fake_responses import FakeResponses
from tests.servers import recap_app, serve


class Upstream(FakeResponses):
    """The fake Responses upstream, also recording any `/v1/responses/compact` call."""

    def __init__(self) -> None:
        super().__init__()
        self.app.router.routes.append(
            Route("/v1/responses/compact", self._compact, methods=["POST"])
        )

    async def _compact(self, request: Request) -> Response:
        await self._record(request)
        item = {"type": "compaction", "encrypted_content": "openai-blob"}
        return JSONResponse({"output": [item]})

    def paths(self) -> list[str]:
        with self.lock:
            return [r.path for r in self.requests if r.purpose != "summarize"]

    def summarizer_calls(self) -> list[dict[str, Any]]:
        return [r.json for r in self.chat_requests("summarize")]


@contextmanager
def running_upstream() -> Iterator[tuple[Upstream, str]]:
    fake = Upstream()
    with serve(fake.app) as url:
        yield fake, url


def config_data(
    url: str,
    tmp_path: Path,
    secret: str = "",
    top: Mapping[str, Any] | None = None,
    **tenant: Any,
) -> dict[str, Any]:
    """Tenants `a` (with `tenant`'s settings) and `b`; `top`: settings of the config itself."""
    tenants = {
        "a": {"api_keys": ["key-a"], "upstream": {"base_url": f"{url}/v1"}, **tenant},
        "b": {"api_keys": ["key-b"], "upstream": {"base_url": f"{url}/v1"}},
    }
    return {
        "store": f"sqlite:///{tmp_path / 'recap.db'}",
        "tenants": tenants,
        "compaction_secret": secret,
        **(top or {}),
    }


def config(
    url: str,
    tmp_path: Path,
    secret: str = "",
    top: Mapping[str, Any] | None = None,
    **tenant: Any,
) -> Config:
    return parse_config(
        config_data(url, tmp_path, secret, top, **tenant), env={}, base_dir=str(tmp_path)
    )


class Recaps:
    """Starts proxies in front of one upstream (`start(**tenant)`: its base URL, with /v1),
    all stopped when the test ends."""

    def __init__(self, url: str, tmp_path: Path, stack: ExitStack) -> None:
        self.url, self.tmp_path, self.stack = url, tmp_path, stack

    def __call__(self, top: Mapping[str, Any] | None = None, **tenant: Any) -> str:
        cfg = config(self.url, self.tmp_path, top=top, **tenant)
        return self.stack.enter_context(serve(recap_app(cfg))) + "/v1"


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events (data lines as JSON), as Codex's parser reads them."""
    out = []
    for block in response.text.split("\n\n"):
        data = [ln[len("data: ") :] for ln in block.splitlines() if ln.startswith("data: ")]
        if data:
            out.append(json.loads("\n".join(data)))
    return out


def compact_v2(
    base: str,
    items: list[dict[str, Any]],
    key: str = "key-a",
    session: str | None = codex.SESSION,
) -> dict[str, Any]:
    """What Codex's collect_compaction_output takes from the stream: the one item (in
    `session`; None: a client naming no conversation)."""
    body = codex.trigger_body(items)
    headers = codex.headers("compaction", key)
    if session is None:
        del body["prompt_cache_key"], body["client_metadata"]
        for name in ("session-id", "thread-id", "x-client-request-id"):
            del headers[name]
    else:
        body["prompt_cache_key"] = session
        headers["session-id"] = session
    r = httpx.post(f"{base}/responses", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    seen = events(r)
    done = [e["item"] for e in seen if e["type"] == "response.output_item.done"]
    compactions = [i for i in done if i["type"] == "compaction"]
    assert len(compactions) == 1, seen
    completed = [e for e in seen if e["type"] == "response.completed"]
    assert len(completed) == 1 and completed[0]["response"]["id"]
    usage = completed[0]["response"]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return compactions[0]


def turn(
    base: str,
    items: list[dict[str, Any]],
    key: str = "key-a",
    stream: bool = True,
    session: str | None = codex.SESSION,
    extra: Mapping[str, str] | None = None,
) -> httpx.Response:
    """A Codex turn in `session` (None: a client naming no conversation at all), with
    `extra` headers."""
    body = codex.body(items)
    body["stream"] = stream
    headers = codex.headers("turn", key)
    if session is None:
        del body["prompt_cache_key"], body["client_metadata"]
        for name in ("session-id", "thread-id", "x-client-request-id"):
            del headers[name]
    else:
        body["prompt_cache_key"] = session
        headers |= {"session-id": session, "thread-id": session}
    return httpx.post(
        f"{base}/responses", json=body, headers={**headers, **(extra or {})}, timeout=30
    )


def forwarded_inputs(fake: Upstream) -> list[list[dict[str, Any]]]:
    return [r.json["input"] for r in fake.response_requests()]
