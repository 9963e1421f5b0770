"""Codex remote compaction, the IO part: make and keep the summary; expand references.

    compact(history)  under the conversation's lock: reuse a stored version covering
                      exactly this history, else archive the originals, summarise them
                      (folding into a stored version covering a prefix, if any), store
                      a new version (reason `remote`), audit it; then the reference.
                      A large history is hashed, counted and rendered off the loop.
    expand(input)     each compaction item -> what it stands for now, in its place
                      (proxy/stages/expansion.py)

The summary versions are the conversation's session summaries (same table, same
rules): the operator routes and CLI list them, roll them back and export them. The
pure parts are `planning/remote.py` (items) and `planning/reference.py` (the MAC).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.archive.archiver import message_json
from proxy.config import Config, Tenant
from proxy.dialects.base import SummaryCall
from proxy.dialects.responses import ResponsesDialect
from proxy.errors import CompactionFailed, Conflict
from proxy.history.messages import Message, chain_of, fingerprint, is_pinned, split_pinned
from proxy.history.tokens import TokenCounter
from proxy.pipeline import ClientHistory
from proxy.planning.budget import ITEM_SEPARATOR_TOKENS, MIN_TRANSCRIPT_TOKENS, TranscriptBudget
from proxy.planning.framing import prompt_chars
from proxy.planning.guard import Earlier
from proxy.planning.outcome import Layer, retry_detail
from proxy.planning.reference import Reference, issue
from proxy.planning.remote import (
    Holder,
    Usage,
    compaction_item,
    guard_view,
    recognised,
)
from proxy.planning.transcript import detect_language, render_transcript, render_within
from proxy.stages.audit import audit
from proxy.stages.expansion import Expander
from proxy.stages.offload import off_loop
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import (
    Summarizer,
    SummarizerFailed,
    call_limits,
)
from proxy.store.base import CompactionRecord, ConversationRef, NewSummary, Store

log = logging.getLogger("recap.remote")


@dataclass(frozen=True)
class Compacted:
    item: dict[str, Any]
    usage: Usage
    version: int
    reused: bool
    # The summary the item refers to (Claude Code's compaction is answered with it).
    summary: str = ""


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
        self._expander = Expander(config, store, self.secret)

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
        """`items` with each compaction item expanded (proxy/stages/expansion.py)."""
        return await self._expander.expand(
            tenant, items, holder=holder, size=size, request_id=request_id
        )

    async def compact(
        self,
        tenant: Tenant,
        conv: ConversationRef,
        messages: Sequence[Message],
        *,
        model: str | None,
        credentials: Mapping[str, str],
        request_id: str,
        size: int,
        client: ClientHistory | None = None,
        call: SummaryCall = ResponsesDialect.summary_call,
    ) -> Compacted:
        """One summary version standing for the history `messages` (the neutral view of
        an input whose compaction items are already expanded), and the compaction item
        referencing it. As for session summaries, the leading instructions are not in it
        and later ones are not summarised. `client`: the history as the client sent it,
        when it held compaction items (archived too). `size`: the bytes of the request's
        body; for a large one the history is hashed, counted and rendered off the event
        loop (proxy.stages.offload). `call`: the API the summarizer asks in (Codex's is
        the Responses API's). Raises Conflict (nothing to compact) or CompactionFailed
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
                    transcript = await off_loop(
                        size,
                        functools.partial(render_within, span, policy.max_item_chars, room, count),
                    )
                    guarded = await off_loop(size, functools.partial(_guarded, span, stored))
                    result = await self.summarizer.summarize(
                        tenant,
                        scene,
                        {"transcript": transcript, **values, "existing_summary": summary},
                        model=model,
                        credentials=credentials,
                        max_chars=policy.max_summary_chars,
                        replaced=[
                            *([Earlier(summary)] if summary else []),
                            *guarded,
                        ],
                        max_tokens=limits.max_tokens,
                        call=call,
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
        return Compacted(compaction_item(token), usage, version, reused, summary)

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


def _guarded(span: list[Message], stored: list[str]) -> list[Any]:
    """The messages as the guard reads them: Recap's own summaries among them known as
    such (`recognised`), each other message's texts cut to head and tail (`guard_view`)."""
    return [guard_view(m) for m in recognised(span, stored)]
