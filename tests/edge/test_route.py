"""The route skeleton (proxy/edge/route.py): one place answers a route's errors, in its shape.

A route whose API is not OpenAI-shaped (here a made-up one that writes `<error code=...>`)
gets Recap's own errors in that shape everywhere Recap answers for it: an error raised
before the response started, one after its stream started (the final event), and a bug
(the front's last resort 500). Served by a real uvicorn, read with httpx.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from proxy.edge.boundary import Rendered
from proxy.edge.front import Edge
from proxy.edge.metrics import Metrics
from proxy.edge.route import Call, Route
from proxy.errors import BadRequest, RecapError, UpstreamTimeout
from tests.servers import serve


class AngleErrors:
    """Another API's error shape."""

    def body(self, err: RecapError) -> bytes:
        return f"<error code={err.code}>{err.message}</error>".encode()

    def event(self, err: RecapError) -> bytes:
        return f"event: trouble\ndata: <error code={err.code}/>\n\n".encode()


class Teapot(Route):
    errors = AngleErrors()

    async def handle(self, call: Call) -> None:
        what = call.scope["path"]
        if what == "/before":
            raise BadRequest("not this")
        if what == "/during":
            await call.responder.start_sse([])
            await call.responder.comment("working")
            raise UpstreamTimeout("too slow")
        if what == "/bug":
            raise ZeroDivisionError("a bug")
        await call.responder.json(200, {"ok": True})


def app(route: Route) -> Any:
    """`route` as the app mounts a direct route: the front, the boundary, the route."""
    inner = Edge(Rendered(route, route.errors), Metrics(), route.errors)

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        scope.setdefault("state", {})["recap"] = object()  # no app state is read
        await inner(scope, receive, send)

    return asgi


@pytest.fixture
def base() -> AsyncIterator[str]:
    with serve(app(Teapot())) as url:
        yield url


async def test_errors_before_the_answer_are_in_the_routes_shape(base: str) -> None:
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/before")
    assert r.status_code == 400
    assert r.text == "<error code=invalid_request>not this</error>"
    assert "x-recap-request-id" in r.headers


async def test_an_error_in_a_started_stream_is_the_routes_final_event(base: str) -> None:
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/during")
    assert r.status_code == 200
    assert r.text == ": working\n\nevent: trouble\ndata: <error code=upstream_timeout/>\n\n"


async def test_a_bug_is_a_500_in_the_routes_shape(base: str) -> None:
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/bug")
    assert r.status_code == 500
    assert r.text.startswith("<error code=internal_error>")


async def test_the_default_shape_is_openais() -> None:
    class Plain(Route):
        async def handle(self, call: Call) -> None:
            raise BadRequest("not this")

    with serve(app(Plain())) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/x")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request"
