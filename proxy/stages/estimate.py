"""The built-in stage that needs no store or model: token estimation (always last).

Compaction stages live in proxy/stages/ (one module each); all are assembled into one
list by `app.build_stages`.
"""

from __future__ import annotations

from proxy.pipeline import Exchange
from proxy.planning.outcome import Layer, in_words


class EstimateTokens:
    """Estimate the outgoing input tokens (logged, and used by later figures)."""

    name = "estimate_tokens"

    async def __call__(self, exchange: Exchange) -> None:
        # The record reports what the layers did (the log line's compaction fields).
        exchange.record.outcomes = exchange.outcomes
        session = exchange.outcome(Layer.SESSION)
        if exchange.control == "force" and (session is None or session.action != "compacted"):
            # Forced, yet nothing folded: say why, in words.
            reason = (session.failure or session.skip_reason) if session else "disabled"
            exchange.response_headers["x-recap-compaction-skipped"] = in_words(reason)
        if exchange.compaction_failed:
            exchange.response_headers["x-recap-compaction"] = "failed"
        else:
            exchange.response_headers.setdefault(
                "x-recap-compaction", ",".join(exchange.layers) or "none"
            )
        if exchange.changed:
            # The headers need both counts now; otherwise the count is made for the
            # log after the response (`Exchange.count_for_log`), off the latency path.
            tokens = exchange.measure.total(exchange.messages)
            exchange.record.input_tokens = tokens
            before = exchange.measure.total(exchange.original)
            exchange.record.tokens_before = before
            exchange.response_headers["x-recap-tokens-before"] = str(before)
            exchange.response_headers["x-recap-tokens-after"] = str(tokens)
