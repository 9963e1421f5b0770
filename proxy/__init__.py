"""Recap: a reverse proxy that compacts the histories of LLM agents.

The package in layers, bottom to top (docs/architecture.md; tests/test_layers.py holds
every module to it). A module imports its own folder and the floors below, never above:

    config, errors, wire/   typed settings; the error tree; byte formats (JSON, SSE, encodings)
    history/                the neutral model of a conversation: messages, turns, fingerprints
    planning/, dialects/    pure planners; one adapter per API, body <-> neutral history
    store/                  the store interface and its SQLite and PostgreSQL drivers
    pipeline                Exchange (one request in flight), Stage, Pipeline
    archive/, upstream/     the lossless archive; the outbound HTTP client
    stages/                 the pipeline's stages: planners, summarizer calls, store writes
    state                   what lives for the life of the app
    edge/                   the HTTP side: routes, relay, serving, metrics
    web/                    the operator web page
    app                     create_app: the wiring
    ops/                    the `recap` command, its log output and tail

`wire`, `history`, `planning` and `dialects` import no IO at all.
"""
