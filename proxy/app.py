"""create_app(config) -> the ASGI app: routes, the stage list, and lifespan state.

Everything long-lived (the httpx clients, the token counter, the store, the
pipeline) is built here and lives in `AppState`; nothing is module-level, so
tests build as many independent apps as they like.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.archive.archiver import Archiver
from proxy.archive.journal import Journal, journal_dir
from proxy.config import Config
from proxy.edge.boundary import EXCEPTION_HANDLERS, Rendered
from proxy.edge.front import Edge
from proxy.edge.metrics import CONTENT_TYPE_LATEST, Metrics
from proxy.edge.paths import canonicalise
from proxy.edge.serving import AcceptErrors
from proxy.errors import NotFound
from proxy.history.fingerprints import FingerprintCache
from proxy.history.tokens import TokenCounter
from proxy.pipeline import Pipeline, Stage
from proxy.stages.ahead import Ahead
from proxy.stages.archive import ArchiveOriginals
from proxy.stages.estimate import EstimateTokens
from proxy.stages.loop import LoopStage
from proxy.stages.offload import MeasureOffLoop
from proxy.stages.remote import RemoteCompactor
from proxy.stages.scenes import SceneSet
from proxy.stages.session import SessionStage
from proxy.stages.summarize import Summarizer
from proxy.stages.trim import FitToWindow, TrimStage
from proxy.state import AppState
from proxy.store import Store, StoreError, open_store
from proxy.upstream.client import UpstreamPool

log = logging.getLogger("recap.app")

ALL = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def load_scenes(config: Config) -> dict[str, SceneSet]:
    """Every tenant's scenes, loaded and validated: a bad scene fails the start, not a request."""
    scenes = {
        name: SceneSet(
            config.resolve_path(config.scenes_dir) if config.scenes_dir else None,
            {k: str(config.resolve_path(v)) for k, v in t.scenes.items()},
        )
        for name, t in config.tenants.items()
    }
    for name, t in config.tenants.items():
        scenes[name].get(t.compaction.session.scene)
        scenes[name].get(t.compaction.loop.scene)
    return scenes


def upstream_pool(config: Config) -> UpstreamPool:
    """A pool per tenant and upstream: every tenant's, and every separate summarizer's."""
    return UpstreamPool(
        [(t.name, t.upstream) for t in config.tenants.values()]
        + [
            (t.name, t.summarizer.upstream)
            for t in config.tenants.values()
            if t.summarizer.upstream
        ]
    )


def build_stages(state: AppState) -> list[Stage]:
    """The request pipeline, in order. Each capability is one stage here.

    The session stage runs first, on the messages exactly as the client sent them,
    because stored summaries are matched by the chain hash of those messages.
    """
    config = state.config
    scenes = load_scenes(config)
    summarizer = Summarizer(state.upstreams, config.tenants)
    session = SessionStage(
        state.store, summarizer, scenes, state.counter, config.tenants, clock=state.clock
    )
    state.session = session
    loop = LoopStage(state.store, summarizer, scenes)
    # The next turn's summary and the next step's working summary, made in the background
    # with the stages' own parts.
    state.ahead = Ahead(session, loop, config.tenants)
    return [
        MeasureOffLoop(),
        ArchiveOriginals(state.archiver, state.fingerprints),
        session,
        loop,
        TrimStage(state.store),
        FitToWindow(state.store),
        EstimateTokens(),
    ]


def open_journal(config: Config, directory: Path | None) -> Journal | None:
    """The archive's journal (proxy/archive/journal.py), or None: switched off, an in-memory
    store, or a directory it cannot use (then each record is committed before its answer's
    final bytes, as without a journal)."""
    if directory is None or not config.archive.journal:
        return None
    journal = Journal(directory)
    try:
        journal.open()
    except OSError as exc:
        log.warning("archive journal unavailable at %s, committing each record: %s", directory, exc)
        return None
    return journal


def create_app(
    config: Config,
    *,
    clock: Callable[[], float] = time.monotonic,
    counter: TokenCounter | None = None,
    store: Store | None = None,
) -> Starlette:
    """The app for `config`; `clock` (monotonic seconds) times the circuit breakers'
    cool-downs, so a test can advance a fake one instead of sleeping. `counter`: the token
    counter to use (default: a new one, which builds its encoding at start-up, about a
    second of CPU); a test suite that builds hundreds of apps passes one to them all.
    `store`: the store to open instead of the one `config.store` names (a test's or a
    benchmark's wrapper around a real one)."""
    from proxy.archive.retention import Retention
    from proxy.dialects.messages import MessagesDialect
    from proxy.dialects.responses import ResponsesDialect
    from proxy.edge.claude_code import ClaudeCodeGate
    from proxy.edge.codex import CodexGate, ResponsesCompact
    from proxy.edge.compacting import CompactingRoute
    from proxy.edge.operator import operator_routes
    from proxy.edge.passthrough import Passthrough
    from proxy.web import web_routes

    # Per app, never global: tests build many apps, each with its own registry.
    metrics = Metrics()
    given_store = store

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, AppState]]:
        AcceptErrors().install(asyncio.get_running_loop())
        upstreams = upstream_pool(config)
        store = given_store
        if store is None:
            store = open_store(config.store, config.base_dir, pool=config.store_pool)
        try:
            await store.open()
        except StoreError as exc:
            # The proxy still forwards without a store; /readyz reports it.
            log.error("store unavailable at start-up: %s", exc)
        tokens = counter if counter is not None else TokenCounter()
        tokens.count_text("warm up", None)  # load the default encoding now, not on a request
        journals = journal_dir(config.store, config.archive.journal_dir, config.base_dir)
        archiver = Archiver(store, journal=open_journal(config, journals))
        if journals is not None:
            # What a process that died left in its journal is stored before anything is served.
            with contextlib.suppress(StoreError):
                await archiver.replay(journals)
        state = AppState(
            config=config,
            upstreams=upstreams,
            counter=tokens,
            store=store,
            archiver=archiver,
            fingerprints=FingerprintCache(),
            pipeline=Pipeline([]),
            clock=clock,
        )
        # Every audit row (any stage, remote and manual compaction) is queued on it.
        store.audits = state.audits
        state.pipeline = Pipeline(build_stages(state))
        state.remote = RemoteCompactor(
            config, store, Summarizer(upstreams, config.tenants), load_scenes(config), tokens
        )
        retention: asyncio.Task[None] | None = None
        if config.archive.retention_days > 0:
            retention = asyncio.get_running_loop().create_task(
                Retention(store, state.archiver, config.archive).run()
            )
        try:
            # Lifespan state: Starlette/uvicorn copy it into every request's scope["state"].
            yield {"recap": state}
        finally:
            if retention is not None:
                retention.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retention
            if state.ahead is not None:
                await state.ahead.aclose()
            await state.audits.drain()
            await state.archiver.drain()
            await upstreams.aclose()
            await store.close()

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        state: AppState = request.state.recap
        try:
            await state.store.check_writable()
        except StoreError as exc:
            return JSONResponse({"status": "not ready", "store": str(exc)}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_endpoint(request: Request) -> Response:
        # No key: scrapers rarely carry one, and no label names a conversation.
        state: AppState = request.state.recap
        await metrics.refresh_holdout(state, time.time())
        if state.ahead is not None:
            metrics.show_ahead(state.ahead.counts)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request) -> Response:
        raise NotFound(f"Unknown path {request.url.path}")

    chat = CompactingRoute()
    responses = CodexGate(CompactingRoute(ResponsesDialect()))
    messages = ClaudeCodeGate(CompactingRoute(MessagesDialect()))
    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/compact", ResponsesCompact(Passthrough()), methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        # count_tokens, batches: forwarded, with the Messages API's keys and errors.
        Route("/v1/messages/{path:path}", Passthrough(MessagesDialect()), methods=ALL),
        *operator_routes(),
        *web_routes(config),
        Route("/v1/{path:path}", Passthrough(), methods=ALL),
        Route("/{path:path}", not_found),
    ]
    direct = {
        "/v1/chat/completions": Edge(Rendered(chat, chat.errors), metrics, chat.errors),
        "/v1/responses": Edge(Rendered(responses, responses.errors), metrics, responses.errors),
        "/v1/messages": Edge(Rendered(messages, messages.errors), metrics, messages.errors),
    }
    app = RecapApp(direct, routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(Edge, metrics=metrics)
    return app


class RecapApp(Starlette):
    """Starlette, except that a POST to a compacting route (nearly every request an agent
    makes) goes straight to the edge and its handler, as it would through Starlette's
    stack: Starlette's own error middlewares (two more `send` wrappers for every chunk of
    a streamed answer) and its router serve the other routes and methods."""

    def __init__(self, direct: Mapping[str, Edge], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Routed and forwarded as the upstream would read it (proxy/edge/paths.py).
            canonicalise(scope)  # type: ignore[arg-type]  # an ASGI scope
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._direct.get(scope["path"])
            if handler is not None:
                scope["app"] = self
                await handler(scope, receive, send)  # type: ignore[arg-type]  # ASGI callables
                return
        await super().__call__(scope, receive, send)
