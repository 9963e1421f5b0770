"""A fake Anthropic Messages API upstream (`POST /v1/messages`), beside the chat fake it extends.

Every request is checked as Anthropic checks it (`request_problems`): `model`, `max_tokens`,
`system` as text or text blocks, messages of the user and assistant roles, the first from
the user, known block types in their roles, every `tool_use` answered by a `tool_result`
in the very next message (the results first in it) and every result answering a call of
the message before, the roles alternating (`strict`; Claude Code itself sends two user
messages in a row, which Anthropic merges), every thinking block with the signature this
fake gave it (so a block changed or moved from its text fails), a final assistant turn of
a tool loop starting with its thinking when thinking is on, and at most four
`cache_control` breakpoints. An invalid request is answered 400 in Anthropic's error shape
and kept in `problems`, so a test asserts on both. A valid one is answered from `respond`:
a JSON `message`, or the typed SSE events Anthropic streams (message_start, ping,
content_block_start / _delta / _stop for thinking, text and tool_use, message_delta,
message_stop).

Usage counts the prompt with `count` (about four characters a token) and simulates the
prompt cache: the prefix up to each `cache_control` breakpoint is written to the cache,
and a later request reads the longest prefix of its own that an earlier one wrote
(`cache_read_input_tokens`; Anthropic's order: tools, then system, then messages, block
by block). Recap's summarizer calls (`x-recap-purpose: summarize`) get an extractive
summary of their prompt, as a Messages answer.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.fakes import FakeUpstream, Recorded

USER_BLOCKS = frozenset({"text", "image", "document", "tool_result", "search_result"})
ASSISTANT_BLOCKS = frozenset(
    {
        "text",
        "tool_use",
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
    }
)
THINKING = ("thinking", "redacted_thinking")
_SECRET = b"fake-messages-signature"


def signature(thinking: str) -> str:
    """What this fake signs a thinking block with: only the very text verifies."""
    return "sig-" + hashlib.sha256(_SECRET + thinking.encode()).hexdigest()[:40]


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _blocks(content: Any) -> list[Any]:
    return content if isinstance(content, list) else []


def breakpoints(body: dict[str, Any]) -> int:
    def count(value: Any) -> int:
        if isinstance(value, dict):
            own = 1 if "cache_control" in value else 0
            return own + sum(count(v) for k, v in value.items() if k != "cache_control")
        if isinstance(value, list):
            return sum(count(v) for v in value)
        return 0

    return sum(count(body.get(k)) for k in ("tools", "system", "messages"))


def request_problems(body: Any, *, strict: bool = True) -> list[str]:
    """What would make Anthropic reject this request; [] if nothing."""
    if not isinstance(body, dict):
        return ["body is not an object"]
    problems: list[str] = []
    if not isinstance(body.get("model"), str):
        problems.append("model: Field required")
    if not isinstance(body.get("max_tokens"), int):
        problems.append("max_tokens: Field required")
    system = body.get("system")
    text_blocks = isinstance(system, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in system
    )
    if system is not None and not isinstance(system, str) and not text_blocks:
        problems.append("system: must be text or a list of text blocks")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*problems, "messages: at least one message is required"]
    if breakpoints(body) > 4:
        problems.append(
            f"A maximum of 4 blocks with cache_control may be provided ({breakpoints(body)})"
        )
    thinking_on = isinstance(body.get("thinking"), dict) and body["thinking"].get("type") in (
        "enabled",
        "adaptive",
    )
    for i, m in enumerate(messages):
        problems += _message_problems(i, m, messages, strict)
    last_user = messages[-1] if isinstance(messages[-1], dict) else {}
    in_loop = any(b.get("type") == "tool_result" for b in _blocks(last_user.get("content")))
    if thinking_on and in_loop and len(messages) >= 2:
        final = messages[-2] if isinstance(messages[-2], dict) else {}
        first = _blocks(final.get("content"))[:1]
        if final.get("role") == "assistant" and not (first and first[0].get("type") in THINKING):
            problems.append(
                f"messages.{len(messages) - 2}.content.0.type: Expected `thinking` or "
                "`redacted_thinking`, but found another block. When `thinking` is enabled, a "
                "final `assistant` message must start with a thinking block"
            )
    return problems


def _message_problems(i: int, m: Any, messages: list[Any], strict: bool) -> list[str]:
    if not isinstance(m, dict):
        return [f"messages.{i}: not an object"]
    role, content = m.get("role"), m.get("content")
    out: list[str] = []
    if role not in ("user", "assistant"):
        return [f"messages.{i}.role: Input should be 'user' or 'assistant'"]
    if i == 0 and role != "user":
        out.append('messages: first message must use the "user" role')
    before = messages[i - 1] if i > 0 and isinstance(messages[i - 1], dict) else None
    if strict and before is not None and before.get("role") == role:
        out.append(f'messages.{i}: roles must alternate between "user" and "assistant"')
    if isinstance(content, str):
        calls_before = (
            _calls(before) if before is not None and before.get("role") == "assistant" else []
        )
        if calls_before:
            out.append(f"messages.{i}: tool_use ids were found without tool_result blocks")
        return out
    if not isinstance(content, list) or not content:
        return [*out, f"messages.{i}.content: must be text or a non-empty list of blocks"]
    allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
    for n, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allowed:
            out.append(f"messages.{i}.content.{n}: block type {kind!r} not allowed for {role}")
        elif kind == "thinking" and b.get("signature") != signature(str(b.get("thinking"))):
            out.append(f"messages.{i}.content.{n}: Invalid `signature` in `thinking` block")
        elif kind == "tool_use" and not isinstance(b.get("input"), dict):
            out.append(f"messages.{i}.content.{n}.input: Input should be a valid dictionary")
    if role == "user":
        results = [
            b.get("tool_use_id")
            for b in content
            if isinstance(b, dict) and b.get("type") == "tool_result"
        ]
        leading = 0
        while leading < len(content) and content[leading].get("type") == "tool_result":
            leading += 1
        if leading != len(results):
            out.append(f"messages.{i}: tool_result blocks must come first in the content")
        calls = _calls(before) if before is not None and before.get("role") == "assistant" else []
        for call_id in results:
            if call_id not in calls:
                out.append(
                    f"messages.{i}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{call_id}. Each `tool_result` block must have a corresponding `tool_use` "
                    "block in the previous message."
                )
        missing = [c for c in calls if c not in results]
        if missing:
            out.append(
                f"messages.{i - 1}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}"
            )
    elif i + 1 < len(messages):
        after = messages[i + 1]
        if _calls(m) and not (isinstance(after, dict) and after.get("role") == "user"):
            out.append(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks")
    return out


def _calls(message: dict[str, Any]) -> list[Any]:
    return [b.get("id") for b in _blocks(message.get("content")) if b.get("type") == "tool_use"]


@dataclass
class Answer:
    """What the fake answers to one /v1/messages call."""

    text: str | None = "Hello from the fake Messages upstream."
    # (name, input) of each tool_use block it answers with.
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # A thinking block (signed) first, as a model with extended thinking does.
    thinking: str | None = None
    status: int = 200
    error: dict[str, Any] | None = None
    stop_reason: str | None = None
    # Streamed: an `event: error` after this many events, instead of the rest.
    error_after: int | None = None


AnswerOrAwaitable = Answer | Awaitable[Answer]


def segments(body: dict[str, Any]) -> list[str]:
    """The prompt in Anthropic's cache order, one serialised piece per tool and block; a
    piece ending with a `cache_control` marker is flagged by a trailing "\\x00"."""
    out: list[str] = []

    def piece(value: Any) -> str:
        text = json.dumps(
            {k: v for k, v in value.items() if k != "cache_control"}
            if isinstance(value, dict)
            else value,
            sort_keys=True,
        )
        return text + ("\x00" if isinstance(value, dict) and "cache_control" in value else "")

    for tool in body.get("tools") or []:
        out.append(piece(tool))
    system = body.get("system")
    for block in [{"type": "text", "text": system}] if isinstance(system, str) else system or []:
        out.append(piece(block))
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        out.append(json.dumps(m.get("role")) if isinstance(m, dict) else "?")
        for block in blocks:
            out.append(piece(block))
    return out


class PromptCache:
    """Anthropic's prompt cache, simplified: prefixes written at breakpoints, read by the
    longest prefix a later request shares with one of them."""

    def __init__(self, tokens: Callable[[str], int]) -> None:
        self.tokens = tokens
        self.written: set[str] = set()

    def use(self, body: dict[str, Any]) -> tuple[int, int, int]:
        """(uncached input, cache read, cache written) tokens of this request."""
        pieces = segments(body)
        hashes: list[str] = []
        h = hashlib.sha256()
        for p in pieces:
            h.update(p.rstrip("\x00").encode() + b"\x01")
            hashes.append(h.hexdigest())
        sizes = [self.tokens(p) for p in pieces]
        read_to = max((n + 1 for n, x in enumerate(hashes) if x in self.written), default=0)
        marks = [n + 1 for n, p in enumerate(pieces) if p.endswith("\x00")]
        write_to = max([read_to, *marks])
        for n in marks:
            self.written.add(hashes[n - 1])
        read = sum(sizes[:read_to])
        written = sum(sizes[read_to:write_to])
        return sum(sizes[write_to:]), read, written


def extractive(body: dict[str, Any]) -> str:
    """The summarizer stand-in: the transcript's item lines, tagged."""
    text = "\n".join(
        m["content"] for m in body.get("messages", []) if isinstance(m.get("content"), str)
    )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked = [ln[:200] for ln in lines if ln.startswith(("User:", "Tool result", "Assistant"))]
    return "<summary>\n## User Goal\n" + "\n".join(picked[-20:] or lines[:5]) + "\n</summary>"


class FakeMessages(FakeUpstream):
    def __init__(self, *, strict: bool = True, record: bool = True) -> None:
        super().__init__(
            record=record,
            routes=[
                Route("/v1/messages", self.serve_messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
            ],
        )
        self.strict = strict
        self.respond: Callable[[dict[str, Any]], AnswerOrAwaitable] = lambda body: Answer()
        self.summarize_messages: Callable[[dict[str, Any]], Answer] = lambda body: Answer(
            text=extractive(body)
        )
        self.problems: list[str] = []
        self.count: Callable[[str], int] = lambda text: max(1, len(text) // 4)
        self.cache = PromptCache(lambda text: self.count(text))

    def message_requests(self, purpose: str = "chat") -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.path == "/v1/messages" and r.purpose == purpose]

    async def _count_tokens(self, request: Request) -> Response:
        rec = await self._record(request)
        return JSONResponse({"input_tokens": self.count(json.dumps(rec.json))})

    async def serve_messages(self, request: Request) -> Response:
        rec = await self._record(request)
        body = rec.json
        summarizing = rec.purpose == "summarize"
        problems = request_problems(body, strict=self.strict and not summarizing)
        if summarizing and rec.headers.get("anthropic-version") is None:
            problems.append("anthropic-version: header is required")
        if problems:
            with self.lock:
                self.problems += problems
            return JSONResponse(error_body(problems[0]), status_code=400)
        if summarizing:
            reply = self.summarize_messages(body)
        else:
            answer = self.respond(body)
            reply = await answer if inspect.isawaitable(answer) else answer
        if reply.status >= 400:
            return JSONResponse(
                reply.error or error_body("fake error", "api_error"), status_code=reply.status
            )
        with self.lock:
            uncached, read, written = self.cache.use(body)
        message = self._message(body, reply, uncached, read, written)
        if not body.get("stream"):
            return JSONResponse(message, headers={"request-id": "req_fake"})
        return StreamingResponse(
            self._events(message, reply.error_after),
            media_type="text/event-stream",
            headers={"request-id": "req_fake"},
        )

    def _message(
        self, body: dict[str, Any], reply: Answer, uncached: int, read: int, written: int
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reply.thinking is not None:
            content.append(
                {
                    "type": "thinking",
                    "thinking": reply.thinking,
                    "signature": signature(reply.thinking),
                }
            )
        if reply.text is not None:
            content.append({"type": "text", "text": reply.text})
        for name, arguments in reply.calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + uuid.uuid4().hex[:20],
                    "name": name,
                    "input": arguments,
                }
            )
        stop = reply.stop_reason or ("tool_use" if reply.calls else "end_turn")
        return {
            "id": "msg_" + uuid.uuid4().hex[:20],
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "fake"),
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {
                "input_tokens": uncached,
                "cache_creation_input_tokens": written,
                "cache_read_input_tokens": read,
                "output_tokens": 7,
            },
        }

    async def _events(
        self, message: dict[str, Any], error_after: int | None
    ) -> AsyncIterator[bytes]:
        for n, (kind, data) in enumerate(stream_events(message)):
            if error_after is not None and n == error_after:
                error = error_body("Overloaded (fake stream error)", "overloaded_error")
                yield b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"
                return
            yield f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def stream_events(message: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Anthropic's event sequence for this message."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        empty: dict[str, Any] = {"type": kind}
        if kind == "thinking":
            empty.update(thinking="", signature="")
        elif kind == "text":
            empty["text"] = ""
        else:
            empty.update(id=block["id"], name=block["name"], input={})
        yield (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": empty},
        )
        if kind == "thinking":
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            text = block["text"]
            deltas = [
                {"type": "text_delta", "text": text[i : i + 12]} for i in range(0, len(text), 12)
            ]
        else:
            js = json.dumps(block["input"])
            deltas = [
                {"type": "input_json_delta", "partial_json": js[i : i + 9]}
                for i in range(0, len(js), 9)
            ]
        for delta in deltas:
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": usage,
        },
    )
    yield "message_stop", {"type": "message_stop"}
