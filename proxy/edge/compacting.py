"""The compacting route: every API whose history Recap compacts, one instance per dialect.

`POST /v1/chat/completions`, `POST /v1/responses`, ...: the API's adapter
(proxy/dialects/) turns the body into the neutral history and back; the walk is the
same for every API, one step a module:

    parse    intake.take_in     the body read and parsed, the Exchange made
    plan     forward.plan       the pipeline's stages; the body to forward
    forward  forward.forward    sent upstream; its archive record begun once on the wire
             forward.recover    an overflow before any answer: harder, once more
    relay    answer.relay       the answer streamed back raw, a copy archived
    finish   _finish            the record completed, the answer archived, the window
                                calibrated from its usage, the next turn's compaction
                                started in the background (stages/ahead.py)

A body the adapter cannot or must not work on (not JSON, no history, a history the
upstream holds) is forwarded byte for byte: the proxy never rejects what the upstream
might accept, and the log says why it was left alone. When a stage rewrites the history,
only the history changes in the forwarded body; every other field goes through as sent.
Recap's own errors are answered in the dialect's shape (`route.Route`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable

import httpx

from proxy.config import Tenant
from proxy.dialects.base import Dialect, Recorder, cache_usage
from proxy.dialects.chat import ChatDialect
from proxy.edge.answer import relay, sse_notifier
from proxy.edge.body import Incoming
from proxy.edge.forward import forward, plan, recover
from proxy.edge.intake import take_in
from proxy.edge.relay import until_disconnect
from proxy.edge.route import Call, Route
from proxy.errors import RecapError
from proxy.history.identity import resolve_tenant
from proxy.pipeline import Exchange
from proxy.stages.calibration import calibrate
from proxy.upstream.client import mapped_errors


class CompactingRoute(Route):
    """The route of one API (`dialect`, Chat Completions by default)."""

    def __init__(self, dialect: Dialect | None = None) -> None:
        self.dialect: Dialect = dialect if dialect is not None else ChatDialect()
        self.errors = self.dialect.errors

    async def handle(self, call: Call) -> None:
        call.record.route = self.dialect.name
        tenant = resolve_tenant(call.state.config, call.headers, self.dialect.credential_headers)
        call.record.tenant = tenant.name
        incoming, exchange = await take_in(call, tenant, self.dialect)
        await until_disconnect(call.receive, self._serve(call, tenant, incoming, exchange))

    async def _serve(
        self, call: Call, tenant: Tenant, incoming: Incoming, exchange: Exchange | None
    ) -> None:
        record, responder = call.record, call.responder
        if exchange is not None and exchange.stream:
            exchange.notify = sse_notifier(responder, exchange)
            exchange.keepalive_s = call.state.config.listen.sse_keepalive_s
        if exchange is not None and call.state.ahead is not None:
            # A background compaction this history makes useless is stopped.
            call.state.ahead.moved_on(exchange)
        payload, out_headers = await plan(call, tenant, incoming, exchange, self.dialect)
        # Arrival to forwarding (of the first try: a retry's time is the upstream's too).
        record.overhead_ms = round((time.perf_counter() - call.start) * 1000, 1)
        # The request's archive record is made once the body is on the wire, so making it
        # overlaps the upstream's work: journaled, it is durable at once; otherwise it is
        # committed while the upstream answers and the final bytes wait for it
        # (relay.FinalBytesGate).
        committed: Awaitable[bool] | None = None
        try:
            sent, committed = await forward(call, tenant, payload, out_headers, exchange)
            if (
                exchange is not None
                and isinstance(sent, httpx.Response)
                and sent.status_code in (400, 413)
            ):
                # A context-length error before any of the answer reached the client: plan
                # again, harder, and send once more (proxy/edge/overflow.py).
                sent, exchange, committed = await recover(
                    call, tenant, incoming, exchange, sent, committed
                )
            if isinstance(sent, RecapError):
                raise sent
            response = sent
            if exchange is not None and call.state.ahead is not None and sent.status_code == 200:
                # While the model works: the next step's working summary (a tool loop).
                call.state.ahead.after_forward(exchange)
        except RecapError as err:
            record.error = err.code
            if committed is not None and exchange is not None:
                call.state.archiver.finish(exchange, {"status": err.status, "error": err.code})
            await responder.error(err)
            return
        extra = {"x-recap-overhead-ms": str(record.overhead_ms)}
        if exchange is not None:
            extra.update(exchange.response_headers)
        recorder: Recorder | None = None
        if exchange is not None and exchange.archive_now is not None:
            ctype = response.headers.get("content-type", "")
            recorder = exchange.dialect.recorder(
                ctype.startswith("text/event-stream"),
                response.headers.get("content-encoding", ""),
            )
        try:
            record.upstream_status = response.status_code
            with mapped_errors(tenant.upstream):
                # A RecapError from here is reported (in-band once the stream has
                # started) where it is also logged.
                await relay(
                    response,
                    responder,
                    self.dialect,
                    extra,
                    recorder,
                    committed,
                    call.start,
                    record,
                )
        finally:
            await response.aclose()
            if exchange is not None:
                self._finish(call, exchange, response, recorder)

    def _finish(
        self,
        call: Call,
        exchange: Exchange,
        response: httpx.Response,
        recorder: Recorder | None,
    ) -> None:
        """After the last byte: the record's token count, the fingerprints' counts kept
        for the next request, the answer archived and the window calibrated."""
        state = call.state
        exchange.count_for_log()  # when no record was begun
        state.fingerprints.remember_counts(
            exchange.conversation, exchange.original, exchange.measure.counted(exchange.original)
        )
        if recorder is not None:
            answer = {"status": response.status_code} | recorder.result()
            state.archiver.finish(exchange, answer)
            # What the usage of a successful answer says of its input, read once: it
            # calibrates the window and goes on the record (log line, tail, metrics).
            cache = cache_usage(answer.get("usage")) if answer.get("status") == 200 else None
            calibrate(state, exchange, cache)
            if cache is not None:
                exchange.record.upstream_input_tokens = cache.input_tokens
                exchange.record.cached_input_tokens = cache.cached_tokens
            if answer.get("status") == 200 and state.session is not None:
                # What the next turn's compaction may ride on (a riding scene only).
                state.session.rider.remember(exchange)
            if answer.get("status") == 200 and state.ahead is not None:
                # The next turn's compaction, while the user reads this answer.
                state.ahead.after_answer(exchange)
