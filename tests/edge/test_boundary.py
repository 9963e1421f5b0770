"""The one error boundary (issue 13 item 9), through real servers.

Every answer the proxy makes itself is in the OpenAI error shape: routing errors
(404, 405), operator route parameters out of range, and anything unexpected (a 500,
logged once with the request id, never Starlette's text/plain). Operator routes take
a conversation key as one percent-encoded path segment.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import LogCapture, make_config
from tests.fakes import FakeUpstream
from tests.servers import recap_app, serve

ADMIN = {"authorization": "Bearer adm-boundary"}
SHAPE = {"message", "type", "param", "code"}


def is_error_shape(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error: dict[str, object] = r.json()["error"]
    assert set(error) == SHAPE
    return error


def archived(url: str, key: str) -> None:
    """Wait until the conversation's request event is on disk (written after the answer)."""
    path = f"{url}/recap/conversations/{quote(key, safe='')}/view"
    # Waits for the event, not for a time: a busy machine only makes it slower.
    while httpx.get(path, headers=ADMIN, timeout=60).status_code != 200:
        time.sleep(0.02)


def test_routing_errors_are_in_the_error_shape(proxy_factory: Callable[..., str]) -> None:
    url = proxy_factory(admin_keys=["adm-boundary"])
    is_error_shape(httpx.delete(f"{url}/recap/conversations"), 404)
    is_error_shape(httpx.post(url.removesuffix("/v1") + "/healthz"), 405)
    error = is_error_shape(httpx.post(f"{url}/recap/conversations/k/view", headers=ADMIN), 405)
    assert error["code"] == "method_not_allowed"
    is_error_shape(httpx.get(f"{url}/recap/conversations/k/nope", headers=ADMIN), 404)


@pytest.mark.parametrize("version", [10**29, 2**31, 0, -1, 1.5, "1", True])
def test_rollback_version_out_of_range_is_400(
    proxy_factory: Callable[..., str], version: object
) -> None:
    url = proxy_factory(admin_keys=["adm-boundary"])
    httpx.post(
        f"{url}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-conversation-id": "conv-1"},
    )
    archived(url, "conv-1")
    r = httpx.post(
        f"{url}/recap/conversations/conv-1/rollback", json={"version": version}, headers=ADMIN
    )
    error = is_error_shape(r, 400)
    assert error["param"] == "version"


@pytest.mark.parametrize("key", ["a/view", "tricky/archive", "50%off", "x/y/z", "ключ/view"])
def test_conversation_key_is_one_percent_encoded_segment(
    proxy_factory: Callable[..., str], fake: FakeUpstream, key: str
) -> None:
    url = proxy_factory(admin_keys=["adm-boundary"])
    # The key, and the conversation its first segment names (what a path route would see).
    for k in (key, key.split("/")[0]):
        r = httpx.post(
            f"{url}/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": f"hi {k}"}],
                "metadata": {"conversation_id": k},
            },
        )
        assert r.status_code == 200
        archived(url, k)
    segment = quote(key, safe="")
    r = httpx.get(f"{url}/recap/conversations/{segment}", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["key"] == key
    view = httpx.get(f"{url}/recap/conversations/{segment}/view", headers=ADMIN).json()
    assert view["object"] == "recap.view"
    assert view["messages"][-1]["content"] == f"hi {key}"


def test_unexpected_exception_is_a_500_in_the_error_shape_logged_with_request_id(
    upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    async def boom(request: Request) -> Response:
        raise RuntimeError("a bug")

    async def boom_stream(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"data: {}\n\n"
            raise RuntimeError("a bug mid-stream")

        return StreamingResponse(body(), media_type="text/event-stream")

    app = recap_app(make_config(upstream_url, tmp_path))
    # Routes of the real app, in front of its own: the whole stack around them is real.
    app.router.routes[:0] = [Route("/boom", boom), Route("/boom-stream", boom_stream)]
    with serve(app) as url:
        r = httpx.get(f"{url}/boom")
        error = is_error_shape(r, 500)
        assert error["code"] == "internal_error"
        request_id = r.headers["x-recap-request-id"]
        with httpx.stream("GET", f"{url}/boom-stream") as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line]
        assert lines[0] == "data: {}"
        assert '"internal_error"' in lines[-1]
        # The connection is still usable afterwards (not dropped).
        assert httpx.get(f"{url}/healthz").status_code == 200
        (line,) = [x for x in logs.access(2) if x["path"] == "/boom"]
    assert line["status"] == 500 and line["error"] == "internal_error"
    errors = logs.records("recap.error")
    assert errors and errors[0]["request_id"] == request_id
    assert "RuntimeError: a bug (at test_boundary.py" in errors[0]["msg"]
