"""Codex remote compaction, the IO part: make and keep the summary, expand references.

    compact(history)  under the conversation's lock: reuse a stored version covering
                      exactly this history, else archive the originals, summarise them
                      (folding into a stored version covering a prefix, if any), store
                      a new version (reason `remote`), audit it; then the reference
    expand(input)     each compaction item Recap issued -> the summary it names, as a
                      user message in its place; anything else a compaction item holds
                      -> BadReference (the route answers 400)

The summary versions are the conversation's session summaries (same table, same
rules): the operator routes and CLI list them, roll them back and export them. The
pure parts are `compaction/remote.py` (items) and `compaction/reference.py` (the MAC).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.archive.archiver import message_json
from proxy.config import Config, Tenant
from proxy.dialects.responses import ResponsesDialect
from proxy.errors import BadRequest, CompactionFailed, Conflict
from proxy.history.messages import Message, chain_hashes, fingerprint, is_pinned, split_pinned
from proxy.history.tokens import TokenCounter
from proxy.planning.budget import ITEM_SEPARATOR_TOKENS, TranscriptBudget
from proxy.planning.framing import prompt_chars
from proxy.planning.guard import Earlier
from proxy.planning.outcome import Layer, retry_detail
from proxy.planning.reference import BadReference, Reference, issue, verify
from proxy.planning.remote import (
    Usage,
    compaction_item,
    is_compaction,
    recognised,
    summary_item,
)
from proxy.planning.transcript import detect_language, render_transcript, render_within
from proxy.stages.audit import audit
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import (
    MIN_TRANSCRIPT_TOKENS,
    Summarizer,
    SummarizerFailed,
    call_limits,
)
from proxy.store.base import CompactionRecord, ConversationRef, NewSummary, Store

log = logging.getLogger("recap.remote")

# Summary texts of references seen lately, by (tenant, key, version, boundary): a stored
# version never changes, and every Codex request after a compaction carries its item.
_CACHE_SIZE = 1024


class InvalidReference(BadRequest):
    code = "invalid_compaction_reference"


@dataclass(frozen=True)
class Compacted:
    item: dict[str, Any]
    usage: Usage
    version: int
    reused: bool


class RemoteCompactor:
    def __init__(
        self,
        config: Config,
        store: Store,
        summarizer: Summarizer,
        scenes: Mapping[str, SceneSet],
        counter: TokenCounter,
    ) -> None:
        self.config = config
        self.store = store
        self.summarizer = summarizer
        self.scenes = scenes
        self.counter = counter
        self._secret = config.compaction_secret.encode() if config.compaction_secret else b""
        self._summaries: OrderedDict[tuple[str, str, int, str], str] = OrderedDict()

    async def secret(self) -> bytes:
        if not self._secret:
            self._secret = await self.store.deployment_secret()
        return self._secret

    async def expand(self, tenant: Tenant, items: Sequence[Any]) -> list[Any]:
        """`items` with every compaction item replaced by the summary it references."""
        out = list(items)
        secret = await self.secret()
        language = ""
        if any(is_compaction(item) for item in items):
            language = detect_language(
                [{"role": "user", "content": _texts(item)} for item in items if _texts(item)]
            )
        for i, item in enumerate(items):
            if not is_compaction(item):
                continue
            try:
                ref = verify(secret, tenant.name, item.get("encrypted_content"))
            except BadReference as exc:
                raise InvalidReference(f"input[{i}]: {exc}.", param=f"input[{i}]") from None
            summary = await self._summary(tenant, ref)
            if summary is None:
                raise InvalidReference(
                    f"input[{i}]: this compaction item refers to a summary Recap does not have"
                    " (deleted, or from another store).",
                    param=f"input[{i}]",
                )
            out[i] = summary_item(summary, language or "en")
        return out

    async def _summary(self, tenant: Tenant, ref: Reference) -> str | None:
        cache_key = (tenant.name, ref.key, ref.version, ref.boundary_hash)
        hit = self._summaries.get(cache_key)
        if hit is not None:
            self._summaries.move_to_end(cache_key)
            return hit
        versions = await self.store.summary_versions(ConversationRef(tenant.name, ref.key))
        found = next(
            (
                v
                for v in versions
                if v.version == ref.version and v.boundary_hash == ref.boundary_hash
            ),
            None,
        )
        if found is None:
            return None
        self._summaries[cache_key] = found.summary
        if len(self._summaries) > _CACHE_SIZE:
            self._summaries.popitem(last=False)
        return found.summary

    async def compact(
        self,
        tenant: Tenant,
        conv: ConversationRef,
        messages: Sequence[Message],
        *,
        model: str | None,
        authorization: str | None,
        request_id: str,
    ) -> Compacted:
        """One summary version standing for the history `messages` (the neutral view of
        an input whose compaction items are already expanded), and the compaction item
        referencing it. As for session summaries, the leading instructions are not in it
        and later ones are not summarised. Raises Conflict (nothing to compact) or
        CompactionFailed (the summarizer failed)."""
        _, body = split_pinned(messages)
        if not any(not is_pinned(m) for m in body):
            raise Conflict("Nothing to compact: the input holds only instructions.")
        chain = chain_hashes(body)
        secret = await self.secret()
        policy = tenant.compaction.session
        before = self.counter.count_text(render_transcript(body, 1 << 30), model)
        async with self.store.conversation_lock(conv):
            prior = await self.store.matching_summary(conv, chain)
            if prior is not None and prior.covered == len(body):
                # A retry of the same compaction (Codex retries a failed stream): the same item.
                return self._answer(
                    secret, tenant, conv, prior.version, chain[-1], prior.summary, before, True
                )
            start = time.perf_counter()
            # The originals first: a summary never exists whose originals are missing.
            await self.store.archive_messages(
                conv, [(fingerprint(m), message_json(m)) for m in body]
            )
            summary = prior.summary if prior is not None else ""
            begin = prior.covered if prior is not None else 0
            scene = self.scenes[tenant.name].get(policy.scene)
            language = detect_language(body)
            tokens_in = tokens_out = retries = salvaged = 0
            used = model or ""

            def count(text: str) -> int:
                return self.counter.count_text(text, model)

            weights: dict[int, int] = {}

            def weight(i: int) -> int:
                if i not in weights:
                    m = body[i]
                    text = "" if is_pinned(m) else render_transcript([m], policy.max_item_chars)
                    weights[i] = count(text) + ITEM_SEPARATOR_TOKENS if text else 0
                return weights[i]

            values: dict[str, str | int] = {
                "existing_summary": summary,
                "current_message": "",
                "max_summary_chars": prompt_chars(policy.max_summary_chars),
                "language": language,
            }
            # Every call fits summarizer.context_window, as the session stage's do.
            limits = call_limits(
                tenant,
                scene,
                values,
                max_chars=policy.max_summary_chars,
                count_text=count,
                item_tokens=weight,
            )
            batches = _batches(body, begin, policy.max_batch_messages, limits.budget)
            # Codex sends the summaries it was given back expanded: the guard is told which
            # stored version each one is (its lines are Recap's, not the user's words).
            stored = [v.summary for v in await self.store.summary_versions(conv)]
            for k, (a, b) in enumerate(batches):
                span = [m for m in body[a:b] if not is_pinned(m)]
                if not span:
                    continue
                room = limits.budget.limit(k)
                try:
                    if room < MIN_TRANSCRIPT_TOKENS:
                        raise SummarizerFailed("summarizer context_window too small")
                    result = await self.summarizer.summarize(
                        tenant,
                        scene,
                        {
                            "transcript": render_within(span, policy.max_item_chars, room, count),
                            **values,
                            "existing_summary": summary,
                        },
                        model=model,
                        authorization=authorization,
                        max_chars=policy.max_summary_chars,
                        replaced=[
                            *([Earlier(summary)] if summary else []),
                            *recognised(span, stored),
                        ],
                        max_tokens=limits.max_tokens,
                        # Codex's own API is the Responses API; its summary is asked for
                        # as every Responses request's is.
                        call=ResponsesDialect.summary_call,
                    )
                except SummarizerFailed as exc:
                    detail = retry_detail(exc.reason, int(exc.retried), 0)
                    await self._audit(conv, "failed", detail, before, body, summary, used, start)
                    raise CompactionFailed(f"Compaction failed: {exc.reason}.") from None
                retries += result.retried
                salvaged += result.salvaged
                summary = result.text
                tokens_in += result.input_tokens
                tokens_out += result.output_tokens
                used = result.model
            version = await self.store.add_summary_version(
                conv,
                NewSummary(
                    summary=summary,
                    covered=len(body),
                    boundary_hash=chain[-1],
                    input_tokens=tokens_in,
                    output_tokens=tokens_out,
                    model=used,
                    reason="remote",
                ),
            )
            detail = retry_detail(None, retries, salvaged)
            await self._audit(
                conv, "ok", detail, before, body, summary, used, start, version.version, request_id
            )
            log.info(
                "remote compaction: %d messages into summary version %d",
                len(body),
                version.version,
                extra={"request_id": request_id},
            )
            return self._answer(
                secret, tenant, conv, version.version, chain[-1], summary, before, False
            )

    def _answer(
        self,
        secret: bytes,
        tenant: Tenant,
        conv: ConversationRef,
        version: int,
        boundary: str,
        summary: str,
        tokens_before: int,
        reused: bool,
    ) -> Compacted:
        token = issue(secret, tenant.name, Reference(conv.key, version, boundary))
        usage = Usage(tokens_before, self.counter.count_text(summary, None))
        return Compacted(compaction_item(token), usage, version, reused)

    async def _audit(
        self,
        conv: ConversationRef,
        outcome: str,
        detail: str,
        tokens: int,
        body: Sequence[Message],
        summary: str,
        model: str,
        start: float,
        version: int | None = None,
        request_id: str = "",
    ) -> None:
        chars = sum(len(message_json(item)) for item in body)
        await audit(
            self.store,
            conv,
            CompactionRecord(
                layer=Layer.SESSION,
                reason="remote",
                outcome="ok" if outcome == "ok" else "failed",
                detail=detail,
                tokens_before=tokens,
                tokens_after=self.counter.count_text(summary, None) if outcome == "ok" else tokens,
                chars_before=chars,
                chars_after=len(summary) if outcome == "ok" else chars,
                model=model,
                duration_ms=int((time.perf_counter() - start) * 1000),
            ),
            {"request_id": request_id, "version": version, "covered": len(body)},
        )


def _batches(
    body: Sequence[Message], begin: int, max_items: int, budget: TranscriptBudget
) -> list[tuple[int, int]]:
    """[begin, len(body)) in spans of at most `max_items` items whose transcript fits the
    budget of their call (an item larger than that goes alone, rendered shortened)."""
    spans: list[tuple[int, int]] = []
    a = begin
    while a < len(body):
        b, size = a, 0
        limit = budget.limit(len(spans))
        while b < len(body) and b - a < max(max_items, 1):
            size += budget.tokens(b)
            if b > a and size > limit:
                break
            b += 1
        spans.append((a, b))
        a = b
    return spans


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
