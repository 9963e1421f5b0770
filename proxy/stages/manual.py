"""Manual compaction (seed 002 module E, the memory_compact tool): compact a conversation now.

Used by `POST /v1/recap/conversations/{key}/compact` and `recap compact KEY`. It runs
the session stage alone, forced, over the conversation's last request as archived,
so it follows exactly the session layer's rules and scene (audit reason `manual`).
Unlike the automatic path it fails loudly: a failed or pointless compaction is an
error the caller sees (a 400 when there is no model to ask: neither the last request nor
the scene names one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from proxy.config import Config, Tenant
from proxy.dialects.named import dialect_named
from proxy.errors import BadRequest, CompactionFailed, Conflict, NotFound
from proxy.history.measure import Measure
from proxy.history.messages import classify
from proxy.pipeline import Exchange
from proxy.planning.outcome import Layer, in_words
from proxy.stages.session import SessionStage
from proxy.store.base import ConversationRef, Store


@dataclass(frozen=True)
class ManualResult:
    version: int
    summary: str
    covered: int
    tokens_before: int
    tokens_after: int


async def last_request(store: Store, conv: ConversationRef) -> tuple[dict[str, Any], list[Any]]:
    """The payload of the conversation's last `request` event and its messages, rebuilt."""
    last: dict[str, Any] | None = None
    async for event in store.events(conv):
        if event.type == "request":
            last = event.payload
    if last is None:
        raise NotFound(f"No archived request for conversation {conv.key!r}.")
    fps: list[str] = last["messages"]
    bodies = await store.archived_messages(conv, sorted(set(fps)))
    missing = [fp for fp in fps if fp not in bodies]
    if missing:
        raise Conflict(f"The archive lacks {len(missing)} message(s) of the last request.")
    return last, [json.loads(bodies[fp]) for fp in fps]


async def _already_archived() -> None:
    return None


async def compact_now(
    store: Store,
    stage: SessionStage,
    config: Config,
    tenant: Tenant,
    conv: ConversationRef,
    authorization: str | None,
) -> ManualResult:
    request, messages = await last_request(store, conv)
    model = request.get("model")
    scene = stage.scenes[tenant.name].get(tenant.compaction.session.scene)
    if not scene.model and not (isinstance(model, str) and model):
        # Nothing to ask: the caller's to fix (name a model in the scene), not the upstream's.
        raise BadRequest(
            "The conversation's last request names no model and the session scene names "
            f"none ({tenant.compaction.session.scene}): there is no model to summarize with.",
            "model",
        )
    ex = Exchange(
        request_id="manual-" + uuid.uuid4().hex[:12],
        tenant=tenant,
        conversation=conv,
        headers={"authorization": authorization} if authorization else {},
        body={"model": model, "messages": messages},
        messages=messages,
        # The summarizer asks in the API the conversation's requests came in.
        dialect=dialect_named(request.get("dialect")),
        classification=classify(messages),
        context_window=config.context_window(model if isinstance(model, str) else None),
        control="force",
        measure=Measure(stage.counter, model if isinstance(model, str) else None),
        # The messages came from the archive: they are on disk already.
        archive_now=_already_archived,
    )
    await stage(ex)
    outcome = ex.outcome(Layer.SESSION)
    if outcome is not None and outcome.action == "failed":
        raise CompactionFailed(f"Compaction failed: {outcome.failure or 'unknown'}.")
    if outcome is None or outcome.action != "compacted":
        reason = outcome.skip_reason if outcome else "disabled"
        raise Conflict(f"Nothing was compacted: {in_words(reason)}.")
    current = await store.current_summary(conv)
    assert current is not None  # the stage just wrote it
    before = ex.measure.total(ex.original)
    after = ex.measure.total(ex.messages)
    return ManualResult(current.version, current.summary, current.covered, before, after)
