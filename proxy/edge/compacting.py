"""The compacting routes: parse, classify, run the pipeline, forward, stream back.

`POST /v1/chat/completions` and `POST /v1/responses`, one instance per API: the API's
adapter (proxy/dialects/) turns the body into the neutral history and back; all the
rest (pipeline, archive, retry on overflow, relay) is the same for every API. A body
the adapter cannot or must not work on (not JSON, no history, a history the upstream
holds) is forwarded byte for byte: the proxy never rejects what the upstream might
accept, and the log says why it was left alone. When a stage rewrites the history,
only the history changes in the forwarded body; every other field goes through as sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from proxy.config import Tenant
from proxy.dialects.base import Dialect, Parsed, PassReason, Recorder, Unparsed
from proxy.dialects.chat import ChatDialect
from proxy.edge.body import ChatBody, read_request
from proxy.edge.overflow import detect, retry_exchange, retry_window
from proxy.edge.record import log_fields
from proxy.edge.relay import (
    ClientDisconnected,
    FinalBytesGate,
    Receive,
    Responder,
    Scope,
    Send,
    header_map,
    until_disconnect,
)
from proxy.errors import RecapError
from proxy.history.identity import conversation_ref, resolve_tenant
from proxy.history.measure import Measure
from proxy.history.messages import classify
from proxy.pipeline import Control, Exchange
from proxy.stages.calibration import calibrate
from proxy.stages.offload import off_loop
from proxy.state import AppState
from proxy.upstream.client import (
    RequestBody,
    mapped_errors,
    request_headers,
    response_headers,
    upstream_url,
)
from proxy.upstream.error_answer import bounded_read, read_error, replayed

log = logging.getLogger("recap.chat")


def control_of(headers: Mapping[str, str]) -> Control:
    value = headers.get("x-recap-compaction", "auto").strip().lower()
    return value if value in ("off", "auto", "force") else "auto"  # type: ignore[return-value]


class ChatCompletions:
    """ASGI app for one API (`dialect`, Chat Completions by default); the app's
    long-lived state comes from lifespan state in the scope."""

    def __init__(self, dialect: Dialect | None = None) -> None:
        self.dialect: Dialect = dialect if dialect is not None else ChatDialect()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: AppState = scope["state"]["recap"]
        start = time.perf_counter()
        fields = log_fields(scope)
        responder = Responder(send, [])
        headers = header_map(scope)
        config = state.config
        try:
            tenant = resolve_tenant(config, headers)
            fields["tenant"] = tenant.name
            read = await read_request(scope, receive, config.max_body_bytes)
            raw, decoded, why = read.raw, read.decoded, read.why
            dialect = self.dialect
            parsed: Parsed | Unparsed = Unparsed(PassReason.UNDECODABLE, why)
            if decoded is not None:
                readable = decoded
                parsed = await off_loop(len(readable), lambda: dialect.parse(readable))
            incoming = ChatBody(
                raw,
                raw if decoded is None else decoded,
                isinstance(parsed, Parsed) and parsed.kept_numbers,
                parsed if isinstance(parsed, Parsed) else None,
            )
            exchange: Exchange | None = None
            if isinstance(parsed, Unparsed):
                fields["passthrough"] = parsed.reason.value
                fields["passthrough_reason"] = parsed.detail
                log.info(
                    "%s body forwarded unchanged: %s",
                    dialect.name,
                    parsed.detail,
                    extra={"request_id": fields["request_id"]},
                )
            else:
                view = parsed
                body = view.body
                conv = await off_loop(
                    len(raw),
                    lambda: conversation_ref(
                        config,
                        tenant,
                        headers,
                        view.body,
                        candidates=dialect.key_fields(view.body),
                        messages=view.messages,
                    ),
                )
                model = body.get("model") if isinstance(body.get("model"), str) else None
                measure = Measure(state.counter, model)
                measure.bound_by(view.messages, len(incoming.decoded))
                exchange = Exchange(
                    request_id=fields["request_id"],
                    tenant=tenant,
                    conversation=conv,
                    headers=headers,
                    body=body,
                    messages=view.messages,
                    dialect=dialect,
                    classification=classify(view.messages),
                    # In Recap's tokens, as calibrated from this tenant's usage for the model.
                    context_window=state.calibration.window(
                        tenant.name, model, config.context_window(model)
                    ),
                    measure=measure,
                    control=control_of(headers),
                    body_bytes=len(incoming.decoded),
                    log_fields=fields,
                )
                fields.update(
                    conversation=conv.key,
                    model=model,
                    classification=exchange.classification.value,
                    messages=len(view.messages),
                )
            await until_disconnect(
                receive, self._proxy(state, scope, tenant, incoming, exchange, responder, start)
            )
        except RecapError as err:
            fields["error"] = err.code
            await responder.error(err)
        except ClientDisconnected:
            fields["client_disconnected"] = True

    async def _proxy(
        self,
        state: AppState,
        scope: Scope,
        tenant: Tenant,
        incoming: ChatBody,
        exchange: Exchange | None,
        responder: Responder,
        start: float,
    ) -> None:
        fields = log_fields(scope)
        if exchange is not None and exchange.stream:
            exchange.notify = self._sse_notifier(responder, exchange)
            exchange.keepalive_s = state.config.listen.sse_keepalive_s
        payload, out_headers = await self._plan(state, scope, tenant, incoming, exchange)
        # Arrival to forwarding (of the first try: a retry's time is the upstream's too).
        overhead_ms = round((time.perf_counter() - start) * 1000, 1)
        fields["overhead_ms"] = overhead_ms
        # The request's archive record is made once the body is on the wire, so making it
        # overlaps the upstream's work: journaled, it is durable at once; otherwise it is
        # committed while the upstream answers and the final bytes wait for it
        # (relay.FinalBytesGate).
        committed: Awaitable[bool] | None = None
        try:
            sent, committed = await self._forward(
                state, scope, tenant, payload, out_headers, exchange
            )
            if (
                exchange is not None
                and isinstance(sent, httpx.Response)
                and sent.status_code in (400, 413)
            ):
                # A context-length error before any of the answer reached the client: plan
                # again, harder, and send once more (proxy/edge/overflow.py).
                sent, exchange, committed = await self._recover(
                    state, scope, tenant, incoming, exchange, sent, committed
                )
            if isinstance(sent, RecapError):
                raise sent
            response = sent
        except RecapError as err:
            fields["error"] = err.code
            if committed is not None and exchange is not None:
                state.archiver.finish(exchange, {"status": err.status, "error": err.code})
            await responder.error(err)
            return
        extra = {"x-recap-overhead-ms": str(overhead_ms)}
        if exchange is not None:
            extra.update(exchange.response_headers)
        recorder: Recorder | None = None
        if exchange is not None and exchange.archive_now is not None:
            ctype = response.headers.get("content-type", "")
            recorder = exchange.dialect.recorder(
                ctype.startswith("text/event-stream"),
                response.headers.get("content-encoding", ""),
            )
        try:
            fields["upstream_status"] = response.status_code
            with mapped_errors(tenant.upstream):
                # A RecapError from here is reported (in-band once the stream has
                # started) where it is also logged.
                await self._relay(response, responder, extra, recorder, committed, start, fields)
        finally:
            await response.aclose()
            if exchange is not None:
                exchange.count_for_log()  # when no record was begun
                state.fingerprints.remember_counts(
                    exchange.conversation,
                    exchange.original,
                    exchange.measure.counted(exchange.original),
                )
            if recorder is not None and exchange is not None:
                answer = {"status": response.status_code} | recorder.result()
                state.archiver.finish(exchange, answer)
                calibrate(state, exchange, answer)

    async def _plan(
        self,
        state: AppState,
        scope: Scope,
        tenant: Tenant,
        incoming: ChatBody,
        exchange: Exchange | None,
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """Run the pipeline; the body to forward and its headers: unchanged, the very
        bytes the client sent with their Content-Encoding."""
        headers = request_headers(scope["headers"], tenant.upstream, keep_encoding=True)
        if exchange is None:
            return incoming.raw, headers
        await state.pipeline.run(exchange)
        if not exchange.changed:
            return incoming.raw, headers
        ex, view = exchange, incoming.parsed
        assert view is not None  # an exchange is made only from a parsed body
        payload = await off_loop(
            len(incoming.decoded), lambda: ex.dialect.render(view, ex.messages)
        )
        # A rewritten body goes up as identity: re-compressing would cost the proxy CPU on
        # every request to save bandwidth on a loopback or LAN hop.
        return payload, [(k, v) for k, v in headers if k != b"content-encoding"]

    async def _forward(
        self,
        state: AppState,
        scope: Scope,
        tenant: Tenant,
        payload: bytes,
        headers: list[tuple[bytes, bytes]],
        exchange: Exchange | None,
    ) -> tuple[httpx.Response | RecapError, Awaitable[bool] | None]:
        """Send, beginning the exchange's archive record once the body is on the wire; the
        upstream's response (or why there is none) and the record's durability (None: no
        record)."""
        begin = _Once(lambda: self._begin(state, exchange))
        try:
            response: httpx.Response | RecapError = await self._send(
                state, scope, tenant, payload, headers, begin
            )
        except RecapError as err:
            response = err
        # Begun now if the body never went out whole (the send failed): the record is kept too.
        return response, begin()

    def _begin(self, state: AppState, exchange: Exchange | None) -> Awaitable[bool] | None:
        if exchange is None or exchange.archive_now is None:
            return None
        try:
            return state.archiver.begin(exchange)
        except (TypeError, ValueError, RecursionError) as exc:
            # The messages' identity is first worked out here for most requests: one
            # that cannot be hashed is forwarded unarchived, as a failed archive stage was.
            exchange.log_fields["archive_error"] = f"{type(exc).__name__}: {exc}"
            log.warning(
                "archive record not made: %s: %s",
                type(exc).__name__,
                exc,
                extra={"request_id": exchange.request_id},
            )
            return None

    async def _send(
        self,
        state: AppState,
        scope: Scope,
        tenant: Tenant,
        payload: bytes,
        headers: list[tuple[bytes, bytes]],
        on_sent: Callable[[], object] | None = None,
    ) -> httpx.Response:
        """Forward; the upstream's response (streamed). Raises RecapError (mapped_errors).

        `on_sent` runs as soon as the whole body is written (`RequestBody`), while the
        upstream works on it."""
        upstream = tenant.upstream
        client = state.upstreams.client(upstream)
        content = RequestBody(payload, on_sent)
        request = client.build_request(
            "POST",
            upstream_url(upstream, scope["path"], scope.get("query_string", b"")),
            headers=[(k, v) for k, v in headers if k != b"content-length"] + content.headers,
            content=content,
        )
        with mapped_errors(upstream):
            return await client.send(request)

    async def _recover(
        self,
        state: AppState,
        scope: Scope,
        tenant: Tenant,
        incoming: ChatBody,
        exchange: Exchange,
        response: httpx.Response,
        committed: Awaitable[bool] | None,
    ) -> tuple[httpx.Response | RecapError, Exchange, Awaitable[bool] | None]:
        """The retry's response if the upstream overflowed, else this error (re-readable)."""
        body, rest = await read_error(response)
        overflow = None
        if rest is None and exchange.control != "off":
            overflow = detect(
                response.status_code, body, response.headers.get("content-encoding", "")
            )
        if overflow is None:
            return replayed(response, body, rest), exchange, committed
        await response.aclose()
        estimate = exchange.measure.total(exchange.messages)
        if overflow.prompt_tokens:
            state.calibration.observe(tenant.name, exchange.model, estimate, overflow.prompt_tokens)
        window = retry_window(overflow, estimate, exchange.context_window)
        fields = log_fields(scope)
        fields.update(
            overflow_retry=True,
            overflow_limit=overflow.limit,
            overflow_prompt_tokens=overflow.prompt_tokens,
            overflow_estimate=estimate,
            overflow_retry_window=window,
        )
        log.warning(
            "upstream context overflow (%s): compacting harder on a %d-token window, retrying once",
            overflow.message[:200],
            window,
            extra={"request_id": fields["request_id"]},
        )
        if committed is not None:
            # The first try is archived with what the upstream said of it; the retry
            # gets its own record (the upstream saw both).
            state.archiver.finish(
                exchange, {"status": response.status_code, "error": "context_length_exceeded"}
            )
        retry = retry_exchange(exchange, window)
        payload, headers = await self._plan(state, scope, tenant, incoming, retry)
        sent, committed = await self._forward(state, scope, tenant, payload, headers, retry)
        return sent, retry, committed

    async def _relay(
        self,
        response: httpx.Response,
        responder: Responder,
        extra: dict[str, str],
        recorder: Recorder | None,
        committed: Awaitable[bool] | None,
        start: float,
        fields: dict[str, Any],
    ) -> None:
        upstream_id = response.headers.get("x-request-id")
        if upstream_id:
            fields["upstream_request_id"] = upstream_id
        early = responder.started
        gate = None
        if committed is not None and not _durable(committed):
            gate = FinalBytesGate(
                committed,
                sse=response.headers.get("content-type", "").startswith("text/event-stream"),
                length=_length(response.headers.get("content-length")),
            )
        if responder.started:
            # The SSE stream is already open (compaction progress was sent): an
            # upstream error can only be reported in-band.
            if response.status_code >= 400:
                body = await bounded_read(response)
                if gate is not None:
                    await gate.end(responder)
                await responder.chunk(self.dialect.error_event(body, response.status_code))
                await responder.end()
                return
            if upstream_id:
                # Its headers went out before the upstream answered: the upstream's
                # request id (what its operators ask for) comes as an SSE comment instead.
                await responder.comment(f"x-request-id: {upstream_id}")
        else:
            responder.sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if responder.sse:
                extra = {**extra, "x-accel-buffering": "no"}
            headers = response_headers(response.headers, decoded=False, extra=extra)
            await responder.start(response.status_code, headers)
        # Raw bytes, as the upstream sent them (compressed ones stay compressed, with
        # their Content-Encoding): nothing is decoded on the way to the client.
        async for chunk in response.aiter_raw():
            if early and "ttfb_ms" not in fields:
                # The client's first byte was a progress comment; the log's time to
                # first byte is the model's, as for a stream that did not compact.
                fields["ttfb_ms"] = round((time.perf_counter() - start) * 1000, 1)
            if recorder is not None:
                recorder.feed(chunk)
            if gate is None:
                await responder.chunk(chunk)
            else:
                await gate.forward(chunk, responder)
        if gate is not None:
            await gate.end(responder)
        await responder.end()

    def _sse_notifier(
        self, responder: Responder, exchange: Exchange
    ) -> Callable[[str], Awaitable[None]]:
        async def notify(text: str) -> None:
            if not responder.started:
                await responder.start_sse(
                    [(k.encode(), v.encode()) for k, v in exchange.response_headers.items()]
                )
            await responder.comment(text)

        return notify


def _durable(committed: Awaitable[bool]) -> bool:
    """The record is on disk already (journaled): no final bytes need to wait for it."""
    return isinstance(committed, asyncio.Future) and committed.done() and committed.result()


def _length(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


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
