"""`POST /v1/chat/completions`: parse, classify, run the pipeline, forward, stream back.

The one route where the proxy reads the request. A body it cannot understand (not
JSON, `messages` missing or not a list) is forwarded byte for byte: the proxy
never rejects what the upstream might accept, and the log says why it was left
alone. When a stage rewrites the messages, only `messages` changes in the
forwarded body; every other field goes through as sent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx

from proxy.calibration import calibrate
from proxy.config import Tenant
from proxy.errors import RecapError
from proxy.identity import conversation_ref, resolve_tenant
from proxy.logs import log_fields
from proxy.measure import Measure
from proxy.messages import classify, json_bytes
from proxy.offload import in_slices, off_loop, sized
from proxy.overflow import MAX_ERROR_BYTES, detect, retry_exchange, retry_window
from proxy.pipeline import Control, Exchange
from proxy.relay import (
    ClientDisconnected,
    Receive,
    Responder,
    Scope,
    Send,
    content_length,
    header_map,
    read_body,
    until_disconnect,
)
from proxy.sse import AnswerRecorder
from proxy.stages import count_for_log
from proxy.state import AppState
from proxy.upstream import request_headers, response_headers, translate, upstream_url

log = logging.getLogger("recap.chat")

MAX_ERROR_BODY = 64 * 1024


def parse_chat(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """The body as a dict when the proxy can safely work on it, else (None, why not)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "body is not JSON"
    except RecursionError:
        return None, "body is nested too deeply to parse"
    if not isinstance(body, dict):
        return None, "body is not a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None, "messages missing or not a list"
    if not all(isinstance(m, dict) for m in messages):
        return None, "a message is not an object"
    return body, ""


def control_of(headers: Mapping[str, str]) -> Control:
    value = headers.get("x-recap-compaction", "auto").strip().lower()
    return value if value in ("off", "auto", "force") else "auto"  # type: ignore[return-value]


def encode_body(body: dict[str, Any], messages: list[Any]) -> bytes:
    """Deterministic serialisation: the same messages give the same bytes (prompt caches)."""
    out = dict(body)
    out["messages"] = messages
    return json_bytes(out, separators=(",", ":"))


class ChatCompletions:
    """ASGI app; the app's long-lived state comes from lifespan state in the scope."""

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
            raw = await read_body(receive, config.max_body_bytes, content_length(scope))
            body, why = await off_loop(len(raw), lambda: parse_chat(raw))
            exchange: Exchange | None = None
            if body is None:
                fields["passthrough_reason"] = why
                log.info(
                    "chat body forwarded unchanged: %s",
                    why,
                    extra={"request_id": fields["request_id"]},
                )
            else:
                parsed = body
                conv = await off_loop(
                    len(raw), lambda: conversation_ref(config, tenant, headers, parsed)
                )
                model = body.get("model") if isinstance(body.get("model"), str) else None
                exchange = Exchange(
                    request_id=fields["request_id"],
                    tenant=tenant,
                    conversation=conv,
                    headers=headers,
                    body=body,
                    classification=classify(body["messages"]),
                    # In Recap's tokens, as calibrated from this tenant's usage for the model.
                    context_window=state.calibration.window(
                        tenant.name, model, config.context_window(model)
                    ),
                    measure=Measure(state.counter, model),
                    control=control_of(headers),
                    body_bytes=len(raw),
                    log_fields=fields,
                )
                fields.update(
                    conversation=conv.key,
                    classification=exchange.classification.value,
                    messages=len(body["messages"]),
                )
            await until_disconnect(
                receive, self._proxy(state, scope, tenant, raw, exchange, responder, start)
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
        raw: bytes,
        exchange: Exchange | None,
        responder: Responder,
        start: float,
    ) -> None:
        fields = log_fields(scope)
        if exchange is not None and exchange.stream:
            exchange.notify = self._sse_notifier(responder, exchange)
        payload = await self._plan(state, raw, exchange)
        # Arrival to forwarding (of the first try: a retry's time is the upstream's too).
        overhead_ms = round((time.perf_counter() - start) * 1000, 1)
        fields["overhead_ms"] = overhead_ms
        response = await self._send(state, scope, tenant, payload, responder)
        if response is None:
            return
        if exchange is not None and response.status_code in (400, 413):
            # A context-length error before any of the answer reached the client: plan
            # again, harder, and send once more (proxy/overflow.py).
            response, exchange = await self._recover(
                state, scope, tenant, raw, exchange, response, responder
            )
            if response is None:
                return
        extra = {"x-recap-overhead-ms": str(overhead_ms)}
        if exchange is not None:
            extra.update(exchange.response_headers)
        recorder = None
        if exchange is not None and exchange.archive_now is not None:
            ctype = response.headers.get("content-type", "")
            recorder = AnswerRecorder(
                streamed=ctype.startswith("text/event-stream"),
                encoding=response.headers.get("content-encoding", ""),
            )
        try:
            fields["upstream_status"] = response.status_code
            await self._relay(response, responder, extra, recorder)
        finally:
            await response.aclose()
            if exchange is not None:
                count_for_log(exchange)
                state.fingerprints.remember_counts(
                    exchange.conversation,
                    exchange.original,
                    exchange.measure.counted(exchange.original),
                )
            if recorder is not None and exchange is not None:
                answer = {"status": response.status_code} | recorder.result()
                state.archiver.finish(exchange, answer)
                calibrate(state, exchange, answer)

    async def _plan(self, state: AppState, raw: bytes, exchange: Exchange | None) -> bytes:
        """Run the pipeline; the body to forward (the client's bytes unless rewritten)."""
        if exchange is None:
            return raw
        await state.pipeline.run(exchange)
        if not exchange.changed:
            return raw
        ex = exchange
        return await off_loop(len(raw), lambda: encode_body(ex.body, ex.messages))

    async def _send(
        self, state: AppState, scope: Scope, tenant: Tenant, payload: bytes, responder: Responder
    ) -> httpx.Response | None:
        """Forward; the upstream's response (streamed), or None once an error was answered."""
        upstream = tenant.upstream
        client = state.upstreams.client(upstream)
        request = client.build_request(
            "POST",
            upstream_url(upstream, scope["path"], scope.get("query_string", b"")),
            headers=request_headers(scope["headers"], upstream, keep_encoding=True)
            + sized(payload),
            content=in_slices(payload),
        )
        try:
            return await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            err = translate(exc)
            if err is None:
                raise
            log_fields(scope)["error"] = err.code
            await responder.error(err)
            return None

    async def _recover(
        self,
        state: AppState,
        scope: Scope,
        tenant: Tenant,
        raw: bytes,
        exchange: Exchange,
        response: httpx.Response,
        responder: Responder,
    ) -> tuple[httpx.Response | None, Exchange]:
        """The retry's response if the upstream overflowed, else this error (re-readable)."""
        body, rest = await _read_error(response)
        overflow = None
        if rest is None and exchange.control != "off":
            overflow = detect(
                response.status_code, body, response.headers.get("content-encoding", "")
            )
        if overflow is None:
            return _replayed(response, body, rest), exchange
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
        retry = retry_exchange(exchange, window)
        payload = await self._plan(state, raw, retry)
        return await self._send(state, scope, tenant, payload, responder), retry

    async def _relay(
        self,
        response: httpx.Response,
        responder: Responder,
        extra: dict[str, str],
        recorder: AnswerRecorder | None,
    ) -> None:
        if responder.started:
            # The SSE stream is already open (compaction progress was sent): an
            # upstream error can only be reported in-band.
            if response.status_code >= 400:
                body = await _bounded_read(response)
                await responder.chunk(
                    b"data: " + _as_error_event(body, response.status_code) + b"\n\n"
                )
                await responder.end()
                return
        else:
            responder.sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if responder.sse:
                extra = {**extra, "x-accel-buffering": "no"}
            headers = response_headers(response.headers, decoded=False, extra=extra)
            await responder.start(response.status_code, headers)
        try:
            # Raw bytes, as the upstream sent them (compressed ones stay compressed, with
            # their Content-Encoding): nothing is decoded on the way to the client.
            async for chunk in response.aiter_raw():
                await responder.chunk(chunk)
                if recorder is not None:
                    recorder.feed(chunk)
        except httpx.HTTPError as exc:
            err = translate(exc)
            if err is None:
                raise
            # Reported (in-band, the stream has started) where it is also logged.
            raise err from None
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


async def _read_error(response: httpx.Response) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """An error answer's raw bytes, up to MAX_ERROR_BYTES; and the rest, if it is longer."""
    chunks = response.aiter_raw()
    out = bytearray()
    async for chunk in chunks:
        out += chunk
        if len(out) > MAX_ERROR_BYTES:
            return bytes(out), chunks
    return bytes(out), None


def _replayed(
    response: httpx.Response, body: bytes, rest: AsyncIterator[bytes] | None
) -> httpx.Response:
    """The answer again, readable from its first byte, its headers as the upstream sent them."""
    return httpx.Response(
        response.status_code, headers=response.headers, stream=_Replay(response, body, rest)
    )


class _Replay(httpx.AsyncByteStream):
    def __init__(
        self, response: httpx.Response, body: bytes, rest: AsyncIterator[bytes] | None
    ) -> None:
        self._response, self._body, self._rest = response, body, rest

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._body
        if self._rest is not None:
            async for chunk in self._rest:
                yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


async def _bounded_read(response: httpx.Response) -> bytes:
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) > MAX_ERROR_BODY:
            break
    return bytes(out)


def _as_error_event(body: bytes, status: int) -> bytes:
    """The upstream's own error object when it sent one, else a generic one with its status."""
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return json.dumps(parsed).encode()
    except ValueError:
        pass
    text = body[:2000].decode("utf-8", "replace")
    return json.dumps(
        {
            "error": {
                "message": text or f"upstream status {status}",
                "type": "upstream_error",
                "param": None,
                "code": status,
            }
        }
    ).encode()
