"""Slow clients and an endless upstream, for the connection deadlines' tests and
`benchmarks/slowloris.py`.

`EndlessStreams` is an upstream (raw ASGI) whose streamed chat answers never end: 16 KB
SSE events until the proxy lets go of the connection, which it counts (`open`, `ended`,
waitable); a request that does not stream gets a short JSON answer. The clients are raw
sockets, as an attacker's would be: one that sends a request's headers and then trickles
its body, one that asks for a stream and never reads it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.servers import read_body

EVENT = b"data: " + json.dumps({"choices": [{"delta": {"content": "x" * 16_000}}]}).encode()
EVENT += b"\n\n"
ANSWER = {
    "id": "chatcmpl-endless",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class EndlessStreams:
    def __init__(self) -> None:
        self.open = 0
        self.ended = 0
        self.changed = threading.Condition()

    def wait(self, done: Callable[[EndlessStreams], bool], timeout: float) -> bool:
        """Until `done(self)` holds (True), or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not done(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
            return True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = json.loads(await read_body(receive) or b"{}")
        if not body.get("stream"):
            raw = json.dumps(ANSWER).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": raw})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        with self.changed:
            self.open += 1
            self.changed.notify_all()
        try:
            while not gone.is_set():
                # Sent as fast as the proxy takes them (uvicorn waits while the socket is
                # full); the pause lets the disconnect watcher run.
                await send({"type": "http.response.body", "body": EVENT, "more_body": True})
                await asyncio.sleep(0.001)
        finally:
            watcher.cancel()
            with self.changed:
                self.open -= 1
                self.ended += 1
                self.changed.notify_all()


def connect(url: str, *, rcvbuf: int | None = None, timeout: float = 60) -> socket.socket:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting: the window the server sees
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect((host, int(port)))
    return sock


def chat_head(length: int, headers: dict[str, str] | None = None) -> bytes:
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: recap",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def stream_request(headers: dict[str, str] | None = None) -> bytes:
    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go on"}]}
    ).encode()
    return chat_head(len(body), headers) + body


class Trickler:
    """A connection that sends a request's complete headers (`Content-Length: 100000`),
    then one body byte every `every_s`, until the server closes it or `stop` is set."""

    def __init__(self, url: str, every_s: float, stop: threading.Event) -> None:
        self.sock = connect(url)
        self.sock.sendall(chat_head(100_000) + b"{")
        self.every_s = every_s
        self.stop = stop
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.sock.send(b" ")
            except OSError:
                return


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (EOF or reset)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        sock.close()
    return data
