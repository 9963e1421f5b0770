"""The HTTP side: every route, from the socket to the pipeline and back.

    serving      uvicorn's h11 protocol, guarded against idle sockets
    front        the top of every request: its id, access line, metrics, last error boundary
    boundary     Recap's own errors rendered (Starlette's exception handlers)
    record       the request's log fields, written by the routes and read by the front
    metrics      Prometheus metrics fed from each request's fields
    relay        the ASGI level: the body in, the (often streamed) response out
    body         a request's body: decoded from its Content-Encoding, then parsed
    compacting   the compacting route: parse, classify, run the pipeline, forward, relay
    overflow     the upstream said the prompt is too long: compact harder, retry once
    codex        Codex remote compaction: `/v1/responses/compact` and the gate before it
    passthrough  every other `/v1/...` route, forwarded verbatim
    operator     the operator routes under `/v1/recap/`

May import: everything below it (the state, stages, archive, upstream and the pure
layers); never `proxy.web`, `proxy.ops` or `proxy.app` (tests/test_layers.py).
"""
