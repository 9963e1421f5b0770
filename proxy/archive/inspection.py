"""What an operator can ask about a conversation: listings, detail, the last view, rollback.

Off the data path: read by the `/v1/recap/` routes (`proxy/edge/operator.py`) and by the `recap`
CLI, both over the same store. Every function takes a `ConversationRef`, so the
tenant is always part of the question; deciding which tenant a caller may name is
the routes' job. Results are plain JSON-ready dicts, rendered by the caller.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from proxy.dialects.base import cache_usage
from proxy.errors import BadRequest, Conflict, NotFound
from proxy.store.base import (
    CompactionRecord,
    ConversationInfo,
    ConversationRef,
    ListPosition,
    Store,
    SummaryVersion,
)
from proxy.store.base import NotFound as StoreNotFound

MAX_PAGE = 500
# Versions are 32-bit integers in both stores (PostgreSQL INTEGER).
MAX_VERSION = 2**31 - 1


def conversation_json(info: ConversationInfo) -> dict[str, Any]:
    return {"object": "recap.conversation", **asdict(info)}


def version_json(v: SummaryVersion) -> dict[str, Any]:
    out = asdict(v)
    out.pop("boundary_hash")  # internal matching state, meaningless to an operator
    out["summary_chars"] = len(v.summary)
    return out


def compaction_json(record: CompactionRecord) -> dict[str, Any]:
    return {**asdict(record), "tokens_saved": _saved(record)}


def _saved(record: CompactionRecord) -> int:
    return max(0, record.tokens_before - record.tokens_after) if record.outcome == "ok" else 0


async def require(store: Store, conv: ConversationRef) -> ConversationInfo:
    """The conversation, or 404 that says nothing about other tenants."""
    info = await store.get_conversation(conv)
    if info is None:
        raise NotFound(f"No conversation {conv.key!r}.")
    return info


async def list_page(
    store: Store,
    tenant: str | None,
    limit: int,
    before: float | None = None,
    cursor: str | None = None,
) -> dict[str, Any]:
    """One page, newest first (then by tenant and key).

    `next_cursor` continues exactly after the last row of this page, also when several
    conversations share its updated_at; pass it back as `cursor`. `before` (and
    `next_before`, kept for older callers) pages by time alone, which skips the rest of
    a page's last updated_at.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"limit must be between 1 and {MAX_PAGE}", "limit")
    after = parse_cursor(cursor) if cursor else None
    rows = await store.list_conversations(tenant, limit + 1, before, after)
    page = rows[:limit]
    more = len(rows) > limit
    last = page[-1] if more and page else None
    return {
        "object": "list",
        "data": [conversation_json(c) for c in page],
        "has_more": more,
        "next_cursor": make_cursor(last) if last else None,
        "next_before": last.updated_at if last else None,
    }


def make_cursor(info: ConversationInfo) -> str:
    """An opaque position after `info` in the listing order."""
    raw = json.dumps([info.updated_at, info.tenant, info.key], ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode("utf-8", "surrogatepass")).decode().rstrip("=")


def parse_cursor(cursor: str) -> ListPosition:
    """The position a `next_cursor` names; 400 for anything this proxy did not make."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        updated_at, tenant, key = json.loads(raw.decode("utf-8", "surrogatepass"))
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest("cursor must be a next_cursor from a listing", "cursor") from None
    valid = (
        isinstance(updated_at, int | float)
        and not isinstance(updated_at, bool)
        and isinstance(tenant, str)
        and isinstance(key, str)
    )
    if not valid:
        raise BadRequest("cursor must be a next_cursor from a listing", "cursor")
    return ListPosition(float(updated_at), tenant, key)


async def detail(store: Store, conv: ConversationRef) -> dict[str, Any]:
    """The current summary, every version, and the audit trail of compactions."""
    info = await require(store, conv)
    versions = await store.summary_versions(conv)
    current = next((v for v in versions if v.current), None)
    return {
        **conversation_json(info),
        "summary": version_json(current) if current else None,
        "versions": [version_json(v) for v in versions],
        "compactions": [compaction_json(r) for r in await store.compactions(conv)],
    }


async def view(store: Store, conv: ConversationRef) -> dict[str, Any]:
    """Exactly what went upstream for the last request: its `sent` fingerprints, resolved."""
    await require(store, conv)
    event = await store.last_event(conv, "request")
    if event is None:
        raise NotFound(f"No archived request for conversation {conv.key!r}.")
    payload = event.payload
    # `sent` is null when the request went upstream exactly as the client sent it.
    sent: list[str] = payload.get("sent") or payload.get("messages") or []
    return {
        "object": "recap.view",
        "event_id": event.id,
        "created_at": event.created_at,
        **{k: payload.get(k) for k in _VIEW_FIELDS},
        **await _cache_of(store, conv, payload.get("request_id")),
        "messages": await archived(store, conv, sent),
    }


async def _cache_of(store: Store, conv: ConversationRef, request_id: Any) -> dict[str, Any]:
    """What the upstream's usage said of that request's input (null until its answer is
    archived, or when the answer carried no usage): all of it, and what its prompt
    cache served."""
    response = await store.last_event(conv, "response")
    same = response is not None and response.payload.get("request_id") == request_id
    cache = cache_usage(response.payload.get("usage")) if response and same else None
    return {
        "upstream_input_tokens": cache.input_tokens if cache else None,
        "cached_input_tokens": cache.cached_tokens if cache else None,
    }


async def archived(store: Store, conv: ConversationRef, fingerprints: list[str]) -> list[Any]:
    """The archived messages with these fingerprints, in this order (a request's list)."""
    bodies = await store.archived_messages(conv, fingerprints)
    missing = sum(fp not in bodies for fp in fingerprints)
    if missing:
        raise Conflict(f"The archive lacks {missing} message(s) of this request.")
    return [json.loads(bodies[fp]) for fp in fingerprints]


_VIEW_FIELDS = (
    "request_id",
    "model",
    "classification",
    "layers",
    # One entry per layer that ran: applying a stored summary is "applied", with its version.
    "compactions",
    "summary_version",
    "tokens_before",
    "tokens_after",
)


def parse_version(body: Any) -> int | None:
    """The rollback target from {"version": N | null}."""
    if not isinstance(body, Mapping) or "version" not in body:
        raise BadRequest('expected a JSON object {"version": N or null}', "version")
    version = body["version"]
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise BadRequest(f"version must be an integer from 1 to {MAX_VERSION}, or null", "version")
    return version


async def rollback(
    store: Store, conv: ConversationRef, version: int | None, request_id: str
) -> dict[str, Any]:
    """Make an earlier version current (or none) and record it as a `rollback` event.

    Later versions stay stored but are no longer matched (only versions numbered at
    most the current one are), so the next compaction starts again from the kept
    version and the archived originals, never from the discarded text.
    """
    await require(store, conv)
    async with store.conversation_lock(conv):
        before = await store.current_summary(conv)
        try:
            await store.set_current_version(conv, version)
        except StoreNotFound:
            raise NotFound(f"No summary version {version} in conversation {conv.key!r}.") from None
        previous = before.version if before else None
        await store.append_event(
            conv, "rollback", {"request_id": request_id, "from": previous, "to": version}
        )
        current = await store.current_summary(conv)
    return {
        "object": "recap.rollback",
        "from": previous,
        "to": version,
        "summary": version_json(current) if current else None,
    }
