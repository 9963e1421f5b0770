"""The built-in stage that needs no store or model: token estimation (always last).

Compaction stages live in proxy/compaction/stages.py; both are assembled into one
list by `app.build_stages`.
"""

from __future__ import annotations

from proxy.pipeline import Exchange
from proxy.tokens import TokenCounter


class EstimateTokens:
    """Estimate the outgoing input tokens (logged, and used by later figures)."""

    name = "estimate_tokens"

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter

    async def __call__(self, exchange: Exchange) -> None:
        tokens = self.counter.count_messages(exchange.messages, exchange.model)
        exchange.log_fields["input_tokens"] = tokens
        if exchange.compaction_failed:
            exchange.response_headers["x-recap-compaction"] = "failed"
        else:
            exchange.response_headers.setdefault(
                "x-recap-compaction", ",".join(exchange.layers) or "none"
            )
        if exchange.changed:
            before = self.counter.count_messages(exchange.original, exchange.model)
            exchange.log_fields["tokens_before"] = before
            exchange.response_headers["x-recap-tokens-before"] = str(before)
            exchange.response_headers["x-recap-tokens-after"] = str(tokens)
