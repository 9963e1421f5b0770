"""The compacting route's way upstream: plan the view, send it, recover from an overflow.

    plan      run the pipeline; the body to forward (the client's very bytes when no stage
              changed the history, else the history rendered back by the adapter)
    forward   send it; the request's archive record is begun as soon as the body is on
              the wire, so making it overlaps the upstream's work
    recover   the upstream said the prompt is too long (overflow.py) before any of its
              answer reached the client: plan again, harder, and send once more

Errors from the upstream client come back as values (a RecapError in place of the
response), so the route can still archive what it sent before it answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx

from proxy.config import Tenant
from proxy.dialects.base import Dialect
from proxy.edge.body import Incoming
from proxy.edge.overflow import detect, retry_exchange, retry_window
from proxy.edge.route import Call
from proxy.errors import RecapError
from proxy.pipeline import Exchange
from proxy.record import OverflowRetry
from proxy.stages.offload import off_loop
from proxy.upstream.client import RequestBody, mapped_errors, request_headers, upstream_url
from proxy.upstream.error_answer import read_error, replayed

log = logging.getLogger("recap.chat")

Headers = list[tuple[bytes, bytes]]
Sent = httpx.Response | RecapError


async def plan(
    call: Call, tenant: Tenant, incoming: Incoming, exchange: Exchange | None, dialect: Dialect
) -> tuple[bytes, Headers]:
    """Run the pipeline; the body to forward and its headers (the route's API's way of
    carrying a key, `dialect`): unchanged, the very bytes the client sent with their
    Content-Encoding."""
    headers = request_headers(
        call.scope["headers"],
        tenant.upstream,
        keep_encoding=True,
        credential_headers=dialect.credential_headers,
        credentials=dialect.summary_call.credentials,
    )
    if exchange is None:
        return incoming.raw, headers
    await call.state.pipeline.run(exchange)
    if not exchange.changed:
        exchange.sent(incoming.decoded)
        return incoming.raw, headers
    ex, view = exchange, incoming.parsed
    assert view is not None  # an exchange is made only from a parsed body
    payload = await off_loop(len(incoming.decoded), lambda: ex.dialect.render(view, ex.messages))
    exchange.sent(payload)
    # A rewritten body goes up as identity: re-compressing would cost the proxy CPU on
    # every request to save bandwidth on a loopback or LAN hop.
    return payload, [(k, v) for k, v in headers if k != b"content-encoding"]


async def forward(
    call: Call, tenant: Tenant, payload: bytes, headers: Headers, exchange: Exchange | None
) -> tuple[Sent, Awaitable[bool] | None]:
    """Send, beginning the exchange's archive record once the body is on the wire; the
    upstream's response (or why there is none) and the record's durability (None: no
    record)."""
    begin = _Once(lambda: _begin(call, exchange))
    try:
        response: Sent = await _send(call, tenant, payload, headers, begin)
    except RecapError as err:
        response = err
    # Begun now if the body never went out whole (the send failed): the record is kept too.
    return response, begin()


async def recover(
    call: Call,
    tenant: Tenant,
    incoming: Incoming,
    exchange: Exchange,
    response: httpx.Response,
    committed: Awaitable[bool] | None,
) -> tuple[Sent, Exchange, Awaitable[bool] | None]:
    """The retry's response if the upstream overflowed, else this error (re-readable)."""
    try:
        # Inside the boundary: a reset while the error answer is read is the upstream's
        # failure (a 502), like one anywhere else in its answer.
        with mapped_errors(tenant.upstream):
            body, rest = await read_error(response)
    except RecapError:
        await response.aclose()
        raise
    overflow = None
    if rest is None and (exchange.control != "off" or exchange.held_out):
        overflow = detect(response.status_code, body, response.headers.get("content-encoding", ""))
    if overflow is None:
        return replayed(response, body, rest), exchange, committed
    await response.aclose()
    state = call.state
    # The upstream's counts are of the whole prompt: the tool definitions too.
    fixed = exchange.fixed_tokens
    estimate = exchange.measure.total(exchange.messages) + fixed
    if overflow.prompt_tokens:
        state.calibration.observe(tenant.name, exchange.model, estimate, overflow.prompt_tokens)
    window = max(1, retry_window(overflow, estimate, exchange.context_window + fixed) - fixed)
    call.record.overflow = OverflowRetry(overflow.limit, overflow.prompt_tokens, estimate, window)
    log.warning(
        "upstream context overflow (%s): compacting harder on a %d-token window, retrying once",
        overflow.message[:200],
        window,
        extra={"request_id": call.record.request_id},
    )
    if committed is not None:
        # The first try is archived with what the upstream said of it; the retry
        # gets its own record (the upstream saw both).
        state.archiver.finish(
            exchange, {"status": response.status_code, "error": "context_length_exceeded"}
        )
    retry = retry_exchange(exchange, window)
    payload, headers = await plan(call, tenant, incoming, retry, retry.dialect)
    sent, committed = await forward(call, tenant, payload, headers, retry)
    return sent, retry, committed


def _begin(call: Call, exchange: Exchange | None) -> Awaitable[bool] | None:
    if exchange is None or exchange.archive_now is None:
        return None
    try:
        return call.state.archiver.begin(exchange)
    except (TypeError, ValueError, RecursionError) as exc:
        # The messages' identity is first worked out here for most requests: one
        # that cannot be hashed is forwarded unarchived, as a failed archive stage was.
        exchange.record.archive_error = f"{type(exc).__name__}: {exc}"
        log.warning(
            "archive record not made: %s: %s",
            type(exc).__name__,
            exc,
            extra={"request_id": exchange.request_id},
        )
        return None


async def _send(
    call: Call,
    tenant: Tenant,
    payload: bytes,
    headers: Headers,
    on_sent: Callable[[], object] | None = None,
) -> httpx.Response:
    """Forward; the upstream's response (streamed). Raises RecapError (mapped_errors).

    `on_sent` runs as soon as the whole body is written (`RequestBody`), while the
    upstream works on it."""
    upstream = tenant.upstream
    client = call.state.upstreams.client(tenant.name, upstream)
    content = RequestBody(payload, on_sent)
    request = client.build_request(
        "POST",
        upstream_url(upstream, call.scope["path"], call.scope.get("query_string", b"")),
        headers=[(k, v) for k, v in headers if k != b"content-length"] + content.headers,
        content=content,
    )
    with mapped_errors(upstream):
        return await client.send(request)


class _Once:
    """A call made at most once; later calls return its first result."""

    def __init__(self, call: Callable[[], Awaitable[bool] | None]) -> None:
        self._call: Callable[[], Awaitable[bool] | None] | None = call
        self._result: Awaitable[bool] | None = None

    def __call__(self) -> Awaitable[bool] | None:
        if self._call is not None:
            call, self._call = self._call, None
            self._result = call()
        return self._result
