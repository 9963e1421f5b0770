"""Real uvicorn servers on loopback for tests: each runs in its own thread and loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette

from proxy.app import create_app
from proxy.config import Config
from proxy.history.tokens import TokenCounter


@functools.cache
def shared_counter() -> TokenCounter:
    """One token counter for every proxy the suite builds: building its encoding is about
    a second of CPU, and hundreds of tests each start a proxy (or several)."""
    return TokenCounter()


def recap_app(config: Config, *, precompact: bool = False, **kwargs: Any) -> Starlette:
    """`create_app(config)`, with the suite's one token counter.

    Background pre-compaction (on by default in the product) is switched off unless
    `precompact`: most tests check what a request's own path compacts, turn by turn, and a
    background summary racing the next request would make that depend on timing. Its own
    tests (tests/stages/test_ahead.py) and the generated invariant run it."""
    if not precompact:
        config = synchronous(config)
    return create_app(config, counter=shared_counter(), **kwargs)


def synchronous(config: Config) -> Config:
    """`config` with every tenant's background pre-compaction off."""
    tenants = {
        name: dataclasses.replace(
            t,
            compaction=dataclasses.replace(
                t.compaction,
                session=dataclasses.replace(t.compaction.session, precompact=False),
            ),
        )
        for name, t in config.tenants.items()
    }
    return dataclasses.replace(config, tenants=tenants)


class _Server(uvicorn.Server):
    """uvicorn's server, stopped as soon as it is asked to: its own main loop looks at
    `should_exit` every 0.1 s, which is most of a test server's stop (hundreds per run)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.1)

    def stop(self) -> None:
        self.should_exit = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(stop.set)


@contextmanager
def serve(app: Any, *, lifespan: str = "on", http: Any = "h11") -> Iterator[str]:
    """Serve `app` on 127.0.0.1 on a free port; yields its base URL.

    `http`: uvicorn's protocol, e.g. `proxy.edge.serving.protocol_for(config.listen)` as
    `recap serve` uses it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan=lifespan,
        http=http,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=2,
        server_header=False,
        date_header=False,
    )
    server = _Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(timeout=10)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def read_body(receive: Any) -> bytes:
    """The whole request body, for fakes written as raw ASGI apps."""
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            return raw
