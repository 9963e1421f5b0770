"""`POST /v1/chat/completions`: parse, classify, run the pipeline, forward, stream back.

The one route where the proxy reads the request. A body it cannot understand (not
JSON, `messages` missing or not a list) is forwarded byte for byte: the proxy
never rejects what the upstream might accept, and the log says why it was left
alone. When a stage rewrites the messages, only `messages` changes in the
forwarded body; every other field goes through as sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from proxy import numbers
from proxy.config import Tenant
from proxy.encoding import TooLarge, Undecodable, can_decode, decode, encodings
from proxy.errors import PayloadTooLarge, RecapError
from proxy.identity import conversation_ref, resolve_tenant
from proxy.logs import log_fields
from proxy.measure import Measure
from proxy.messages import classify, json_bytes
from proxy.pipeline import Control, Exchange
from proxy.relay import (
    ClientDisconnected,
    FinalBytesGate,
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
from proxy.upstream import mapped_errors, request_headers, response_headers, upstream_url

log = logging.getLogger("recap.chat")

MAX_ERROR_BODY = 64 * 1024
# A compressed body larger than this is decoded in a thread, off the event loop.
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class ChatBody:
    """The request body as it came (`raw`, forwarded when nothing changes) and as read."""

    raw: bytes
    # Decoded from its Content-Encoding (the same bytes when it had none or when it
    # could not be decoded: then it is not parsed either).
    decoded: bytes
    # Numbers whose text Python would not write back the same (numbers.py).
    kept_numbers: bool = False


async def decode_body(raw: bytes, content_encoding: str, limit: int) -> tuple[bytes | None, str]:
    """The body without its Content-Encoding, at most `limit` bytes once decoded (else 413);
    (None, why) when it cannot be decoded (then it is forwarded as it came)."""
    codings = encodings(content_encoding)
    if not codings:
        return raw, ""
    if not can_decode(codings):
        return None, f"body has a Content-Encoding the proxy cannot read ({content_encoding})"
    try:
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(decode, raw, codings, limit), ""
        return decode(raw, codings, limit), ""
    except TooLarge:
        raise PayloadTooLarge(
            f"Request body is over the proxy's limit of {limit} bytes once decoded."
        ) from None
    except Undecodable as exc:
        return None, f"body is not valid {content_encoding}: {exc}"


def parse_chat(raw: bytes) -> tuple[dict[str, Any] | None, str, bool]:
    """The body as a dict when the proxy can safely work on it, else (None, why not);
    and whether it holds numbers kept as written (see numbers.py)."""
    try:
        body, kept = numbers.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "body is not JSON", False
    except RecursionError:
        return None, "body is nested too deeply to parse", False
    if not isinstance(body, dict):
        return None, "body is not a JSON object", False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None, "messages missing or not a list", False
    if not all(isinstance(m, dict) for m in messages):
        return None, "a message is not an object", False
    return body, "", kept


def control_of(headers: Mapping[str, str]) -> Control:
    value = headers.get("x-recap-compaction", "auto").strip().lower()
    return value if value in ("off", "auto", "force") else "auto"  # type: ignore[return-value]


def encode_body(body: dict[str, Any], messages: list[Any], kept_numbers: bool = False) -> bytes:
    """Deterministic serialisation: the same messages give the same bytes (prompt caches)."""
    out = dict(body)
    out["messages"] = messages
    if kept_numbers:
        return numbers.dumps(out, separators=(",", ":"))
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
            decoded, why = await decode_body(
                raw, headers.get("content-encoding", ""), config.max_body_bytes
            )
            body, kept = None, False
            if decoded is not None:
                body, why, kept = parse_chat(decoded)
            incoming = ChatBody(raw, raw if decoded is None else decoded, kept)
            exchange: Exchange | None = None
            if body is None:
                fields["passthrough_reason"] = why
                log.info(
                    "chat body forwarded unchanged: %s",
                    why,
                    extra={"request_id": fields["request_id"]},
                )
            else:
                conv = conversation_ref(config, tenant, headers, body)
                model = body.get("model") if isinstance(body.get("model"), str) else None
                exchange = Exchange(
                    request_id=fields["request_id"],
                    tenant=tenant,
                    conversation=conv,
                    headers=headers,
                    body=body,
                    classification=classify(body["messages"]),
                    context_window=config.context_window(model),
                    measure=Measure(state.counter, model),
                    control=control_of(headers),
                    body_bytes=len(incoming.decoded),
                    log_fields=fields,
                )
                fields.update(
                    conversation=conv.key,
                    model=model,
                    classification=exchange.classification.value,
                    messages=len(body["messages"]),
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
        # Unchanged: the very bytes the client sent, with their Content-Encoding.
        payload = incoming.raw
        out_headers = request_headers(scope["headers"], tenant.upstream, keep_encoding=True)
        if exchange is not None:
            if exchange.stream:
                exchange.notify = self._sse_notifier(responder, exchange)
            await state.pipeline.run(exchange)
            if exchange.changed:
                payload = encode_body(exchange.body, exchange.messages, incoming.kept_numbers)
                # A rewritten body goes up as identity: re-compressing would cost the
                # proxy CPU on every request to save bandwidth on a loopback or LAN hop.
                out_headers = [(k, v) for k, v in out_headers if k != b"content-encoding"]
        upstream = tenant.upstream
        client = state.upstreams.client(upstream)
        overhead_ms = round((time.perf_counter() - start) * 1000, 1)
        fields["overhead_ms"] = overhead_ms
        extra = {"x-recap-overhead-ms": str(overhead_ms)}
        if exchange is not None:
            extra.update(exchange.response_headers)
        # The request's archive record is committed while the upstream answers; the
        # answer's final bytes wait for it (relay.FinalBytesGate).
        committed = None
        if exchange is not None and exchange.archive_now is not None:
            committed = state.archiver.begin(exchange)
        request = client.build_request(
            "POST",
            upstream_url(upstream, scope["path"], scope.get("query_string", b"")),
            headers=out_headers,
            content=payload,
        )
        try:
            with mapped_errors(upstream):
                response = await client.send(request, stream=True)
        except RecapError as err:
            fields["error"] = err.code
            if committed is not None and exchange is not None:
                state.archiver.finish(exchange, {"status": err.status, "error": err.code})
            await responder.error(err)
            return
        recorder = None
        if exchange is not None and exchange.archive_now is not None:
            ctype = response.headers.get("content-type", "")
            recorder = AnswerRecorder(
                streamed=ctype.startswith("text/event-stream"),
                encoding=response.headers.get("content-encoding", ""),
            )
        try:
            fields["upstream_status"] = response.status_code
            with mapped_errors(upstream):
                # A RecapError from here is reported (in-band once the stream has
                # started) where it is also logged.
                await self._relay(response, responder, extra, recorder, committed, start, fields)
        finally:
            await response.aclose()
            if exchange is not None:
                count_for_log(exchange)  # when no record was begun
                state.fingerprints.remember_counts(
                    exchange.conversation,
                    exchange.original,
                    exchange.measure.counted(exchange.original),
                )
            if recorder is not None and exchange is not None:
                answer = {"status": response.status_code} | recorder.result()
                state.archiver.finish(exchange, answer)

    async def _relay(
        self,
        response: httpx.Response,
        responder: Responder,
        extra: dict[str, str],
        recorder: AnswerRecorder | None,
        committed: Awaitable[bool] | None,
        start: float,
        fields: dict[str, Any],
    ) -> None:
        upstream_id = response.headers.get("x-request-id")
        if upstream_id:
            fields["upstream_request_id"] = upstream_id
        early = responder.started
        gate = None
        if committed is not None:
            gate = FinalBytesGate(
                committed,
                sse=response.headers.get("content-type", "").startswith("text/event-stream"),
                length=_length(response.headers.get("content-length")),
            )
        if responder.started:
            # The SSE stream is already open (compaction progress was sent): an
            # upstream error can only be reported in-band.
            if response.status_code >= 400:
                body = await _bounded_read(response)
                if gate is not None:
                    await gate.end(responder)
                await responder.chunk(
                    b"data: " + _as_error_event(body, response.status_code) + b"\n\n"
                )
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


def _length(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


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
