"""Talking to the upstream API: the outbound side of every request and summarizer call.

    client       pooled clients per upstream, the forwarded headers, and the one
                 boundary where httpx errors become Recap's errors (`mapped_errors`)
    error_answer an upstream's error answer, read within a bound and replayed
    transport    Recap's own httpx transport (the default): the keep-alive pool per origin,
                 httpx's limits, timeouts and exception types
    connection   one HTTP/1.1 connection under it: an asyncio Protocol, answers parsed by
                 httptools, flow control both ways

May import: `proxy.config`, `proxy.errors`, and the pure layers (tests/test_layers.py).
"""
