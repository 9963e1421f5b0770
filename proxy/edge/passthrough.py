"""Every other `/v1/...` route: forwarded verbatim, both ways, streamed.

Method, query, body (streamed, never buffered), and headers minus hop-by-hop
ones go up; status, headers and body come back as raw bytes, so a compressed
upstream body keeps its Content-Encoding and is never decoded here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx

from proxy.config import Upstream
from proxy.dialects.base import Dialect
from proxy.dialects.chat import ChatDialect
from proxy.edge.relay import (
    Receive,
    Responder,
    body_chunks,
    check_declared,
    content_length,
    until_disconnect,
)
from proxy.edge.route import Call, Route
from proxy.history.identity import resolve_tenant
from proxy.upstream.client import (
    UpstreamClient,
    mapped_errors,
    request_headers,
    response_headers,
    upstream_url,
)


class Passthrough(Route):
    """Forward the request as it came; its answer back as it comes. Under an API's own
    paths (`/v1/messages/...`) it carries keys and writes Recap's errors in that API's
    way (`dialect`); elsewhere as chat's."""

    def __init__(self, dialect: Dialect | None = None) -> None:
        self.dialect: Dialect = dialect if dialect is not None else ChatDialect()
        self.errors = self.dialect.errors

    async def handle(self, call: Call) -> None:
        state, scope, headers = call.state, call.scope, call.headers
        limit = state.config.max_body_bytes
        keys = self.dialect.credential_headers
        tenant = resolve_tenant(state.config, headers, keys)
        call.record.tenant = tenant.name
        declared = content_length(scope)
        check_declared(declared, limit)
        has_body = declared is not None or "transfer-encoding" in headers
        body_done = asyncio.Event()
        upstream = tenant.upstream
        client = state.upstreams.client(tenant.name, upstream)
        out_headers = request_headers(
            scope["headers"],
            upstream,
            keep_encoding=True,
            credential_headers=keys,
            credentials=self.dialect.summary_call.credentials,
        )
        if declared is not None:
            out_headers.append((b"content-length", str(declared).encode()))
        request = client.build_request(
            scope["method"],
            upstream_url(upstream, scope["path"], scope.get("query_string", b"")),
            headers=out_headers,
            content=_body(call.receive, limit, body_done) if has_body else None,
        )
        if not has_body:
            body_done.set()
        call.record.overhead_ms = round((time.perf_counter() - call.start) * 1000, 1)
        await until_disconnect(
            call.receive, self._forward(client, upstream, request, call.responder), body_done
        )

    async def _forward(
        self,
        client: UpstreamClient,
        upstream: Upstream,
        request: httpx.Request,
        responder: Responder,
    ) -> None:
        # A RecapError raised here is answered where it is also logged (and counted).
        with mapped_errors(upstream):
            response = await client.send(request)
        try:
            await responder.start(
                response.status_code, response_headers(response.headers, decoded=False)
            )
            with mapped_errors(upstream):
                async for chunk in response.aiter_raw():
                    await responder.chunk(chunk)
            await responder.end()
        finally:
            await response.aclose()


async def _body(receive: Receive, limit: int, done: asyncio.Event) -> AsyncIterator[bytes]:
    """The streamed request body; `done` tells the disconnect watcher it may listen."""
    try:
        async for chunk in body_chunks(receive, limit):
            yield chunk
    finally:
        done.set()
