"""The Messages API's answers: read as relayed, asked for by the summarizer, and Recap's errors.

A non-streamed answer is a `message` object; a streamed one is typed SSE events
(`message_start`, `content_block_start`, `content_block_delta`, `content_block_stop`,
`message_delta`, `message_stop`, `ping`, `error`), relayed to the client byte for byte
by the route. The copy is read after the stream ends: the blocks rebuilt from their
deltas (text, tool input JSON, thinking and its signature), the stop reason and the
usage (`message_start`'s, updated by `message_delta`'s). The archived message is the
answer in the neutral view (its text, its `tool_use` blocks as calls) with its blocks.

Usage: `input_tokens` counts only what the prompt cache did not serve; calibration
adds `cache_read_input_tokens` and `cache_creation_input_tokens` to it.

Recap's own errors on this route are Anthropic's shape (`ANTHROPIC_ERRORS`):
`{"type": "error", "error": {"type": ..., "message": ...}}`, and the same object as an
`event: error` inside a stream. The summarizer's call (`MESSAGES_SUMMARY`) is a
non-streamed Messages request with `x-api-key` and `anthropic-version`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from proxy.dialects.base import SummaryAnswer, SummaryCall
from proxy.errors import RecapError
from proxy.wire.sse import AnswerRecorder

API_VERSION = "2023-06-01"
# Where a neutral message keeps the blocks it stands for (the archive keeps them whole).
BLOCKS = "recap_blocks"
# Anthropic's error types by status (its documented ones; a status it does not list
# is an `api_error`).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Stop reasons read as the summarizer's finish reasons.
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_object(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


class AnthropicErrors:
    """Recap's errors as the Messages API writes errors: a body, and an `error` event."""

    def body(self, err: RecapError) -> bytes:
        return json.dumps(error_object(err.message, err.status)).encode()

    def event(self, err: RecapError) -> bytes:
        return b"event: error\ndata: " + self.body(err) + b"\n\n"


ANTHROPIC_ERRORS = AnthropicErrors()


def error_event(body: bytes, status: int) -> bytes:
    """An upstream's error answer as the `error` event of a stream already started: its own
    error object when it sent one, else one made from its status and text."""
    event: dict[str, Any] | None = None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        event = {"type": "error", "error": parsed["error"]}
    if event is None:
        text = body[:2000].decode("utf-8", "replace")
        event = error_object(text or f"upstream status {status}", status)
    return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


def prompt_tokens(usage: Mapping[str, Any]) -> int:
    """All the prompt's tokens: those the cache served or stored count too."""
    keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return sum(v for k in keys if isinstance(v := usage.get(k), int))


def answer_message(blocks: list[Any]) -> dict[str, Any]:
    """The answer's blocks as one assistant message of the neutral view (and the blocks)."""
    texts = [b["text"] for b in blocks if b.get("type") == "text" and _is_text(b.get("text"))]
    calls = [
        {
            "id": b.get("id"),
            "type": "function",
            "function": {
                "name": b.get("name") or "",
                "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False),
            },
        }
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    message[BLOCKS] = blocks
    return message


class MessagesRecorder(AnswerRecorder):
    def __init__(self, streamed: bool, encoding: str = "", limit: int = 8 * 1024 * 1024) -> None:
        super().__init__(streamed, encoding, limit)
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial: dict[int, list[str]] = {}
        self.stop_reason: str | None = None
        self.message_id: str | None = None

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            start = event["message"]
            self.model = start.get("model") if isinstance(start.get("model"), str) else None
            self.message_id = start.get("id")
            if isinstance(start.get("usage"), dict):
                self.usage = dict(start["usage"])
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            self.blocks[_index(event)] = dict(event["content_block"])
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            self._delta(_index(event), event["delta"])
        elif kind == "content_block_stop":
            self._close(_index(event))
        elif kind == "message_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                self.stop_reason = delta["stop_reason"]
            if isinstance(event.get("usage"), dict):
                # Its counts are cumulative: they replace message_start's where given.
                self.usage = {**(self.usage or {}), **event["usage"]}
        elif kind == "error":
            self.error = event.get("error", event)

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        for name, key in (
            ("text_delta", "text"),
            ("thinking_delta", "thinking"),
            ("signature_delta", "signature"),
        ):
            if kind == name and isinstance(delta.get(key), str):
                block[key] = str(block.get(key) or "") + delta[key]
        if kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            self.partial.setdefault(index, []).append(delta["partial_json"])
        elif kind == "citations_delta" and isinstance(delta.get("citation"), dict):
            block.setdefault("citations", []).append(delta["citation"])

    def _close(self, index: int) -> None:
        pieces = self.partial.pop(index, None)
        block = self.blocks.get(index)
        if pieces is None or block is None:
            return
        try:
            block["input"] = json.loads("".join(pieces) or "{}")
        except ValueError:
            block["input"] = "".join(pieces)

    def result(self) -> dict[str, Any]:
        body = None if self.truncated else self._decoded()
        if body is None:
            return {"message": None, "truncated": self.truncated, "unparsed": True}
        if not self.streamed:
            try:
                whole = json.loads(body)
            except ValueError:
                whole = None
            if not isinstance(whole, dict):
                return {"message": None, "truncated": False, "unparsed": True}
            content = whole.get("content")
            listed = content if isinstance(content, list) else []
            blocks = [b for b in listed if isinstance(b, dict)]
            return {
                "message": answer_message(blocks) if whole.get("type") == "message" else None,
                "finish_reason": whole.get("stop_reason"),
                "usage": whole.get("usage"),
                "model": whole.get("model"),
                "error": whole.get("error"),
                "truncated": False,
            }
        self._parse_stream(body)
        for index in list(self.partial):
            self._close(index)
        blocks = [self.blocks[i] for i in sorted(self.blocks)]
        return {
            "message": answer_message(blocks),
            "finish_reason": self.stop_reason,
            "usage": self.usage,
            "model": self.model,
            "error": self.error,
            "truncated": self.truncated,
        }


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _index(event: Mapping[str, Any]) -> int:
    index = event.get("index")
    return index if isinstance(index, int) else 0


class MessagesSummaryCall:
    """The summarizer's call as a Messages request: the scene's system, one user message."""

    path = "/v1/messages"
    headers: Mapping[str, str] = {"anthropic-version": API_VERSION}

    def request(
        self, model: str, system: str, user: str, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        extra = dict(options)
        if "temperature" in extra:
            # Current Claude models take one of the two; the scene's temperature is the
            # setting that matters (its top_p is 1).
            extra.pop("top_p", None)
        extra.setdefault("max_tokens", 4096)  # the API requires it
        return {
            "model": model,
            "system": system,
            "messages": [{"role": "user", "content": user}],
            **extra,
        }

    def credentials(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key}

    def answer(self, data: Any) -> SummaryAnswer:
        content = data["content"]
        texts = [b["text"] for b in content if b.get("type") == "text"]
        stop = data.get("stop_reason")
        usage = data.get("usage") or {}
        model = data.get("model")
        return SummaryAnswer(
            "".join(texts) if texts else None,
            _FINISH.get(stop, stop) if isinstance(stop, str) else None,
            prompt_tokens(usage),
            int(usage.get("output_tokens") or 0),
            model if isinstance(model, str) and model else None,
        )


MESSAGES_SUMMARY: SummaryCall = MessagesSummaryCall()
