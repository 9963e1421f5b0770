"""A fake OpenAI-compatible upstream: a Starlette app served by a real uvicorn in tests.

It records every request it receives and answers from a script the test sets:
JSON or SSE completions (tool calls streamed in pieces), upstream errors with
headers, slow and stalled streams, a reset in the middle of a stream, gzip.
Requests the proxy makes for summaries carry `x-recap-purpose: summarize` and are
answered by `summarize` (a deterministic extractive summary by default).

The benchmarks (`benchmarks/`) serve the same fake in its own process: with `record=False`
(a long run keeps no bodies), a timing header (the fake's own time, which they subtract),
their own control routes, and `reply_to` overridden where a reply depends on the request's
headers; a reply may be awaited (to relay a call) and may carry raw bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import inspect
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route


@dataclass
class Reply:
    """What the fake answers to one chat call."""

    content: str | None = "Hello from the fake upstream."
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    status: int = 200
    error: dict[str, Any] | None = None  # an error body (with status >= 400)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # before the response starts
    chunk_delay_s: float = 0.0  # between SSE events
    stall_after: int | None = None  # SSE: stop sending (but keep open) after N events
    reset_after: int | None = None  # SSE: drop the connection after N events
    gzip: bool = False
    usage: dict[str, Any] = field(
        default_factory=lambda: {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    )
    raw: bytes | None = None  # answer these bytes as they are, with `status` and `headers`


@dataclass
class Recorded:
    path: str
    method: str
    headers: dict[str, str]
    body: bytes
    purpose: str

    @property
    def json(self) -> Any:
        # A body the client sent compressed reaches the fake as it was sent.
        if self.headers.get("content-encoding") == "gzip":
            return json.loads(gzip.decompress(self.body))
        return json.loads(self.body)


def extractive_summary(request_body: dict[str, Any]) -> str:
    """Deterministic stand-in for a summarizer model: first lines of the prompt, tagged."""
    text = "\n".join(
        m["content"] for m in request_body.get("messages", []) if isinstance(m.get("content"), str)
    )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked = [ln[:200] for ln in lines if ln.startswith(("User:", "Tool result", "Assistant"))][
        -20:
    ]
    return "<summary>\n## User Goal\n" + "\n".join(picked or lines[:5]) + "\n</summary>"


# What `chat` and `summarize` answer: a reply, or (to relay a call) an awaitable of one.
ReplyOrAwaitable = Reply | Awaitable[Reply]


class FakeUpstream:
    def __init__(
        self,
        *,
        record: bool = True,
        timing_header: str | None = None,
        routes: Sequence[BaseRoute] = (),
    ) -> None:
        """`record=False` keeps no requests; `timing_header` names a header that carries the
        fake's own time in ms on every non-streamed chat answer; `routes` are served too."""
        self.requests: list[Recorded] = []
        self.record = record
        self.timing_header = timing_header
        self.lock = threading.Lock()
        self.chat: Callable[[dict[str, Any]], ReplyOrAwaitable] = lambda body: Reply()
        self.summarize: Callable[[dict[str, Any]], ReplyOrAwaitable] = lambda body: Reply(
            content=extractive_summary(body)
        )
        self.streams_open = 0
        self.streams_aborted = 0
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/echo/{rest:path}", self._echo, methods=["GET", "POST", "PUT", "DELETE"]),
                Route("/healthz", self._healthz),
                *routes,
            ]
        )

    def reply_to(self, request: Recorded, body: dict[str, Any]) -> ReplyOrAwaitable:
        """The reply to one chat call: `summarize` for the proxy's summaries, else `chat`."""
        return (self.summarize if request.purpose == "summarize" else self.chat)(body)

    # -- inspection ----------------------------------------------------------------------
    def chat_requests(self, purpose: str = "chat") -> list[Recorded]:
        with self.lock:
            return [
                r
                for r in self.requests
                if r.path == "/v1/chat/completions" and r.purpose == purpose
            ]

    def script(self, replies: list[Reply]) -> None:
        """Answer chat calls with these replies in order (the last one repeats)."""
        queue = list(replies)

        def next_reply(body: dict[str, Any]) -> Reply:
            with self.lock:
                return queue.pop(0) if len(queue) > 1 else queue[0]

        self.chat = next_reply

    # -- routes ----------------------------------------------------------------------------
    async def _record(self, request: Request) -> Recorded:
        body = await request.body()
        rec = Recorded(
            path=request.url.path,
            method=request.method,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            purpose=request.headers.get("x-recap-purpose", "chat"),
        )
        if self.record:
            with self.lock:
                self.requests.append(rec)
        return rec

    async def _healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def _models(self, request: Request) -> Response:
        await self._record(request)
        body = json.dumps(
            {"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]}
        ).encode()
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(
                gzip.compress(body),
                media_type="application/json",
                headers={"content-encoding": "gzip"},
            )
        return Response(body, media_type="application/json")

    async def _echo(self, request: Request) -> Response:
        rec = await self._record(request)
        return JSONResponse(
            {
                "method": rec.method,
                "query": request.url.query,
                "size": len(rec.body),
                "headers": rec.headers,
            },
            headers={"x-echo": "1"},
        )

    async def _chat(self, request: Request) -> Response:
        start = time.perf_counter()
        response = await self._answer(request)
        if self.timing_header and not isinstance(response, StreamingResponse):
            response.headers[self.timing_header] = f"{(time.perf_counter() - start) * 1000:.3f}"
        return response

    async def _answer(self, request: Request) -> Response:
        rec = await self._record(request)
        body = rec.json
        answer = self.reply_to(rec, body)
        reply = await answer if inspect.isawaitable(answer) else answer
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.raw is not None:
            return Response(reply.raw, status_code=reply.status, headers=reply.headers)
        if reply.status >= 400:
            err = reply.error or {
                "error": {"message": "fake error", "type": "server_error", "code": None}
            }
            return JSONResponse(err, status_code=reply.status, headers=reply.headers)
        model = body.get("model", "fake")
        if body.get("stream"):
            return StreamingResponse(
                self._events(body, reply, model),
                media_type="text/event-stream",
                headers=reply.headers,
            )
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        out = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
            "usage": reply.usage,
        }
        raw = json.dumps(out).encode()
        if reply.gzip:
            return Response(
                gzip.compress(raw),
                media_type="application/json",
                headers={"content-encoding": "gzip", **reply.headers},
            )
        return Response(raw, media_type="application/json", headers=reply.headers)

    def _chunks(self, body: dict[str, Any], reply: Reply, model: str) -> list[dict[str, Any]]:
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        out = [chunk({"role": "assistant", "content": ""})]
        for word in (reply.content or "").split(" ") if reply.content else []:
            out.append(chunk({"content": word + " "}))
        for i, call in enumerate(reply.tool_calls or []):
            args = call["function"]["arguments"]
            out.append(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": call["id"],
                                "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""},
                            }
                        ]
                    }
                )
            )
            for j in range(0, len(args), 7):  # arguments arrive in pieces
                out.append(
                    chunk(
                        {"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 7]}}]}
                    )
                )
        out.append(chunk({}, reply.finish_reason))
        if (body.get("stream_options") or {}).get("include_usage"):
            out.append({**base, "choices": [], "usage": reply.usage})
        return out

    async def _events(self, body: dict[str, Any], reply: Reply, model: str) -> AsyncIterator[bytes]:
        with self.lock:
            self.streams_open += 1
        completed = False
        try:
            for n, event in enumerate(self._chunks(body, reply, model)):
                if reply.reset_after is not None and n == reply.reset_after:
                    raise ConnectionResetError("fake mid-stream reset")
                if reply.stall_after is not None and n == reply.stall_after:
                    await asyncio.sleep(3600)
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
                if reply.chunk_delay_s:
                    await asyncio.sleep(reply.chunk_delay_s)
            yield b"data: [DONE]\n\n"
            completed = True
        finally:
            # Cancelled, closed (GeneratorExit) or reset: the stream did not run to its end.
            with self.lock:
                self.streams_open -= 1
                if not completed:
                    self.streams_aborted += 1


def overflowing(
    limit: int, count: Callable[[dict[str, Any]], int], answer: Reply | None = None
) -> Callable[[dict[str, Any]], Reply]:
    """A chat script for an upstream with its own tokenizer (`count`) and window (`limit`):
    over it, a 400 context_length_exceeded in OpenAI's shape (vLLM and DeepSeek send the
    same message); under it, `answer` with usage.prompt_tokens from its own count."""

    def chat(body: dict[str, Any]) -> Reply:
        n = count(body)
        completion = body.get("max_tokens") or 0
        if n + completion > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n + completion} tokens ({n} in the messages, {completion} in "
                "the completion). Please reduce the length of the messages or completion."
            )
            error = {
                "message": message,
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
            return Reply(status=400, error={"error": error})
        base = answer or Reply(content="Answered within the window.")
        usage = {"prompt_tokens": n, "completion_tokens": 5, "total_tokens": n + 5}
        return Reply(content=base.content, tool_calls=base.tool_calls, usage=usage)

    return chat
