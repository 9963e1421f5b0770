"""Codex remote compaction at the edge: `/v1/responses/compact`, and a gate before `/v1/responses`.

    POST /v1/responses/compact          -> Recap's own answer: one `compaction` item (JSON)
    POST /v1/responses, input ends in a compaction_trigger
                                        -> Recap's own answer: one `compaction` item (SSE
                                           when `stream` is true, else JSON)
    POST /v1/responses, input holds compaction items Recap issued
                                        -> each replaced by its summary, then the route
                                           (proxy/edge/compacting.py with the Responses adapter)
    anything else                       -> the route, with the very bytes the client sent

A compaction item that is not a valid reference for this tenant is a 400
(`invalid_compaction_reference`) and nothing goes upstream. A tenant whose
`remote_compaction` is `passthrough` (an upstream that is OpenAI itself) skips all of
this: both routes forward as they came. See docs/codex.md.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.config import Tenant
from proxy.dialects.base import Parsed, Unparsed
from proxy.dialects.chat import parse_json, write_json
from proxy.dialects.responses import ResponsesDialect, server_history_key
from proxy.edge.body import CLIENT_HISTORY, READ_BODY, ReadBody, read_request
from proxy.edge.relay import Scope, until_disconnect
from proxy.edge.route import Call, Route
from proxy.errors import BadRequest, RecapError
from proxy.history.conversation_ref import ConversationRef
from proxy.history.identity import conversation_ref, credentials_of, is_derived, resolve_tenant
from proxy.history.messages import fingerprint
from proxy.pipeline import ClientHistory
from proxy.planning.remote import (
    CompactionRequest,
    Holder,
    RemoteAction,
    compact_object,
    fork_parent,
    may_hold_compaction,
    read_input,
    response_object,
    stream_events,
)
from proxy.record import RemoteNote
from proxy.stages.offload import off_loop
from proxy.stages.remote import Compacted, RemoteCompactor
from proxy.state import AppState

log = logging.getLogger("recap.remote")

App = Any  # an ASGI app


def _with_body(scope: Scope, body: bytes, client: ClientHistory | None) -> Scope:
    """`scope` for a body Recap rewrote: its length, no Content-Encoding (it is identity),
    and the history as the client sent it, for the archive."""
    headers = [
        (k, v)
        for k, v in scope["headers"]
        if k.lower() not in (b"content-length", b"content-encoding", b"transfer-encoding")
    ]
    return {
        **scope,
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        READ_BODY: ReadBody(body, body),
        CLIENT_HISTORY: client,
    }


def _client_history(decoded: bytes) -> ClientHistory | None:
    """The client's own body in the neutral view, with fingerprints: what the archive keeps
    as sent (its compaction items, not the summaries they expand to). None: not readable
    so (the archive then keeps the expanded history only)."""
    parsed = ResponsesDialect().parse(decoded)
    if not isinstance(parsed, Parsed):
        return None
    try:
        fingerprints = [fingerprint(m) for m in parsed.messages]
    except (TypeError, ValueError, RecursionError):
        return None
    return ClientHistory(parsed.messages, fingerprints)


def _input_of(decoded: bytes) -> tuple[dict[str, Any], bool, list[Any]] | None:
    """The body, whether it keeps numbers as written, and its input items; None when
    this is not a body remote compaction reads (the route decides what to do with it)."""
    loaded = parse_json(decoded)
    if isinstance(loaded, Unparsed):
        return None
    body, kept = loaded
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    return body, kept, items


@dataclass(frozen=True)
class _Asked:
    """A `/v1/responses` body that asks for remote compaction: the body, whether it keeps
    numbers as written, and what its input asks."""

    body: dict[str, Any]
    kept: bool
    request: CompactionRequest


def _asked(decoded: bytes) -> _Asked | None:
    """What the body asks of remote compaction; None when it asks nothing (no trigger, no
    compaction item) or is not a body it reads. Parses: off the loop for a large body."""
    if not may_hold_compaction(decoded):
        return None
    found = _input_of(decoded)
    if found is None:
        return None
    body, kept, items = found
    request = read_input(items)
    if not (request.triggered or request.compactions):
        return None
    return _Asked(body, kept, request)


class _Compaction(Route):
    """What both routes share: expand, then compact and answer."""

    dialect = ResponsesDialect()
    errors = dialect.errors

    def holder(self, call: Call, tenant: Tenant, body: dict[str, Any]) -> Holder:
        """The conversation the request's compaction items are presented in: the key it
        names (its `session-id`, `prompt_cache_key`, ...), as its turns' keys are found."""
        conv = conversation_ref(
            call.state.config,
            tenant,
            call.headers,
            body,
            candidates=self.dialect.key_fields(body),
            messages=[],
        )
        return Holder(conv.key, not is_derived(conv), fork_parent(call.headers, body))

    async def compact(
        self,
        call: Call,
        tenant: Tenant,
        body: dict[str, Any],
        kept: bool,
        history: list[Any],
        size: int,
        sent: bytes | None,
    ) -> Compacted:
        """`sent`: the client's body, when it held compaction items (archived as sent)."""
        state, headers, record = call.state, call.headers, call.record
        remote = _remote(state)
        view = {k: v for k, v in body.items() if k != "input"} | {"input": history}

        def read() -> tuple[Parsed, ConversationRef, ClientHistory | None]:
            parsed = self.dialect.parse(write_json(view, kept))
            if not isinstance(parsed, Parsed):
                raise BadRequest(f"This compaction request cannot be read: {parsed.detail}.")
            conv = conversation_ref(
                state.config,
                tenant,
                headers,
                parsed.body,
                candidates=self.dialect.key_fields(parsed.body),
                messages=parsed.messages,
            )
            return parsed, conv, None if sent is None else _client_history(sent)

        parsed, conv, client = await off_loop(size, read)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        record.conversation, record.model = conv.key, model
        record.messages = len(parsed.messages)
        done = await remote.compact(
            tenant,
            conv,
            parsed.messages,
            model=model,
            credentials=credentials_of(headers, self.dialect.credential_headers),
            request_id=record.request_id,
            size=size,
            client=client,
        )
        if record.remote is not None:
            record.remote.version, record.remote.reused = done.version, done.reused
        return done


def _remote(state: AppState) -> RemoteCompactor:
    remote = state.remote
    assert remote is not None  # built in the lifespan with the pipeline
    return remote


class ResponsesCompact(_Compaction):
    """`POST /v1/responses/compact` (Codex's compaction v1)."""

    def __init__(self, passthrough: App) -> None:
        self.passthrough = passthrough

    async def handle(self, call: Call) -> None:
        state, record = call.state, call.record
        tenant = resolve_tenant(state.config, call.headers)
        if tenant.remote_compaction == "passthrough":
            await self.passthrough(call.scope, call.receive, call.send)
            return
        record.tenant = tenant.name
        record.remote = RemoteNote(RemoteAction.COMPACT.value)
        read = await read_request(call.scope, call.receive, state.config.max_body_bytes)
        decoded = read.decoded
        if decoded is None:
            raise BadRequest("A compaction request needs a JSON body with an `input`.")
        size = len(decoded)
        found = await off_loop(size, lambda: _input_of(decoded))
        if found is None:
            raise BadRequest("A compaction request needs a JSON body with an `input`.")
        body, kept, items = found
        history = await _remote(state).expand(
            tenant,
            read_input(items).history,
            holder=self.holder(call, tenant, body),
            size=size,
            request_id=record.request_id,
        )
        sent = decoded if read_input(items).compactions else None
        done = await until_disconnect(
            call.receive, self.compact(call, tenant, body, kept, history, size, sent)
        )
        await call.responder.json(
            200, compact_object(_response_id(), int(time.time()), done.item, done.usage)
        )


class CodexGate(_Compaction):
    """Before `POST /v1/responses`: compaction triggers answered, compaction items expanded."""

    def __init__(self, route: App) -> None:
        self.route = route

    async def handle(self, call: Call) -> None:
        state, scope, record = call.state, call.scope, call.record
        try:
            tenant = resolve_tenant(state.config, call.headers)
        except RecapError:
            await self.route(scope, call.receive, call.send)  # the route answers it, as always
            return
        if tenant.remote_compaction == "passthrough":
            await self.route(scope, call.receive, call.send)
            return
        read = await read_request(scope, call.receive, state.config.max_body_bytes)
        decoded = read.decoded
        asked = None if decoded is None else await off_loop(len(decoded), lambda: _asked(decoded))
        if decoded is None or asked is None:
            scope[READ_BODY] = read  # the route reads it from here, not again
            await self.route(scope, call.receive, call.send)
            return
        body, kept, size = asked.body, asked.kept, len(decoded)
        if server_history_key(body) is not None:
            # The upstream holds the history: Recap cannot compact or expand it.
            log.info(
                "compaction item or trigger with a history the upstream holds: forwarded",
                extra={"request_id": record.request_id},
            )
            scope[READ_BODY] = read
            await self.route(scope, call.receive, call.send)
            return
        record.tenant = tenant.name
        history = await _remote(state).expand(
            tenant,
            asked.request.history,
            holder=self.holder(call, tenant, body),
            size=size,
            request_id=record.request_id,
        )
        if not asked.request.triggered:
            record.remote = RemoteNote(RemoteAction.EXPANDED.value)
            view = {**body, "input": history}
            rewritten, client = await off_loop(
                size, lambda: (write_json(view, kept), _client_history(decoded))
            )
            await self.route(_with_body(scope, rewritten, client), call.receive, call.send)
            return
        record.remote = RemoteNote(RemoteAction.TRIGGER.value)
        sent = decoded if asked.request.compactions else None
        await until_disconnect(
            call.receive, self._answer(call, tenant, body, kept, history, size, sent)
        )

    async def _answer(
        self,
        call: Call,
        tenant: Tenant,
        body: dict[str, Any],
        kept: bool,
        history: list[Any],
        size: int,
        sent: bytes | None,
    ) -> None:
        responder = call.responder
        model = body.get("model") if isinstance(body.get("model"), str) else None
        response_id, created = _response_id(), int(time.time())
        if body.get("stream") is not True:
            done = await self.compact(call, tenant, body, kept, history, size, sent)
            await responder.json(
                200, response_object(response_id, model, created, done.item, done.usage)
            )
            return
        # Streamed: open the stream now, so a long summarizer call keeps it alive.
        await responder.start_sse([(b"x-accel-buffering", b"no")])
        await responder.comment("recap compacting")
        try:
            done = await self.compact(call, tenant, body, kept, history, size, sent)
        except RecapError as err:
            call.record.error = err.code
            await responder.chunk(_failed(response_id, model, created, err))
            await responder.end()
            return
        for event in stream_events(response_id, model, created, done.item, done.usage):
            await responder.chunk(_sse(event))
        await responder.end()


def _response_id() -> str:
    return "resp_recap_" + uuid.uuid4().hex


def _sse(event: Mapping[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _failed(response_id: str, model: str | None, created: int, err: RecapError) -> bytes:
    """`response.failed`, the event a Responses client reads as a failed response."""
    response = response_object(response_id, model, created, None, None)
    error = err.body()["error"]
    response.update(status="failed", error={"code": error["code"], "message": error["message"]})
    return _sse({"type": "response.failed", "sequence_number": 0, "response": response})
