"""Real uvicorn servers on loopback for tests: each runs in its own thread and loop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


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
    server = uvicorn.Server(config)
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
        server.should_exit = True
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
