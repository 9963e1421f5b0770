"""A compacting request taken in: its body read and parsed, its Exchange made.

The first step of the compacting route (compacting.py): the body read once and undone
from its Content-Encoding (body.py), parsed by the route's adapter (proxy/dialects/),
the conversation key derived, the budget set, and the Exchange the pipeline runs on
built from it. Parsing and key derivation run off the event loop for a large body
(`off_loop`). A body the adapter cannot or must not work on gives no Exchange: it is
forwarded byte for byte, and the record says why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from proxy.config import Tenant
from proxy.dialects.base import Dialect, Parsed, PassReason, Unparsed
from proxy.edge.body import CLIENT_HISTORY, Incoming, read_request
from proxy.edge.route import Call
from proxy.history.identity import conversation_ref
from proxy.history.measure import Measure
from proxy.history.messages import classify, json_bytes
from proxy.pipeline import Control, Exchange
from proxy.planning.cohort import Cohort, cohort_of
from proxy.stages.offload import off_loop

log = logging.getLogger("recap.chat")


# A bound of JSON's tokens that tokenizes nothing: tool schemas run at 3 to 4 bytes a token.
TOOL_BYTES_PER_TOKEN = 4


def tool_tokens(body: Mapping[str, Any]) -> int:
    """What the request's tool definitions (`tools`, in every API Recap serves) add to its
    prompt: the upstream counts them, the history's count does not (an agent such as
    Claude Code sends thousands of tokens of them)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return 0
    try:
        return len(json_bytes(tools)) // TOOL_BYTES_PER_TOKEN
    except (TypeError, ValueError, RecursionError):
        return 0


def control_of(headers: Mapping[str, str]) -> Control:
    value = headers.get("x-recap-compaction", "auto").strip().lower()
    return value if value in ("off", "auto", "force") else "auto"  # type: ignore[return-value]


async def take_in(call: Call, tenant: Tenant, dialect: Dialect) -> tuple[Incoming, Exchange | None]:
    """The request's body, and the Exchange to run the pipeline on (None: forwarded as
    it came)."""
    state, record, config = call.state, call.record, call.state.config
    read = await read_request(call.scope, call.receive, config.max_body_bytes)
    raw, decoded, why = read.raw, read.decoded, read.why
    parsed: Parsed | Unparsed = Unparsed(PassReason.UNDECODABLE, why)
    if decoded is not None:
        readable = decoded
        parsed = await off_loop(len(readable), lambda: dialect.parse(readable))
    incoming = Incoming(
        raw,
        raw if decoded is None else decoded,
        isinstance(parsed, Parsed) and parsed.kept_numbers,
        parsed if isinstance(parsed, Parsed) else None,
    )
    if isinstance(parsed, Unparsed):
        record.passthrough = parsed.reason.value
        record.passthrough_reason = parsed.detail
        log.info(
            "%s body forwarded unchanged: %s",
            dialect.name,
            parsed.detail,
            extra={"request_id": record.request_id},
        )
        return incoming, None
    view = parsed
    body = view.body
    conv = await off_loop(
        len(raw),
        lambda: conversation_ref(
            config,
            tenant,
            call.headers,
            view.body,
            candidates=dialect.key_fields(view.body),
            messages=view.messages,
        ),
    )
    model = body.get("model") if isinstance(body.get("model"), str) else None
    control = control_of(call.headers)
    held_out = False
    if tenant.holdout > 0:
        cohort = cohort_of(tenant.name, conv.key, tenant.holdout)
        record.cohort = cohort.value
        held_out = cohort is Cohort.HOLDOUT
    fixed = tool_tokens(body)
    configured = config.context_window(model)
    measure = Measure(state.counter, model)
    measure.bound_by(view.messages, len(incoming.decoded))
    exchange = Exchange(
        request_id=record.request_id,
        tenant=tenant,
        conversation=conv,
        headers=call.headers,
        body=body,
        messages=view.messages,
        dialect=dialect,
        classification=classify(view.messages),
        # In Recap's tokens, as calibrated from this tenant's usage for the model, less
        # what the tool definitions take of it.
        context_window=max(1, state.calibration.window(tenant.name, model, configured) - fixed),
        fixed_tokens=fixed,
        configured_window=configured,
        measure=measure,
        # A held-out conversation goes as it came: no layer runs (the last resort included);
        # only an upstream's refusal for overflow is recovered (edge/forward.py).
        control="off" if held_out else control,
        held_out=held_out and control != "off",
        body_bytes=len(incoming.decoded),
        record=record,
        client_history=call.scope.get(CLIENT_HISTORY),
    )
    record.conversation = conv.key
    if record.cohort is not None:
        exchange.response_headers["x-recap-cohort"] = record.cohort
    record.model = model
    record.classification = exchange.classification.value
    record.messages = len(view.messages)
    return incoming, exchange
