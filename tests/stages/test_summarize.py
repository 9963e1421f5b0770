"""The summarizer asks in the API it is given (`SummaryCall`, the request's dialect's).

A made-up API on a real fake upstream: its own path, body, key header and answer shape.
The summarizer sends exactly what the call writes and reads the answer as the call reads
it, so a dialect whose upstream speaks only its own API still compacts. The chat call
writes what every OpenAI-compatible upstream takes.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.config import parse_config
from proxy.dialects.base import SummaryAnswer
from proxy.dialects.chat import CHAT_SUMMARY
from proxy.stages.scenes import Scene
from proxy.stages.summarize import MAX_ANSWER_BYTES, Summarizer, SummarizerFailed
from proxy.upstream.client import UpstreamPool
from tests.servers import read_body, serve

SCENE = Scene("s", None, 0.2, None, 300, "Summarise.", "{{transcript}}")


class OtherCall:
    """An API that is not OpenAI's."""

    # Under the upstream's base URL (`.../v1`), as every call of Recap's is.
    path = "/v1/think"
    headers: Mapping[str, str] = {"x-think-version": "7"}

    def request(
        self, model: str, system: str, user: str, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        return {"engine": model, "preamble": system, "input": user, "limits": dict(options)}

    def credentials(self, api_key: str) -> dict[str, str]:
        return {"x-secret": api_key}

    def answer(self, data: Any) -> SummaryAnswer:
        return SummaryAnswer(data["said"], data["why"], data["in"], data["out"], None)


@pytest.fixture
def upstream() -> Iterator[tuple[list[dict[str, Any]], str]]:
    seen: list[dict[str, Any]] = []

    async def think(request: Request) -> JSONResponse:
        seen.append({"headers": dict(request.headers), "body": json.loads(await request.body())})
        return JSONResponse(
            {"said": "<summary>The user wants X.</summary>", "why": "stop"}
            | {
                "in": 12,
                "out": 5,
            }
        )

    app = Starlette(routes=[Route("/v1/think", think, methods=["POST"])])
    with serve(app) as url:
        yield seen, url


async def test_the_summarizer_asks_in_the_api_it_is_given(
    upstream: tuple[list[dict[str, Any]], str],
) -> None:
    seen, url = upstream
    upstream_config = {"base_url": f"{url}/v1", "api_key": "k-1"}
    config = parse_config({"tenants": {"t": {"api_keys": [], "upstream": upstream_config}}})
    tenant = next(iter(config.tenants.values()))
    pool = UpstreamPool([(tenant.name, tenant.upstream)])
    try:
        result = await Summarizer(pool, config.tenants).summarize(
            tenant,
            SCENE,
            {"transcript": "User: X please"},
            model="m-1",
            credentials={},
            max_chars=500,
            call=OtherCall(),
        )
    finally:
        await pool.aclose()
    assert result.text == "The user wants X."
    assert (result.input_tokens, result.output_tokens, result.model) == (12, 5, "m-1")
    (asked,) = seen
    assert asked["body"] == {
        "engine": "m-1",
        "preamble": "Summarise.",
        "input": "User: X please",
        "limits": {"temperature": 0.2, "max_tokens": 300},
    }
    assert asked["headers"]["x-secret"] == "k-1" and "authorization" not in asked["headers"]
    assert asked["headers"]["x-think-version"] == "7"


async def test_without_a_key_of_its_own_the_upstream_gets_the_clients_key_headers(
    upstream: tuple[list[dict[str, Any]], str],
) -> None:
    # An Anthropic client's key is its x-api-key: forwarded as it came, nothing else added.
    seen, url = upstream
    config = parse_config({"tenants": {"t": {"upstream": {"base_url": f"{url}/v1"}}}})
    tenant = next(iter(config.tenants.values()))
    pool = UpstreamPool([(tenant.name, tenant.upstream)])
    try:
        await Summarizer(pool, config.tenants).summarize(
            tenant,
            SCENE,
            {"transcript": "User: X please"},
            model="m-1",
            credentials={"x-api-key": "sk-client"},
            max_chars=500,
            call=OtherCall(),
        )
    finally:
        await pool.aclose()
    (asked,) = seen
    assert asked["headers"]["x-api-key"] == "sk-client"
    assert "x-secret" not in asked["headers"] and "authorization" not in asked["headers"]


def test_the_chat_call_is_a_chat_completion() -> None:
    body = CHAT_SUMMARY.request("m", "sys", "usr", {"temperature": 0.1, "max_tokens": 9})
    assert body == {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "usr"}],
        "stream": False,
        "temperature": 0.1,
        "max_tokens": 9,
    }
    assert CHAT_SUMMARY.path == "/v1/chat/completions"
    assert CHAT_SUMMARY.credentials("k") == {"authorization": "Bearer k"}
    answer = {
        "model": "m-2",
        "choices": [{"message": {"content": "s"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    assert CHAT_SUMMARY.answer(answer) == SummaryAnswer("s", "length", 3, 4, "m-2")
    with pytest.raises(KeyError):
        CHAT_SUMMARY.answer({"said": "not chat"})


async def test_a_compressed_answer_past_its_bound_fails_the_call_unread() -> None:
    """A summarizer that answers a gzip bomb (a whole, valid summary padded with 64 MB of
    JSON whitespace, 64 KB on the wire) fails the compaction as "answer too large": its
    answer is decoded only up to `MAX_ANSWER_BYTES` (on ce59ff6 it was decoded whole, and
    a 300 MB one took the proxy from 140 to 760 MB)."""
    answer = {
        "model": "m",
        "choices": [{"message": {"content": "<summary>S</summary>"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    }
    plain = json.dumps(answer).encode() + b" " * (64 << 20)
    assert len(plain) > MAX_ANSWER_BYTES
    wire = gzip.compress(plain, 9)
    del plain

    async def bomb(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": wire})

    with serve(bomb, lifespan="off") as url:
        config = parse_config({"tenants": {"t": {"upstream": {"base_url": f"{url}/v1"}}}})
        tenant = next(iter(config.tenants.values()))
        pool = UpstreamPool([(tenant.name, tenant.upstream)])
        try:
            with pytest.raises(SummarizerFailed) as failed:
                await Summarizer(pool, config.tenants).summarize(
                    tenant,
                    SCENE,
                    {"transcript": "User: X please"},
                    model="m",
                    credentials={},
                    max_chars=500,
                )
        finally:
            await pool.aclose()
    assert failed.value.reason == "answer too large"
