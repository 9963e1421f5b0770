"""Codex remote compaction: what a compaction item Recap issued expands to (docs/codex.md).

Sits before `/v1/responses` (proxy/edge/codex.py's CodexGate) and before a compaction
(`RemoteCompactor.compact`): each item of the input is verified (its MAC: this tenant's,
this deployment's; else 400), held to the request's conversation (`planning.remote.belongs`),
and looked up in the store on every request that carries it, so an operator's prune or
rollback, from any process, holds at once:

    its version, as stored          -> that summary, framed as a quoted record
    rolled back past                -> the version kept, after Recap's note; none: a note
    gone (pruned, store replaced)   -> Recap's note that the earlier context is gone
    another conversation's          -> Recap's note (a Codex fork of it expands it)

At most MAX_COMPACTION_ITEMS a request, and the expanded body within `max_body_bytes`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from proxy.config import Config, Tenant
from proxy.errors import BadRequest, PayloadTooLarge
from proxy.planning.reference import BadReference, Reference, verify
from proxy.planning.remote import (
    Holder,
    Unavailable,
    belongs,
    earlier_summary_item,
    is_compaction,
    summary_item,
    unavailable_item,
)
from proxy.planning.transcript import detect_language
from proxy.stages.offload import off_loop
from proxy.store.base import ConversationRef, Store

log = logging.getLogger("recap.remote")

# Compaction items one request may carry. Codex sends one (its history after a compaction
# holds the newest item only); each expands to a whole summary, so the count is bounded.
MAX_COMPACTION_ITEMS = 16


class InvalidReference(BadRequest):
    code = "invalid_compaction_reference"


class TooManyCompactionItems(BadRequest):
    code = "too_many_compaction_items"


class Expander:
    """Expands the compaction items of an input; `secret` gives the deployment's MAC key."""

    def __init__(
        self, config: Config, store: Store, secret: Callable[[], Awaitable[bytes]]
    ) -> None:
        self.config = config
        self.store = store
        self.secret = secret

    async def expand(
        self,
        tenant: Tenant,
        items: Sequence[Any],
        *,
        holder: Holder,
        size: int,
        request_id: str,
    ) -> list[Any]:
        """`items` with every compaction item replaced by the summary it references, in
        the conversation `holder` presents them in; `size`: the bytes of the body they came
        from (a large one is read off the loop).

        At most MAX_COMPACTION_ITEMS items (else TooManyCompactionItems), and the body
        they expand to within `max_body_bytes` as the body sent is (else PayloadTooLarge):
        one item of 230 bytes stands for a whole summary."""
        out = list(items)
        at = [i for i, item in enumerate(items) if is_compaction(item)]
        if not at:
            return out
        if len(at) > MAX_COMPACTION_ITEMS:
            raise TooManyCompactionItems(
                f"This input holds {len(at)} compaction items; a request may carry at most"
                f" {MAX_COMPACTION_ITEMS} (Codex sends one).",
                param="input",
            )
        secret = await self.secret()
        language = await off_loop(size, lambda: _language(items)) or "en"
        # The same item sent twice is looked up once.
        made: dict[str, dict[str, Any]] = {}
        for i in at:
            token = items[i].get("encrypted_content")
            if isinstance(token, str) and token in made:
                out[i] = made[token]
                continue
            try:
                ref = verify(secret, tenant.name, token)
            except BadReference as exc:
                raise InvalidReference(f"input[{i}]: {exc}.", param=f"input[{i}]") from None
            if belongs(ref.key, holder):
                expanded = await self._expansion(tenant, ref, language, request_id)
            else:
                # Another conversation's summary is not this one's to read, nor to fold.
                expanded = self._unavailable(Unavailable.FOREIGN, ref, language, request_id)
            out[i] = made[str(token)] = expanded
        grown = sum(_json_bytes(out[i]) - _json_bytes(items[i]) for i in at)
        limit = self.config.max_body_bytes
        if size + grown > limit:
            raise PayloadTooLarge(
                f"Request body is over the proxy's limit of {limit} bytes once its compaction"
                " items are expanded.",
                param="input",
            )
        return out

    async def _expansion(
        self, tenant: Tenant, ref: Reference, language: str, request_id: str
    ) -> dict[str, Any]:
        """What one verified reference expands to, as the store holds it now (read on every
        request: an operator's prune or rollback, from this process or another, holds at
        once). A version the store no longer has (pruned, or the store was replaced; the
        boundary hash tells a later version of the same number apart) is Recap's note
        that the earlier context is gone. A version an operator rolled back past is never
        used again (docs/operating.md): in its place the newest earlier version still in
        use (the one the rollback went back to), after Recap's note that it is an earlier
        one; none (a rollback to none): Recap's note that the summary was withdrawn."""
        conv = ConversationRef(tenant.name, ref.key)
        found = await self.store.summary_version(conv, ref.version)
        if found is None or found.boundary_hash != ref.boundary_hash:
            return self._unavailable(Unavailable.GONE, ref, language, request_id)
        if not found.rolled_back:
            return summary_item(found.summary, language)
        versions = await self.store.summary_versions(conv)
        kept = [v for v in versions if v.version < ref.version and not v.rolled_back]
        if not kept:
            return self._unavailable(Unavailable.WITHDRAWN, ref, language, request_id)
        log.warning(
            "compaction item of version %d rolled back: expanded to version %d",
            ref.version,
            kept[-1].version,
            extra={"request_id": request_id},
        )
        return earlier_summary_item(kept[-1].summary, language)

    def _unavailable(
        self, why: Unavailable, ref: Reference, language: str, request_id: str
    ) -> dict[str, Any]:
        log.warning(
            "compaction item of version %d not expanded (%s): Recap's note in its place",
            ref.version,
            why.value,
            extra={"request_id": request_id},
        )
        return unavailable_item(why, language)


def _json_bytes(item: Any) -> int:
    """An item's size in a body (UTF-8 JSON, as clients write it)."""
    return len(json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode())


def _language(items: Sequence[Any]) -> str:
    """The language of the user's text in `items` (for the summary frame)."""
    return detect_language(
        [{"role": "user", "content": text} for item in items if (text := _texts(item))]
    )


def _texts(item: Any) -> str:
    """The text of a user message item (for the summary frame's language)."""
    if not isinstance(item, Mapping) or item.get("role") != "user":
        return ""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""
