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

import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.archive.archiver import message_json
from proxy.config import Config, Tenant
from proxy.dialects.responses import ResponsesDialect
from proxy.errors import BadRequest, CompactionFailed, Conflict, PayloadTooLarge
from proxy.history.messages import Message, chain_of, fingerprint, is_pinned, split_pinned
from proxy.history.tokens import TokenCounter
from proxy.pipeline import ClientHistory
from proxy.planning.budget import ITEM_SEPARATOR_TOKENS, TranscriptBudget
from proxy.planning.framing import prompt_chars
from proxy.planning.outcome import Layer, retry_detail
from proxy.planning.reference import BadReference, Reference, issue, verify
from proxy.planning.remote import (
    Holder,
    Unavailable,
    Usage,
    belongs,
    compaction_item,
    earlier_summary_item,
    guard_view,
    is_compaction,
    summary_item,
    unavailable_item,
)
from proxy.planning.transcript import detect_language, render_transcript, render_within
from proxy.stages.audit import audit
from proxy.stages.offload import off_loop
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import (
    MIN_TRANSCRIPT_TOKENS,
    Summarizer,
    SummarizerFailed,
    call_limits,
)
from proxy.store.base import CompactionRecord, ConversationRef, NewSummary, Store

log = logging.getLogger("recap.remote")

# Compaction items one request may carry. Codex sends one (its history after a compaction
# holds the newest item only); each expands to a whole summary, so the count is bounded.
MAX_COMPACTION_ITEMS = 16


class InvalidReference(BadRequest):
    code = "invalid_compaction_reference"


class TooManyCompactionItems(BadRequest):
    code = "too_many_compaction_items"


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

    async def secret(self) -> bytes:
        if not self._secret:
            self._secret = await self.store.deployment_secret()
        return self._secret

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

    async def compact(
        self,
        tenant: Tenant,
        conv: ConversationRef,
        messages: Sequence[Message],
        *,
        model: str | None,
        authorization: str | None,
        request_id: str,
        size: int,
        client: ClientHistory | None = None,
    ) -> Compacted:
        """One summary version standing for the history `messages` (the neutral view of
        an input whose compaction items are already expanded), and the compaction item
        referencing it. As for session summaries, the leading instructions are not in it
        and later ones are not summarised. `client`: the history as the client sent it,
        when it held compaction items (archived too). `size`: the bytes of the request's body; for a
        large one the history is hashed, counted and rendered off the event loop
        (proxy.stages.offload). Raises Conflict (nothing to compact) or CompactionFailed
        (the summarizer failed)."""

        def count(text: str) -> int:
            return self.counter.count_text(text, model)

        history = await off_loop(size, lambda: _weigh(messages, count, client))
        body = history.body
        if not any(not is_pinned(m) for m in body):
            raise Conflict("Nothing to compact: the input holds only instructions.")
        chain, before = history.chain, history.tokens
        secret = await self.secret()
        policy = tenant.compaction.session
        async with self.store.conversation_lock(conv):
            prior = await self.store.matching_summary(conv, chain)
            if prior is not None and prior.covered == len(body):
                # A retry of the same compaction (Codex retries a failed stream): the same item.
                return self._answer(
                    secret, tenant, conv, prior.version, chain[-1], prior.summary, before, True
                )
            start = time.perf_counter()
            # The originals first: a summary never exists whose originals are missing.
            await self.store.archive_messages(conv, history.rows)
            summary = prior.summary if prior is not None else ""
            begin = prior.covered if prior is not None else 0
            scene = self.scenes[tenant.name].get(policy.scene)
            tokens_in = tokens_out = retries = salvaged = 0
            used = model or ""
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
                "language": history.language,
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
            batches = await off_loop(
                size,
                lambda: _batches(body, begin, policy.max_batch_messages, limits.budget),
            )
            for k, (a, b) in enumerate(batches):
                span = [m for m in body[a:b] if not is_pinned(m)]
                if not span:
                    continue
                room = limits.budget.limit(k)
                try:
                    if room < MIN_TRANSCRIPT_TOKENS:
                        raise SummarizerFailed("summarizer context_window too small")
                    transcript = await off_loop(
                        size,
                        functools.partial(render_within, span, policy.max_item_chars, room, count),
                    )
                    result = await self.summarizer.summarize(
                        tenant,
                        scene,
                        {"transcript": transcript, **values, "existing_summary": summary},
                        model=model,
                        authorization=authorization,
                        max_chars=policy.max_summary_chars,
                        # The guard reads each message's head and tail (guard_view).
                        replaced=[
                            *([{"role": "assistant", "content": summary}] if summary else []),
                            *(guard_view(m) for m in span),
                        ],
                        max_tokens=limits.max_tokens,
                        # Codex's own API is the Responses API; its summary is asked for
                        # as every Responses request's is.
                        call=ResponsesDialect.summary_call,
                    )
                except SummarizerFailed as exc:
                    detail = retry_detail(exc.reason, int(exc.retried), 0)
                    await self._audit(conv, "failed", detail, history, summary, used, start)
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
                conv, "ok", detail, history, summary, used, start, version.version, request_id
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
        history: _History,
        summary: str,
        model: str,
        start: float,
        version: int | None = None,
        request_id: str = "",
    ) -> None:
        tokens, chars = history.tokens, history.chars
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
            {"request_id": request_id, "version": version, "covered": len(history.body)},
        )


@dataclass(frozen=True)
class _History:
    """A history to compact, worked out once: hashing, counting and writing its messages'
    JSON is what costs on a large request (`_weigh`, off the loop for one)."""

    # Its messages after the leading instructions (what the summary stands for).
    body: list[Message]
    chain: list[str]
    # (fingerprint, JSON) of each, for the archive.
    rows: list[tuple[str, str]]
    # Its tokens as one transcript, and its characters as JSON (the audit's "before").
    tokens: int
    chars: int
    language: str


def _weigh(
    messages: Sequence[Message], count: Callable[[str], int], client: ClientHistory | None
) -> _History:
    _, body = split_pinned(messages)
    rows = [(fingerprint(m), message_json(m)) for m in body]
    chars = sum(len(text) for _, text in rows)
    chain = chain_of([fp for fp, _ in rows])
    if client is not None:
        # The client's own messages too (its compaction items): lossless on disk.
        have = {fp for fp, _ in rows}
        rows += [
            (fp, message_json(m))
            for fp, m in zip(client.fingerprints, client.messages, strict=True)
            if fp not in have
        ]
    return _History(
        body=body,
        chain=chain,
        rows=rows,
        tokens=count(render_transcript(body, 1 << 30)),
        chars=chars,
        language=detect_language(body),
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
