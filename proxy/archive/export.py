"""The lossless archive of one conversation as JSON Lines (format `recap-archive/1`).

Off the data path: streamed by `GET /v1/recap/conversations/{key}/archive` and written
by `recap export`. Lines, in this order:

    {"type": "conversation", "format": "recap-archive/1", "tenant", "key", ...}
    {"type": "message", "fingerprint": FP, "message": {...}}      every archived message,
                                                                   once, in archive order
    {"type": "params", "fingerprint": FP, "params": {...}}        every distinct set of a
                                                                   request's other fields
    {"type": EVENT, "id": N, "created_at": T, "payload": {...}}   every event, in order
    {"type": "summary", "version": N, "summary": "...", ...}      every summary version
    {"type": "end", "messages": M, "params": P, "events": E, "summaries": S}
                                                                   the export is complete

Events name messages by fingerprint; since every message precedes every event, a
reader can resolve them as it goes. A `request` event's payload names its messages
(`messages`: as the client sent them; `sent`: as forwarded, null when unchanged) and
its other fields (`params`), so the request is rebuilt exactly as
`{**params, "messages": [message of each fingerprint]}`. Nothing is held in memory
beyond one page of the store (and the conversation's distinct request parameters): a
conversation of any size streams.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import asdict
from typing import Any

from proxy.archive.inspection import require
from proxy.store.base import ConversationRef, Store, StoreError

FORMAT = "recap-archive/1"


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _message_line(fp: str, body: str, kind: str = "message") -> str:
    # The stored JSON is embedded as is (it is compact JSON with no raw newline), so
    # the message comes out byte for byte as archived, without a parse and re-dump.
    if "\n" in body:
        body = json.dumps(json.loads(body), ensure_ascii=False, separators=(",", ":"))
    return f'{{"type":"{kind}","fingerprint":{json.dumps(fp)},"{kind}":{body}}}\n'


async def export_lines(store: Store, conv: ConversationRef) -> AsyncGenerator[str, None]:
    """The export, line by line. Raises `errors.NotFound` before the first line if the
    conversation does not exist; a store failure later ends the export with an
    `{"type": "error"}` line instead of the `end` line."""
    info = await require(store, conv)
    yield _line(
        {
            "type": "conversation",
            "format": FORMAT,
            "tenant": info.tenant,
            "key": info.key,
            "created_at": info.created_at,
            "updated_at": info.updated_at,
            "message_count": info.message_count,
            "compact_count": info.compact_count,
            "tokens_saved": info.tokens_saved,
            "current_version": info.current_version,
        }
    )
    counts = {"messages": 0, "params": 0, "events": 0, "summaries": 0}
    try:
        async for fp, body in store.iter_archived(conv):
            counts["messages"] += 1
            yield _message_line(fp, body)
        for fp, body in (await store.archived_params(conv)).items():
            counts["params"] += 1
            yield _message_line(fp, body, "params")
        async for event in store.events(conv):
            counts["events"] += 1
            yield _line(
                {
                    "type": event.type,
                    "id": event.id,
                    "created_at": event.created_at,
                    "payload": event.payload,
                }
            )
        for version in await store.summary_versions(conv):
            counts["summaries"] += 1
            yield _line({"type": "summary", **asdict(version)})
    except StoreError as exc:
        yield _line({"type": "error", "message": f"export incomplete: {exc}"})
        return
    yield _line({"type": "end", **counts})
