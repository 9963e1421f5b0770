"""The operator routes under `/v1/recap/`: inspect, export, compact now, roll back.

Off the data path (no request here is forwarded upstream, except the summarizer
call of a manual compaction). Who may ask what:

    admin key (`admin_keys`)   every tenant; names it with `?tenant=` (optional when the
                               config has one tenant; the listing without it shows all)
    a tenant's proxy key       that tenant only; any other `?tenant=` is 404
    no key / unknown key       the open tenant only, and only with `inspection_open: true`;
                               otherwise 401

A conversation is always looked up inside the caller's tenant, so a key that exists
only in another tenant is 404, the same answer as a key that exists nowhere. Errors
are `RecapError`s, rendered in the OpenAI error shape like every other proxy error.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.archive.export import export_lines
from proxy.archive.inspection import detail, list_page, parse_version, require, rollback, view
from proxy.config import Config, Tenant
from proxy.errors import (
    BadRequest,
    CompactionFailed,
    Conflict,
    MethodNotAllowed,
    NotFound,
    Unauthorized,
)
from proxy.history.identity import bearer_token, is_admin_key, resolve_tenant
from proxy.record import ManualNote, RequestRecord, record_of
from proxy.stages.manual import ManualResult, compact_now
from proxy.stages.session import SessionStage
from proxy.state import AppState
from proxy.store.base import ConversationRef

MAX_BODY = 64 * 1024
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
EXPORT_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Caller:
    admin: bool
    # None only for an admin listing every tenant.
    tenant: Tenant | None
    # Forwarded to the summarizer when the tenant's upstream has no key of its own, as a
    # chat request's would be; never an admin key.
    authorization: str | None


def resolve_caller(
    config: Config, headers: Mapping[str, str], named: str | None, *, need_tenant: bool
) -> Caller:
    if is_admin_key(config, bearer_token(headers)):
        if named is not None:
            tenant = config.tenants.get(named)
            if tenant is None:
                raise NotFound(f"No tenant {named!r}.")
            return Caller(True, tenant, None)
        if not need_tenant:
            return Caller(True, None, None)
        if len(config.tenants) == 1:
            return Caller(True, next(iter(config.tenants.values())), None)
        raise BadRequest("An admin key must name the tenant: ?tenant=NAME.", "tenant")
    try:
        tenant = resolve_tenant(config, headers)
    except Unauthorized:
        # Not the chat route's "Invalid proxy API key.": here a key is an operator's.
        raise Unauthorized(
            "That key is neither an admin key (admin_keys) nor a tenant's proxy key."
            if bearer_token(headers)
            else "The /v1/recap/ routes need a tenant's proxy key or an admin key."
        ) from None
    if tenant.is_open and not config.inspection_open:
        raise Unauthorized("The /v1/recap/ routes need a tenant's proxy key or an admin key.")
    if named is not None and named != tenant.name:
        raise NotFound(f"No tenant {named!r}.")
    return Caller(False, tenant, headers.get("authorization"))


Handler = Callable[[Request, AppState, RequestRecord], Awaitable[Response]]


def _endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        # A RecapError or StoreError raised here is rendered by the app's error
        # boundary (boundary.py), like every other route's.
        state: AppState = request.state.recap
        record = record_of(request.scope)
        # What the archiver holds (journaled, not yet stored) goes to the store first: an
        # operator sees every request answered so far.
        await state.archiver.flush()
        return await handler(request, state, record)

    return endpoint


def _headers(request: Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


def _conversation(
    request: Request, state: AppState, record: RequestRecord
) -> tuple[Caller, Tenant, ConversationRef]:
    caller = _caller(request, state, record, need_tenant=True)
    assert caller.tenant is not None  # need_tenant
    key = request.path_params["key"]
    record.conversation = key
    return caller, caller.tenant, ConversationRef(caller.tenant.name, key)


def _caller(
    request: Request, state: AppState, record: RequestRecord, *, need_tenant: bool
) -> Caller:
    named = request.query_params.get("tenant") or None
    caller = resolve_caller(state.config, _headers(request), named, need_tenant=need_tenant)
    if caller.tenant is not None:
        record.tenant = caller.tenant.name
    return caller


async def _list(request: Request, state: AppState, record: RequestRecord) -> Response:
    caller = _caller(request, state, record, need_tenant=False)
    params = request.query_params
    try:
        limit = int(params.get("limit", "50"))
    except ValueError:
        raise BadRequest("limit must be an integer", "limit") from None
    try:
        before = float(params["before"]) if params.get("before") else None
    except ValueError:
        raise BadRequest("before must be a number (a page's next_before)", "before") from None
    tenant = caller.tenant.name if caller.tenant else None
    cursor = params.get("cursor") or None
    return JSONResponse(await list_page(state.store, tenant, limit, before, cursor))


async def _detail(request: Request, state: AppState, record: RequestRecord) -> Response:
    _, _, conv = _conversation(request, state, record)
    return JSONResponse(await detail(state.store, conv))


async def _view(request: Request, state: AppState, record: RequestRecord) -> Response:
    _, _, conv = _conversation(request, state, record)
    return JSONResponse(await view(state.store, conv))


async def _export(request: Request, state: AppState, record: RequestRecord) -> Response:
    _, _, conv = _conversation(request, state, record)
    lines: AsyncGenerator[str, None] = export_lines(state.store, conv)
    # The first line is read here so that a missing conversation is a 404, not an
    # empty 200: once streaming has begun the status cannot change.
    first = await anext(lines)

    async def body() -> AsyncIterator[bytes]:
        buffer = [first]
        size = len(first)
        try:
            async for line in lines:
                buffer.append(line)
                size += len(line)
                if size >= EXPORT_CHUNK:
                    yield "".join(buffer).encode()
                    buffer, size = [], 0
            yield "".join(buffer).encode()
        finally:
            await lines.aclose()

    filename = "recap-archive.jsonl"
    return StreamingResponse(
        body(),
        media_type="application/x-ndjson",
        headers={"content-disposition": f'attachment; filename="{filename}"'},
    )


async def _compact(request: Request, state: AppState, record: RequestRecord) -> Response:
    caller, tenant, conv = _conversation(request, state, record)
    result = await manual_compaction(state, caller, tenant, conv, record)
    return JSONResponse(
        {
            "object": "recap.compaction",
            "tenant": conv.tenant,
            "key": conv.key,
            "version": result.version,
            "summary": result.summary,
            "covered": result.covered,
            "tokens_before": result.tokens_before,
            "tokens_after": result.tokens_after,
            "tokens_saved": max(0, result.tokens_before - result.tokens_after),
        }
    )


async def manual_compaction(
    state: AppState, caller: Caller, tenant: Tenant, conv: ConversationRef, record: RequestRecord
) -> ManualResult:
    """Compact now (the JSON route and the web page's button), noting it in the access log."""
    stage = next((s for s in state.pipeline.stages if s.name == "session"), None)
    if not isinstance(stage, SessionStage):
        raise Conflict("Session compaction is not part of this proxy's pipeline.")
    await require(state.store, conv)
    start = time.perf_counter()

    def took() -> float:
        return round((time.perf_counter() - start) * 1000, 1)

    try:
        result = await compact_now(
            state.store, stage, state.config, tenant, conv, caller.authorization
        )
    except (CompactionFailed, Conflict) as exc:
        status = "failed" if isinstance(exc, CompactionFailed) else "skipped"
        record.manual = ManualNote(status, took(), exc.message)
        raise
    record.manual = ManualNote("ok", took())
    return result


async def _rollback(request: Request, state: AppState, record: RequestRecord) -> Response:
    _, _, conv = _conversation(request, state, record)
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise BadRequest("rollback body is too large")
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        raise BadRequest("rollback body is not JSON") from None
    version = parse_version(body)
    result = await rollback(state.store, conv, version, record.request_id)
    return JSONResponse(result)


async def _unknown(request: Request, state: AppState, record: RequestRecord) -> Response:
    raise NotFound(f"Unknown path {request.url.path} ({request.method})")


# What may follow a conversation key: (methods, handler). None is the key alone.
_SUBROUTES: dict[str | None, tuple[frozenset[str], Handler]] = {
    None: (frozenset({"GET", "HEAD"}), _detail),
    "archive": (frozenset({"GET", "HEAD"}), _export),
    "view": (frozenset({"GET", "HEAD"}), _view),
    "compact": (frozenset({"POST"}), _compact),
    "rollback": (frozenset({"POST"}), _rollback),
}
CONVERSATIONS = "/v1/recap/conversations"


def split_conversation_path(raw_path: bytes) -> tuple[str, str | None] | None:
    """(key, sub-route) from the raw path, or None when it names no conversation route.

    Matched on the raw (still percent-encoded) path, one segment per key: a key is
    any text, percent-encoded as one segment (quote(key, safe="")), so a key that
    itself ends in "/view" or holds "%" is still that key, never a sub-route.
    """
    prefix = CONVERSATIONS.encode() + b"/"
    if not raw_path.startswith(prefix):
        return None
    parts = raw_path[len(prefix) :].split(b"/")
    if len(parts) > 2 or not parts[0]:
        return None
    key = unquote_to_bytes(parts[0]).decode("utf-8", "replace")
    if len(parts) == 1:
        return key, None
    sub = parts[1].decode("latin-1")
    return (key, sub) if sub in _SUBROUTES and sub else None


async def _conversation_route(request: Request, state: AppState, record: RequestRecord) -> Response:
    raw = request.scope.get("raw_path") or request.scope["path"].encode("utf-8")
    found = split_conversation_path(raw.split(b"?", 1)[0])
    if found is None:
        raise NotFound(f"Unknown path {request.url.path} ({request.method})")
    key, sub = found
    methods, handler = _SUBROUTES[sub]
    if request.method not in methods:
        raise MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}")
    request.scope["path_params"] = {"key": key}
    return await handler(request, state, record)


def operator_routes() -> list[Route]:
    """Listed before the /v1/ pass-through, which must never see /v1/recap/."""
    return [
        Route(CONVERSATIONS, _endpoint(_list), methods=["GET"]),
        Route(CONVERSATIONS + "/{rest:path}", _endpoint(_conversation_route), methods=ALL_METHODS),
        Route("/v1/recap", _endpoint(_unknown), methods=ALL_METHODS),
        Route("/v1/recap/{path:path}", _endpoint(_unknown), methods=ALL_METHODS),
    ]
