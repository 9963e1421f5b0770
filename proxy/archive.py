"""The lossless archive on the data path: originals first, events after.

    archive stage (first)  every message the client sent that the archive lacks is
                           written before any compaction may run; if that write fails,
                           the request is not compacted at all (seed 002 §5.5)
    record stage (last)    the `request` event: which messages came, which went
                           upstream (synthetic ones, such as summaries and trimmed
                           placeholders, are archived too), written in the background
    after the response     the `response` event: the assistant output (rebuilt from the
                           SSE stream when streamed), usage and finish reason

Event payloads reference messages by fingerprint; the messages table holds each
distinct message of a conversation once. Background writes never fail a request:
they are logged, and `drain` waits for them at shutdown.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from proxy.messages import Message, fingerprint
from proxy.pipeline import Exchange
from proxy.store.base import ConversationRef, EventType, Store, StoreError

log = logging.getLogger("recap.archive")


def message_json(message: Message) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


class Archiver:
    def __init__(self, store: Store, known_limit: int = 200_000) -> None:
        self.store = store
        # (conversation, fingerprint) pairs known to be on disk: most of a re-sent
        # history is, so most requests write one or two messages, not all of them.
        self._known: OrderedDict[tuple[ConversationRef, str], None] = OrderedDict()
        self._known_limit = known_limit
        self._tasks: set[asyncio.Task[None]] = set()

    async def archive(self, conv: ConversationRef, messages: Sequence[Message]) -> list[str]:
        """Write what the archive lacks; returns every message's fingerprint, in order."""
        fps = [fingerprint(m) for m in messages]
        rows: dict[str, str] = {}
        for fp, m in zip(fps, messages, strict=True):
            key = (conv, fp)
            if key in self._known:
                self._known.move_to_end(key)
            elif fp not in rows:
                rows[fp] = message_json(m)
        if rows:
            await self.store.archive_messages(conv, list(rows.items()))
            for fp in rows:
                self._known[(conv, fp)] = None
            while len(self._known) > self._known_limit:
                self._known.popitem(last=False)
        return fps

    def forget(self, conv: ConversationRef) -> None:
        """After a prune deleted the conversation, its messages are no longer on disk."""
        for key in [k for k in self._known if k[0] == conv]:
            del self._known[key]

    def clear(self) -> None:
        """Forget what is known to be on disk (after a prune deleted conversations)."""
        self._known.clear()

    def event(self, conv: ConversationRef, type: EventType, payload: Mapping[str, Any]) -> None:
        self.background(self.store.append_event(conv, type, payload), f"{type} event")

    def background(self, work: Coroutine[Any, Any, Any], what: str) -> None:
        async def run() -> None:
            try:
                await work
            except StoreError as exc:
                log.warning("archive write failed (%s): %s", what, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 10.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class ArchiveOriginals:
    """First stage: the originals are on disk before anything is compacted."""

    name = "archive"

    def __init__(self, archiver: Archiver) -> None:
        self.archiver = archiver

    async def __call__(self, ex: Exchange, /) -> None:
        try:
            ex.fingerprints = await self.archiver.archive(ex.conversation, ex.original)
        except StoreError as exc:
            # Ordering rule: no archive, no compaction; the request goes as it came.
            ex.control = "off"
            ex.log_fields["archive_error"] = str(exc)
            ex.response_headers["x-recap-compaction"] = "none"
            log.warning("archive write failed, request not compacted: %s", exc)
            return
        ex.archived = True


class RecordRequest:
    """Last stage: the `request` event, written after the request has gone upstream."""

    name = "record"

    def __init__(self, archiver: Archiver) -> None:
        self.archiver = archiver

    async def __call__(self, ex: Exchange, /) -> None:
        if not ex.archived:
            return
        conv = ex.conversation
        outgoing = ex.messages
        archiver = self.archiver

        async def write() -> None:
            sent = ex.fingerprints if not ex.changed else await archiver.archive(conv, outgoing)
            await archiver.store.append_event(
                conv,
                "request",
                {
                    "request_id": ex.request_id,
                    "classification": ex.classification.value,
                    "model": ex.model,
                    "stream": ex.stream,
                    "messages": ex.fingerprints,
                    "sent": sent,
                    "layers": ex.layers,
                    "tokens_before": ex.log_fields.get("tokens_before"),
                    "tokens_after": ex.log_fields.get("input_tokens"),
                },
            )

            if ex.trimmed:
                await archiver.store.append_event(
                    conv,
                    "trim",
                    {
                        "request_id": ex.request_id,
                        "trimmed": ex.log_fields.get("trimmed_results"),
                        "saved_chars": ex.log_fields.get("trimmed_chars_saved"),
                        "originals": ex.trimmed,
                    },
                )

        archiver.background(write(), "request event")
