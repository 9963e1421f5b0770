"""Claude Code's own compaction at the edge: a gate before `POST /v1/messages`.

    a compaction request of Claude Code's (planning/claude_code.py)
        -> Recap's own answer: its summary of the history before the prompt, framed as
           on every route, inside the `<summary>` tags Claude Code keeps (JSON, or SSE
           with progress comments while the summarizer runs). A stored summary that
           covers the history is reused as it is (no model call); one that covers a
           prefix is merged with the rest, by the summarizer, into a new version.
    anything else, a tenant whose `remote_compaction` is `passthrough`, or a summary
    Recap cannot make
        -> the route (edge/compacting.py with the Messages adapter), on the same call:
           the upstream's model writes the summary (a stream already opened by progress
           comments goes on with the upstream's events).

The summary versions are the conversation's session summaries (`stages/remote.py`, as
for Codex): listed, exported and rolled back by the operator routes. See docs/claude-code.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Coroutine
from typing import Any

from proxy.config import Tenant
from proxy.dialects.base import Parsed, Unparsed
from proxy.dialects.chat import parse_json, write_json
from proxy.edge.body import READ_BODY, read_request
from proxy.edge.compacting import CompactingRoute
from proxy.edge.relay import until_disconnect
from proxy.edge.route import Call, Route
from proxy.errors import CompactionFailed, Conflict, RecapError
from proxy.history.identity import conversation_ref, credentials_of, resolve_tenant
from proxy.planning.claude_code import (
    ACTION,
    SummaryRequest,
    answer_text,
    may_be_request,
    message_object,
    stream_events,
    summary_request,
)
from proxy.planning.transcript import detect_language
from proxy.record import RemoteNote
from proxy.stages.offload import off_loop
from proxy.stages.remote import Compacted

log = logging.getLogger("recap.remote")

# The log's `remote_compaction` when Recap could not make the summary and the upstream did.
LEFT_TO_UPSTREAM = ACTION + "_upstream"


class ClaudeCodeGate(Route):
    """Before the Messages route: Claude Code's compaction requests answered by Recap."""

    def __init__(self, route: CompactingRoute) -> None:
        self.route = route
        self.errors = route.errors

    async def handle(self, call: Call) -> None:
        state, scope = call.state, call.scope
        dialect = self.route.dialect
        try:
            tenant = resolve_tenant(state.config, call.headers, dialect.credential_headers)
        except RecapError:
            await self.route.handle(call)  # the route answers it, as always
            return
        if tenant.remote_compaction == "passthrough":
            await self.route.handle(call)
            return
        read = await read_request(scope, call.receive, state.config.max_body_bytes)
        scope[READ_BODY] = read  # the route reads it from here, not again
        found = None
        decoded = read.decoded
        if decoded is not None and may_be_request(decoded):
            # Parsed off the event loop when large, as every compacting route parses.
            loaded = await off_loop(len(decoded), lambda: parse_json(decoded))
            if not isinstance(loaded, Unparsed):
                asked = summary_request(loaded[0])
                found = (loaded[0], loaded[1], asked) if asked is not None else None
        if found is None:
            await self.route.handle(call)
            return
        await self._answer(call, tenant, *found, size=len(read.raw))

    async def _answer(
        self,
        call: Call,
        tenant: Tenant,
        body: dict[str, Any],
        kept: bool,
        asked: SummaryRequest,
        *,
        size: int,
    ) -> None:
        state, record, responder = call.state, call.record, call.responder
        dialect = self.route.dialect
        history = write_json({**body, "messages": asked.history}, kept)
        parsed = await off_loop(size, lambda: dialect.parse(history))
        if not isinstance(parsed, Parsed):
            await self.route.handle(call)
            return
        record.route, record.tenant = dialect.name, tenant.name
        record.remote = RemoteNote(ACTION)
        view = parsed
        conv = await off_loop(
            size,
            lambda: conversation_ref(
                state.config,
                tenant,
                call.headers,
                view.body,
                candidates=dialect.key_fields(view.body),
                messages=view.messages,
            ),
        )
        model = body.get("model") if isinstance(body.get("model"), str) else None
        record.conversation, record.model = conv.key, model
        record.messages = len(parsed.messages)
        streamed = body.get("stream") is True
        if streamed:
            # Opened now: a long summarizer call keeps it alive with progress comments.
            await responder.start_sse([])
            await responder.comment("recap compacting")
        remote = state.remote
        assert remote is not None  # built in the lifespan with the pipeline
        work = remote.compact(
            tenant,
            conv,
            parsed.messages,
            model=model,
            credentials=credentials_of(call.headers, dialect.credential_headers),
            request_id=record.request_id,
            size=size,
            call=dialect.summary_call,
        )
        try:
            done = await self._kept_alive(call, work, streamed)
        except (CompactionFailed, Conflict) as exc:
            log.warning(
                "Claude Code's compaction left to the upstream: %s",
                exc.message,
                extra={"request_id": record.request_id},
            )
            record.remote = RemoteNote(LEFT_TO_UPSTREAM)
            await self.route.handle(call)
            return
        record.remote.version, record.remote.reused = done.version, done.reused
        text = answer_text(done.summary, detect_language(parsed.messages))
        message = message_object(
            "msg_recap_" + uuid.uuid4().hex, model, text, done.usage.input_tokens,
            done.usage.output_tokens,
        )  # fmt: skip
        if not streamed:
            await responder.json(200, message)
            return
        for name, data in stream_events(message):
            await responder.chunk(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        await responder.end()

    async def _kept_alive(
        self, call: Call, work: Coroutine[Any, Any, Compacted], streamed: bool
    ) -> Compacted:
        """`work`, with a progress comment every `listen.sse_keepalive_s` on a stream (a
        silent stream looks dead to Claude Code, which retries it after a while)."""
        every = call.state.config.listen.sse_keepalive_s
        if not streamed:
            return await until_disconnect(call.receive, work)

        async def beating() -> Compacted:
            task = asyncio.ensure_future(work)
            try:
                while True:
                    done, _ = await asyncio.wait({task}, timeout=every)
                    if done:
                        return task.result()
                    await call.responder.comment("recap compacting")
            finally:
                task.cancel()

        return await until_disconnect(call.receive, beating())
