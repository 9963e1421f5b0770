"""The built-in stage that needs no store or model: token estimation (always last).

Compaction stages live in proxy/compaction/stages.py; both are assembled into one
list by `app.build_stages`.
"""

from __future__ import annotations

from proxy.pipeline import Exchange


class EstimateTokens:
    """Estimate the outgoing input tokens (logged, and used by later figures)."""

    name = "estimate_tokens"

    async def __call__(self, exchange: Exchange) -> None:
        tokens = exchange.measure.total(exchange.messages)
        exchange.log_fields["input_tokens"] = tokens
        if exchange.compaction_failed:
            exchange.response_headers["x-recap-compaction"] = "failed"
        else:
            exchange.response_headers.setdefault(
                "x-recap-compaction", ",".join(exchange.layers) or "none"
            )
        if exchange.changed:
            before = exchange.measure.total(exchange.original)
            exchange.log_fields["tokens_before"] = before
            exchange.response_headers["x-recap-tokens-before"] = str(before)
            exchange.response_headers["x-recap-tokens-after"] = str(tokens)
