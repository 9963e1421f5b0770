"""A fake Responses API upstream (`POST /v1/responses`), beside the chat fake it extends.

Every request's `input` is checked as OpenAI checks it (`input_problems`): known item
types and roles, every function call answered by its output and every output by an
earlier call, a reasoning item followed by another item, no `compaction` item (Recap
answers those itself). An invalid input is answered 400 with OpenAI's error shape and
kept in `problems`, so a test asserts on both. A valid one is answered from `respond`:
JSON `response` objects, or the typed SSE events OpenAI streams (created, in_progress,
output_item.added, content_part.added, output_text.delta, ..., response.completed),
with `usage.input_tokens` estimated from the input. The proxy's summaries still go
to `/v1/chat/completions` (FakeUpstream), except its cache-riding calls
(`x-recap-purpose: summarize` on `/v1/responses`), answered by `summarize_responses`
(the instruction's first line, tagged, by default).
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.fakes import FakeUpstream, Recorded

ROLES = frozenset({"user", "assistant", "system", "developer"})
# Items a client may send back (what OpenAI's input schema lists), Recap's own excluded.
ITEM_TYPES = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "reasoning",
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "item_reference",
    }
)
PART_TYPES = frozenset(
    {"input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"}
)
_CALLS = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output"}


def input_problems(body: dict[str, Any]) -> list[str]:
    """What would make OpenAI reject this request's `input`; [] if nothing."""
    value = body.get("input")
    if isinstance(value, str):
        return []
    if not isinstance(value, list) or not value:
        return ["input is neither text nor a non-empty list"]
    problems: list[str] = []
    waiting: dict[str, str] = {}  # call_id -> the output type it needs
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            problems.append(f"item {i}: not an object")
            continue
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            problems.append(f"item {i}: unknown type {kind!r}")
            continue
        if kind == "message":
            problems += _message_problems(i, item)
        elif kind in _CALLS:
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                problems.append(f"item {i}: {kind} without call_id")
            else:
                waiting[call_id] = _CALLS[kind]
        elif kind in _CALLS.values():
            call_id = item.get("call_id")
            if waiting.get(call_id) != kind:
                problems.append(f"item {i}: {kind} {call_id!r} answers no earlier call")
            else:
                del waiting[call_id]
            if not isinstance(item.get("output"), str | list):
                problems.append(f"item {i}: {kind} without output")
        elif kind == "reasoning":
            following = value[i + 1] if i + 1 < len(value) else None
            if not isinstance(following, dict) or following.get("type") == "reasoning":
                problems.append(f"item {i}: reasoning without its required following item")
    for call_id in waiting:
        problems.append(f"No tool output found for function call {call_id}.")
    return problems


def _message_problems(i: int, item: dict[str, Any]) -> list[str]:
    role = item.get("role")
    if role not in ROLES:
        return [f"item {i}: unknown role {role!r}"]
    content = item.get("content")
    if isinstance(content, str):
        return []
    if not isinstance(content, list):
        return [f"item {i}: content is neither text nor a list"]
    return [
        f"item {i}: content part of type {p.get('type') if isinstance(p, dict) else p!r}"
        for p in content
        if not isinstance(p, dict) or p.get("type") not in PART_TYPES
    ]


@dataclass
class Answer:
    """What the fake answers to one /v1/responses call."""

    text: str | None = "Hello from the fake Responses upstream."
    # (name, arguments) of each function call it makes.
    calls: list[tuple[str, str]] = field(default_factory=list)
    # Emit a reasoning item (with encrypted_content) first, as reasoning models do.
    reasoning: bool = False
    status: int = 200
    error: dict[str, Any] | None = None


AnswerOrAwaitable = Answer | Awaitable[Answer]


def riding_summary(body: dict[str, Any]) -> Answer:
    """A summary of a riding call: the first user messages of its input, tagged."""
    texts = [
        part["text"]
        for item in body.get("input") or []
        if isinstance(item, dict) and item.get("role") == "user"
        for part in (item.get("content") if isinstance(item.get("content"), list) else [])
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    ]
    lines = [t.splitlines()[0][:200] for t in texts[:5] if t.strip()]
    return Answer(text="<summary>\n## User Goal\n" + "\n".join(lines) + "\n</summary>")


class FakeResponses(FakeUpstream):
    def __init__(self) -> None:
        super().__init__(routes=[Route("/v1/responses", self._responses, methods=["POST"])])
        self.respond: Callable[[dict[str, Any]], AnswerOrAwaitable] = lambda body: Answer()
        self.summarize_responses: Callable[[dict[str, Any]], Answer] = riding_summary
        self.problems: list[str] = []
        # The upstream's tokenizer, for `usage.input_tokens` (about four characters a token).
        self.count: Callable[[dict[str, Any]], int] = lambda body: (
            (len(json.dumps(body.get("input"))) + len(str(body.get("instructions") or ""))) // 4
        )
        # What its prompt cache served of a request (`input_tokens_details.cached_tokens`).
        self.cached: Callable[[dict[str, Any]], int] = lambda body: 0
        self._ids = count(1)

    def response_requests(self, purpose: str = "chat") -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.path == "/v1/responses" and r.purpose == purpose]

    async def _responses(self, request: Request) -> Response:
        rec = await self._record(request)
        body = rec.json
        problems = input_problems(body)
        if problems:
            with self.lock:
                self.problems += problems
            error = {"message": problems[0], "type": "invalid_request_error", "param": "input"}
            return JSONResponse({"error": {**error, "code": None}}, status_code=400)
        if rec.purpose == "summarize":
            reply = self.summarize_responses(body)
        else:
            answer = self.respond(body)
            reply = await answer if inspect.isawaitable(answer) else answer
        if reply.status >= 400:
            error = reply.error or {"error": {"message": "fake error", "type": "server_error"}}
            return JSONResponse(error, status_code=reply.status)
        output = self._output(reply)
        response = self._response(body, output, "completed")
        if not body.get("stream"):
            return JSONResponse(response)
        return StreamingResponse(
            self._response_events(body, output, response), media_type="text/event-stream"
        )

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):04d}"

    def _output(self, reply: Answer) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reply.reasoning:
            out.append(
                {
                    "type": "reasoning",
                    "id": self._id("rs"),
                    "summary": [],
                    "encrypted_content": "gAAAA" + "x" * 40,
                }
            )
        if reply.text is not None:
            out.append(
                {
                    "type": "message",
                    "id": self._id("msg"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": reply.text, "annotations": []}],
                }
            )
        for name, arguments in reply.calls:
            out.append(
                {
                    "type": "function_call",
                    "id": self._id("fc"),
                    "call_id": self._id("call"),
                    "name": name,
                    "arguments": arguments,
                    "status": "completed",
                }
            )
        return out

    def _response(
        self, body: dict[str, Any], output: list[dict[str, Any]], status: str
    ) -> dict[str, Any]:
        tokens = self.count(body)
        return {
            "id": "resp_fake",
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": body.get("model", "fake"),
            "output": output if status == "completed" else [],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": body.get("tools") or [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": {
                "input_tokens": tokens,
                "input_tokens_details": {"cached_tokens": self.cached(body)},
                "output_tokens": 7,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": tokens + 7,
            },
            "store": body.get("store", True),
            "metadata": {},
        }

    # Not `_events`: that is FakeUpstream's chat stream, which this fake serves too.
    async def _response_events(
        self, body: dict[str, Any], output: list[dict[str, Any]], final: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        for event in _stream(self._response(body, output, "in_progress"), output, final):
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _stream(
    started: dict[str, Any], output: list[dict[str, Any]], final: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """OpenAI's event sequence for these output items, numbered."""
    n = count()

    def ev(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(n), **fields}

    yield ev("response.created", response=started)
    yield ev("response.in_progress", response=started)
    for index, item in enumerate(output):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield ev(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield ev("response.content_part.added", **where, part=empty)
            for i in range(0, len(text), 8):
                yield ev("response.output_text.delta", **where, delta=text[i : i + 8], logprobs=[])
            yield ev("response.output_text.done", **where, text=text, logprobs=[])
            yield ev("response.content_part.done", **where, part=item["content"][0])
        elif item["type"] == "function_call":
            yield ev(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            where = {"item_id": item["id"], "output_index": index}
            yield ev("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield ev("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            yield ev("response.output_item.added", output_index=index, item=item)
        yield ev("response.output_item.done", output_index=index, item=item)
    yield ev("response.completed", response=final)
