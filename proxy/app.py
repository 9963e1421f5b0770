"""create_app(config) -> the ASGI app: routes, the stage list, and lifespan state.

Everything long-lived (the httpx clients, the token counter, the store, the
pipeline) is built here and lives in `AppState`; nothing is module-level, so
tests build as many independent apps as they like.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.archive import ArchiveOriginals, Archiver, RecordRequest
from proxy.compaction.loop_stage import LoopStage
from proxy.compaction.session_stage import SessionStage
from proxy.compaction.summarize import Summarizer
from proxy.compaction.trim_stage import FitToWindow, TrimStage
from proxy.config import Config
from proxy.errors import error_body
from proxy.pipeline import Pipeline, Stage
from proxy.scenes import SceneSet
from proxy.stages import EstimateTokens
from proxy.state import AppState
from proxy.store import StoreError, open_store
from proxy.tokens import TokenCounter
from proxy.upstream import UpstreamPool

log = logging.getLogger("recap.app")


def load_scenes(config: Config) -> dict[str, SceneSet]:
    """Every tenant's scenes, loaded and validated: a bad scene fails the start, not a request."""
    scenes = {
        name: SceneSet(
            config.resolve_path(config.scenes_dir),
            {k: str(config.resolve_path(v)) for k, v in t.scenes.items()},
        )
        for name, t in config.tenants.items()
    }
    for name, t in config.tenants.items():
        scenes[name].get(t.compaction.session.scene)
        scenes[name].get(t.compaction.loop.scene)
    return scenes


def build_stages(state: AppState) -> list[Stage]:
    """The request pipeline, in order. Each capability is one stage here.

    The session stage runs first, on the messages exactly as the client sent them,
    because stored summaries are matched by the chain hash of those messages.
    """
    config = state.config
    scenes = load_scenes(config)
    summarizer = Summarizer(state.upstreams, config.tenants)
    return [
        ArchiveOriginals(state.archiver),
        SessionStage(state.store, summarizer, scenes, state.counter, config.tenants),
        LoopStage(state.store, summarizer, scenes, state.counter),
        TrimStage(state.counter),
        FitToWindow(state.counter),
        EstimateTokens(state.counter),
        RecordRequest(state.archiver),
    ]


def create_app(config: Config) -> Starlette:
    from proxy.chat import ChatCompletions
    from proxy.logs import AccessLog
    from proxy.passthrough import Passthrough

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, AppState]]:
        upstreams = UpstreamPool(
            [t.upstream for t in config.tenants.values()]
            + [t.summarizer.upstream for t in config.tenants.values() if t.summarizer.upstream]
        )
        store = open_store(config.store, config.base_dir)
        try:
            await store.open()
        except StoreError as exc:
            # The proxy still forwards without a store; /readyz reports it.
            log.error("store unavailable at start-up: %s", exc)
        counter = TokenCounter()
        counter.count_text("warm up", None)  # load the default encoding now, not on a request
        state = AppState(
            config=config,
            upstreams=upstreams,
            counter=counter,
            store=store,
            archiver=Archiver(store),
            pipeline=Pipeline([]),
        )
        state.pipeline = Pipeline(build_stages(state))
        try:
            # Lifespan state: Starlette/uvicorn copy it into every request's scope["state"].
            yield {"recap": state}
        finally:
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

    async def not_found(request: Request) -> Response:
        return JSONResponse(
            error_body(f"Unknown path {request.url.path}", "invalid_request_error", "not_found"),
            status_code=404,
        )

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/v1/chat/completions", ChatCompletions(), methods=["POST"]),
        Route(
            "/v1/{path:path}",
            Passthrough(),
            methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        ),
        Route("/{path:path}", not_found),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(AccessLog)
    return app
